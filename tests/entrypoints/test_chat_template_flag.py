"""A chat template given by the user (vLLM's --chat-template, LLM.chat's chat_template, the request's chat_template).

The cycle model (tests/cycle_model.py) answers greedily from its prompt's last token alone, so which template
rendered a conversation shows in the answer: its own template ends with "\\n" (the answer starts at the cycle's
head, "é"), TEMPLATE here with " " (the answer starts "ab"). The server tests run in-process on a base model (no
template at all); the flag itself goes through the serve CLI once, in a server process.
"""

from __future__ import annotations

import httpx
import pytest

from jaxpaged.utils.chat_template import load_chat_template
from tests.cycle_model import greedy_text, write_cycle_model
from tests.entrypoints.asgi import ENGINE, MODEL, run

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}ANSWER: {% endif %}")  # fmt: skip
TOOL_TEMPLATE = TEMPLATE + "{# calls: <tool_call>{...}</tool_call> #}"  # shows hermes' format
THINK_TEMPLATE = TEMPLATE + "{# <think>...</think> #}"  # shows qwen3's markers
N = 6
OURS, THEIRS = greedy_text(ord(" "), N), greedy_text(ord("\n"), N)  # the answer after TEMPLATE / the model's own
USER = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "max_tokens": N}


def _rendered(messages=USER) -> str:
    return "".join(f"[{m['role']}] {m['content']}\n" for m in messages) + "ANSWER: "


@pytest.fixture(scope="module")
def base_engine(tmp_path_factory):
    """A base model (its tokenizer has no chat template) behind an async engine, its loop started."""
    from jaxpaged import LLM
    from jaxpaged.engine.async_engine import AsyncLLMEngine

    folder = write_cycle_model(tmp_path_factory.mktemp("base"), chat_template=None)
    engine = AsyncLLMEngine(LLM(str(folder), log_level="WARNING", **ENGINE).engine)
    engine.start()
    yield engine
    engine.shutdown()


def _app(engine, **settings):
    from jaxpaged.entrypoints.openai import ServerSettings, build_app

    return build_app(engine, ServerSettings([MODEL], **settings))


def _post(app, path: str, body: dict) -> httpx.Response:
    async def work(http):
        return await http.post(path, json={"model": MODEL, **body})

    return run(app, work, base_url="http://t")


def test_the_flag_takes_a_file_or_jinja_and_names_itself_otherwise(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE  # a file is read
    assert load_chat_template(TEMPLATE) == TEMPLATE  # Jinja text is the template
    assert load_chat_template(None) is None
    for bad in (str(tmp_path / "missing.jinja"), "template_name", str(tmp_path)):  # a path that does not open
        with pytest.raises(ValueError, match=r"^--chat-template .* looks like a file path"):
            load_chat_template(bad)
    (tmp_path / "empty.jinja").write_text(" \n")
    with pytest.raises(ValueError, match="--chat-template .*empty"):
        load_chat_template(str(tmp_path / "empty.jinja"))
    with pytest.raises(ValueError, match="--chat-template must be"):
        load_chat_template("")


def test_a_base_model_is_refused_pointing_to_the_flag(base_engine):
    r = _post(_app(base_engine), "/v1/chat/completions", {"messages": USER, **GREEDY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "--chat-template" in r.json()["error"]["message"]
    r = _post(_app(base_engine), "/tokenize", {"messages": USER})
    assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]


def test_the_servers_template_renders_chat_tokenize_responses_and_messages(base_engine, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    app = _app(base_engine, chat_template=str(path))
    r = _post(app, "/v1/chat/completions", {"messages": USER, **GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == OURS
    assert r.json()["usage"]["prompt_tokens"] == len(_rendered().encode())  # a byte a token
    tok = _post(app, "/tokenize", {"messages": USER}).json()
    assert bytes(tok["tokens"]).decode() == _rendered()
    r = _post(app, "/v1/responses", {"input": "hi", "temperature": 0, "max_output_tokens": N})
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == OURS
    r = _post(app, "/v1/messages", {"messages": USER, "max_tokens": N, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == OURS


def test_the_parsers_are_detected_from_the_template_in_use(base_engine):
    from jaxpaged.entrypoints.openai import ServerSettings
    from jaxpaged.entrypoints.openai.serving import Serving

    plain = Serving(base_engine, ServerSettings([MODEL], chat_template=TEMPLATE))
    assert (plain.tool_parser, plain.reasoning_parser) == (None, None)
    assert Serving(base_engine, ServerSettings([MODEL], chat_template=TOOL_TEMPLATE)).tool_parser == "hermes"
    assert Serving(base_engine, ServerSettings([MODEL], chat_template=THINK_TEMPLATE)).reasoning_parser == "qwen3"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]  # "auto" needs the detected parser
    body = {"messages": USER, "tools": tools, **GREEDY}
    assert _post(_app(base_engine, chat_template=TEMPLATE), "/v1/chat/completions", body).status_code == 400
    r = _post(_app(base_engine, chat_template=TOOL_TEMPLATE), "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []


def test_a_requests_template_needs_the_trust_flag(base_engine):
    body = {"messages": USER, "chat_template": TEMPLATE, **GREEDY}
    for path, payload in (("/v1/chat/completions", body), ("/tokenize", {"messages": USER, "chat_template": TEMPLATE})):
        r = _post(_app(base_engine, chat_template=TOOL_TEMPLATE), path, payload)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        assert "--trust-request-chat-template" in r.json()["error"]["message"]
    trusted = _app(base_engine, trust_request_chat_template=True)
    r = _post(trusted, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == OURS
    assert bytes(_post(trusted, "/tokenize", {"messages": USER, "chat_template": TEMPLATE}).json()["tokens"]).decode() == _rendered()
    r = _post(trusted, "/v1/chat/completions", {**body, "chat_template": "{% for m in messages %}"})  # broken Jinja
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert _post(trusted, "/v1/chat/completions", {"messages": USER, **GREEDY}).status_code == 400  # none: still none


def test_llm_chat_takes_a_template_per_call(tmp_path):
    from jaxpaged import LLM, SamplingParams

    llm = LLM(str(write_cycle_model(tmp_path / "m")), log_level="WARNING", **ENGINE)  # with its own template
    params = SamplingParams(temperature=0, max_tokens=N)
    own, = llm.chat(USER, params, use_tqdm=False)
    ours, = llm.chat(USER, params, use_tqdm=False, chat_template=TEMPLATE)
    assert own.outputs[0].text == THEIRS and ours.outputs[0].text == OURS and ours.prompt == _rendered()
    with pytest.raises(ValueError, match="chat_template must be"):
        llm.chat(USER, params, use_tqdm=False, chat_template="")


def test_generate_chat_takes_the_flag(tmp_path, capsys):
    from jaxpaged.entrypoints import generate

    folder = write_cycle_model(tmp_path / "base", chat_template=None)
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    flags = ["--model", str(folder), "--max-tokens", str(N), "--temperature", "0", "--dtype", "float32", "--max-model-len", "512",
             "--num-kv-blocks", "64", "--quiet"]  # fmt: skip
    assert generate.main([*flags, "--chat", "hi"]) == 2
    assert "--chat-template" in capsys.readouterr().err  # a base model: the error says what to give
    assert generate.main([*flags, "--chat", "--chat-template", str(path), "hi"]) == 0
    assert OURS in capsys.readouterr().out
    assert generate.main([*flags, "--chat", "--chat-template", str(tmp_path / "nope.jinja"), "hi"]) == 2
    err = capsys.readouterr().err
    assert "--chat-template" in err and "looks like a file path" in err
    with pytest.raises(SystemExit):
        generate.main([*flags, "--chat-template", str(path), "hi"])  # without --chat


def test_serve_stops_on_an_unreadable_template_before_the_engine_loads(tmp_path, capsys):
    from jaxpaged.entrypoints import serve

    assert serve.main(["--model", str(tmp_path / "no-model"), "--chat-template", str(tmp_path / "nope.jinja")]) == 2
    err = capsys.readouterr().err
    assert "--chat-template" in err and "looks like a file path" in err and "no-model" not in err


def test_serve_reads_the_flag(tmp_path):
    """The one server process: a base model served with --chat-template FILE answers chat through it."""
    from tests.server_harness import ServerProcess

    folder = write_cycle_model(tmp_path / "base", chat_template=None)
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    server = ServerProcess(["--model", str(folder), "--served-model-name", MODEL, "--chat-template", str(path), "--dtype",
                            "float32", "--max-model-len", "512", "--num-kv-blocks", "64", "--no-precompile"],
                           tmp_path / "server.log")  # fmt: skip
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": USER, **GREEDY}, timeout=120)
        assert r.status_code == 200, server.log()
        assert r.json()["choices"][0]["message"]["content"] == OURS
    finally:
        server.stop()


def test_gpt_oss_harmony_refuses_a_template_rather_than_dropping_it(tmp_path):
    """vLLM renders GPT-OSS through openai-harmony whatever template is given; here the template is refused, named."""
    pytest.importorskip("openai_harmony", reason="openai-harmony (the harmony extra) is not installed")
    pytest.importorskip("torch")
    from jaxpaged import LLM
    from jaxpaged.engine.async_engine import AsyncLLMEngine
    from jaxpaged.entrypoints.openai import ServerSettings
    from jaxpaged.entrypoints.openai.serving import Serving
    from jaxpaged.utils.harmony import harmony_encoding
    from tests.harmony_model import harmony_tokenizer, write_gpt_oss_harmony_model

    try:
        harmony_encoding()
    except ValueError as exc:
        pytest.skip(f"openai-harmony cannot load its o200k vocabulary here: {exc}")
    tokenizer = harmony_tokenizer()
    if tokenizer is None:
        pytest.skip("litellm's o200k_base.tiktoken is not installed here")
    llm = LLM(str(write_gpt_oss_harmony_model(tmp_path / "gpt_oss", tokenizer)), dtype="float32", max_num_seqs=2,
              max_num_batched_tokens=64, block_size=8, num_kv_blocks=128, precompile=False, log_level="WARNING")  # fmt: skip
    assert llm.engine.harmony
    with pytest.raises(ValueError, match="^chat_template: GPT-OSS's conversations are rendered by openai-harmony"):
        llm.chat(USER, use_tqdm=False, chat_template=TEMPLATE)
    engine = AsyncLLMEngine(llm.engine)  # (its loop never starts: every refusal comes before a request is queued)
    with pytest.raises(ValueError, match="^--chat-template: GPT-OSS's prompts are rendered by openai-harmony"):
        Serving(engine, ServerSettings([MODEL], chat_template=TEMPLATE))
    r = _post(_app(engine, trust_request_chat_template=True), "/v1/chat/completions",
              {"messages": USER, "chat_template": TEMPLATE, **GREEDY})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template" and "openai-harmony" in r.text

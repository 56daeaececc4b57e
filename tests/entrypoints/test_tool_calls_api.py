"""tool_choice "auto" end to end: the tool model (tests/tool_model.py) answers a chat prompt with a Hermes
`<tool_call>` answer, which the server reads with the parser it found in the chat template, whole and streamed
(through httpx and the openai client); tools reach the template; a conversation goes on after the calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests import REPO
from tests.conftest import ENGINE_ARGS
from tests.tool_model import CALL_TEXT, CALLS, CONTENT, write_tool_model

MODEL = "tool-model"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Weather in Oslo?"}]
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "forecast",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now"}},
]  # fmt: skip
OPEN = [*USER, {"role": "assistant", "content": "Forecast:"}]  # left open: the model answers " Sunny." in text


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tool_model(tmp_path_factory.mktemp("tool-model"))


@pytest.fixture(scope="module")
def tool_server(model_dir, tmp_path_factory):
    from tests.server_harness import ServerProcess

    proc = ServerProcess(["--model", str(model_dir), "--served-model-name", MODEL, "--log-level", "INFO", *ENGINE_ARGS],
                         tmp_path_factory.mktemp("tool-server") / "server.log")  # fmt: skip
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(tool_server):
    with httpx.Client(base_url=tool_server.url, timeout=120) as client:
        yield client


def _body(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 40, "temperature": 0, **fields}


def _chat(http, **fields) -> dict:
    r = http.post(CHAT, json=_body(**fields))
    assert r.status_code == 200, r.text
    return r.json()


def _chunks(http, **fields) -> list[dict]:
    with http.stream("POST", CHAT, json=_body(stream=True, **fields)) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_the_server_found_the_hermes_parser(tool_server, http):
    assert "hermes parser" in tool_server.log()
    plain = _chat(http, tool_choice="none", tools=TOOLS)["choices"][0]
    assert plain["message"]["content"] == CALL_TEXT and "tool_calls" not in plain["message"]  # "none": text as written


@pytest.mark.parametrize("tool_choice", [None, "auto"], ids=["default", "auto"])
def test_auto_returns_the_calls_the_model_wrote(http, tool_choice):
    fields = {"tools": TOOLS} if tool_choice is None else {"tools": TOOLS, "tool_choice": tool_choice}
    (choice,) = _chat(http, **fields)["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == CONTENT
    calls = message["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == CALLS
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 3}


def test_auto_streams_content_then_each_call_in_pieces(http):
    chunks = _chunks(http, tools=TOOLS, n=2)
    by_choice: dict[int, list[dict]] = {}
    for chunk in chunks:
        (c,) = chunk["choices"]
        by_choice.setdefault(c["index"], []).append(c)
    for choices in by_choice.values():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        content = "".join(c["delta"].get("content") or "" for c in choices)
        assert content == CONTENT  # no "<tool_call>" nor a piece of it leaks into the content
        pieces = [c["delta"]["tool_calls"] for c in choices if c["delta"].get("tool_calls")]
        assert all(len(p) == 1 for p in pieces)
        pieces = [p[0] for p in pieces]
        first = [p for p in pieces if "id" in p]
        assert [(p["index"], p["type"], p["function"]) for p in first] == [
            (0, "function", {"name": "weather", "arguments": ""}), (1, "function", {"name": "now", "arguments": ""})]
        args = ["".join(p["function"]["arguments"] for p in pieces if p["index"] == k and "id" not in p)
                for k in (0, 1)]
        assert args == [a for _, a in CALLS]  # the pieces add up to the unstreamed arguments, exactly
        assert 1 <= sum(p["index"] == 0 and "id" not in p for p in pieces) <= 3  # at most one per token
        assert all(c["finish_reason"] is None for c in choices[:-1]) and choices[-1]["finish_reason"] == "tool_calls"
    assert sorted(by_choice) == [0, 1]


def test_auto_plain_answer_is_content(http):
    fields = {"tools": TOOLS, "messages": OPEN, "add_generation_prompt": False}
    (choice,) = _chat(http, **fields)["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": " Sunny.", "tool_calls": []}
    chunks = _chunks(http, **fields)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == " Sunny."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)


def test_a_call_cut_short_keeps_its_partial_arguments(http):
    # 5 tokens: the text, the tag, the name and the arguments' first two pieces
    (choice,) = _chat(http, tools=TOOLS, max_tokens=5)["choices"]
    assert choice["finish_reason"] == "length"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("weather", '{"city": "Oslo", ')]
    chunks = _chunks(http, tools=TOOLS, max_tokens=5)
    args = [c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] for c in chunks
            if c["choices"][0]["delta"].get("tool_calls")]  # fmt: skip
    assert "".join(args) == '{"city": "Oslo", ' and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_tools_reach_the_chat_template(http, model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def rendered(**kwargs) -> int:
        ids = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, **kwargs)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    with_tools, without = rendered(tools=TOOLS), rendered()
    assert with_tools > without
    assert _chat(http, tools=TOOLS)["usage"]["prompt_tokens"] == with_tools
    assert _chat(http, tools=TOOLS, tool_choice="none")["usage"]["prompt_tokens"] == with_tools  # as vLLM
    assert _chat(http)["usage"]["prompt_tokens"] == without


def test_the_conversation_goes_on_after_the_calls(http, model_dir):
    first = _chat(http, tools=TOOLS)["choices"][0]["message"]
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "12:00"} for c in first["tool_calls"]]
    messages = [*USER, first, *results, {"role": "assistant", "content": "Forecast:"}]
    r = _chat(http, tools=TOOLS, messages=messages, add_generation_prompt=False)
    assert r["choices"][0]["message"]["content"] == " Sunny."
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    for m in messages:
        for c in m.get("tool_calls") or ():
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])  # what templates get
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=False, tokenize=False)
    assert '{"name": "weather", "arguments": {"city": "Oslo", "days": 3}}' in text and "12:00" in text
    assert r["usage"]["prompt_tokens"] == len(tokenizer(text, add_special_tokens=False)["input_ids"])


# SmolLM2-135M-Instruct's template (the built-in model's): it concatenates every message's content
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_tool_call_turn_without_content_reaches_the_template_as_empty_text(model_dir):
    """The openai client sends an assistant's tool-call turn back with content null; as in vLLM the template gets
    "" (a missing content made SmolLM2's template fail, so the built-in model refused every conversation with calls)."""
    from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest

    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [
        *USER, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]})  # fmt: skip
    conversation = body.conversation()
    assert conversation[1]["content"] == "" and conversation[1]["tool_calls"][0]["function"]["arguments"] == {}
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = tokenizer.apply_chat_template(conversation, chat_template=SMOLLM2_TEMPLATE, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n12:00<|im_end|>\n" in text


@pytest.mark.parametrize(
    ("message", "param"),
    [({"role": "assistant", "content": None}, "messages.1.content"),
     ({"role": "assistant", "content": None, "tool_calls": [{"id": "x", "type": "function",
                                                              "function": {"name": "now", "arguments": "{"}}]},
      "messages.1.tool_calls")],
)  # fmt: skip
def test_bad_assistant_messages_are_400(http, message, param):
    r = http.post(CHAT, json=_body(messages=[*USER, message, *USER]))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_openai_client_gets_tool_calls(tool_server):
    client = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, temperature=0, max_tokens=40)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == CONTENT
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == CALLS
    stream = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, temperature=0, max_tokens=40,
                                            stream=True)  # fmt: skip
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for delta_call in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(delta_call.index, [delta_call.function.name, ""])
            entry[1] += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and [tuple(calls[k]) for k in sorted(calls)] == CALLS


def test_llm_chat_passes_tools_to_the_template(model_dir):
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.entrypoints.openai.tool_parsers import tool_reader

    # the servers' configuration, so the persistent XLA cache already holds its steps
    llm = LLM(str(model_dir), dtype="float32", max_model_len=512, max_num_seqs=32, max_num_batched_tokens=64,
              block_size=8, num_kv_blocks=1024, log_level="WARNING")  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=40)
    with_tools, without = (llm.chat(USER, params, use_tqdm=False, tools=tools)[0] for tools in (TOOLS, None))
    tokenizer = llm.get_tokenizer()
    want = tokenizer.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert with_tools.prompt_token_ids == tokenizer(want, add_special_tokens=False)["input_ids"]
    assert len(with_tools.prompt_token_ids) > len(without.prompt_token_ids)
    assert with_tools.outputs[0].text == CALL_TEXT  # the calls stay in the text; a parser reads them
    content, calls = tool_reader("auto", "hermes").parse(with_tools.outputs[0].text)
    assert (content, [(c.name, c.arguments) for c in calls]) == (CONTENT, CALLS)


def test_flags_choose_the_parser_and_keep_tools_out_under_none(model_dir, tmp_path):
    from tests.server_harness import ServerProcess

    flags = ["--tool-call-parser", "llama3_json", "--exclude-tools-when-tool-choice-none", "--enable-auto-tool-choice"]
    args = ["--model", str(model_dir), "--served-model-name", MODEL, *flags, *ENGINE_ARGS]
    proc = ServerProcess(args, tmp_path / "log")
    try:
        with httpx.Client(base_url=proc.url, timeout=120) as http:
            (choice,) = _chat(http, tools=TOOLS)["choices"]  # read as Llama 3.1 JSON, the Hermes answer is text
            assert choice["finish_reason"] == "stop"
            assert choice["message"] == {"role": "assistant", "content": CALL_TEXT, "tool_calls": []}
            prompt = {k: _chat(http, **f)["usage"]["prompt_tokens"] for k, f in
                      (("none", {"tools": TOOLS, "tool_choice": "none"}), ("auto", {"tools": TOOLS}), ("no tools", {}))}
            assert prompt["none"] == prompt["no tools"] < prompt["auto"]
    finally:
        proc.stop()


def test_enable_auto_tool_choice_needs_a_parser(cycle_model_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    args = ["--model", str(cycle_model_dir), "--enable-auto-tool-choice", "--no-precompile", "--port", "1",
            *ENGINE_ARGS]
    out = subprocess.run([sys.executable, "-m", "jaxpaged.serve", *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 2 and "--tool-call-parser" in out.stderr, out.stderr[-2000:]


def test_no_leak(tool_server):
    assert "Traceback" not in tool_server.log()
    m = tool_server.wait_metrics(lambda v: v["jaxpaged:kv_blocks_used"] == 0)
    assert m["jaxpaged:kv_blocks_used"] == 0 and m["jaxpaged:engine_alive"] == 1

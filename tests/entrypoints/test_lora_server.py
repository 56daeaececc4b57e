"""LoRA on the OpenAI server: --lora-modules adapters listed by /v1/models with their parent and selected by `model`
(greedy text equal to transformers + PEFT), runtime load/unload behind --allow-runtime-lora-updating and the API key
(and absent without it), errors in OpenAI's format; and `python -m jaxpaged.generate --lora NAME=PATH`."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import CYCLE_MODEL, ENGINE_ARGS
from tests.server_harness import ServerProcess

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
openai = pytest.importorskip("openai")
import transformers  # noqa: E402

from tests.models.test_lora import write_peft_adapter  # noqa: E402

KEY = "lora-key"
PROMPT = "ab"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(cycle_model_dir, tmp_path_factory):
    """Two PEFT adapters on the cycle model, and each one's (and the base's) greedy text from transformers + PEFT."""
    base = transformers.AutoModelForCausalLM.from_pretrained(cycle_model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(cycle_model_dir)
    root = tmp_path_factory.mktemp("cycle-adapters")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids

    def greedy(model):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, pad_token_id=0)  # fmt: skip
        return tokenizer.decode(out[0, ids.shape[1]:])

    texts = {"base": greedy(base)}
    for i, name in enumerate(("first", "second")):
        model = write_peft_adapter(base, root / name, 4, 8, ["q_proj", "up_proj", "down_proj"], False, seed=30 + i)
        texts[name] = greedy(model)
    return root, texts


@pytest.fixture(scope="module")
def server(cycle_model_dir, adapters, tmp_path_factory):
    root, _ = adapters
    proc = ServerProcess(
        ["--model", str(cycle_model_dir), "--served-model-name", CYCLE_MODEL, *ENGINE_ARGS, "--enable-lora", "--max-loras", "2",
         "--max-lora-rank", "8", "--lora-modules", f"first={root / 'first'}", "--allow-runtime-lora-updating",
         "--no-precompile"],  # each test's few shapes compile on first use: minutes less than every bucket
        tmp_path_factory.mktemp("lora-server") / "server.log", api_key=KEY,
    )  # fmt: skip
    yield proc
    proc.stop()


def _client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)


def _complete(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    return out.choices[0].text, out.model


def test_models_lists_adapters_with_their_parent(server):
    models = {m.id: m for m in _client(server).models.list().data}
    assert CYCLE_MODEL in models and "first" in models
    assert models["first"].model_dump()["parent"] == CYCLE_MODEL


def test_model_name_selects_the_adapter(server, adapters):
    _, texts = adapters
    assert texts["first"] != texts["base"]  # not vacuous: the adapter changes the greedy text
    client = _client(server)
    assert _complete(client, "first") == (texts["first"], "first")
    assert _complete(client, CYCLE_MODEL) == (texts["base"], CYCLE_MODEL)
    chat = client.chat.completions.create(model="first", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "first"


def test_runtime_load_and_unload(server, adapters):
    root, texts = adapters
    client = _client(server)
    url, auth = server.url, {"Authorization": f"Bearer {KEY}"}
    body = {"lora_name": "second", "lora_path": str(root / "second")}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401  # the key is needed
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth).status_code == 200
    assert _complete(client, "second")[0] == texts["second"]
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(root / "nowhere")}, headers=auth)
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "lora_path" and "not a folder" in bad.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "second"}, headers=auth).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "second")
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "second"}, headers=auth)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_not_found"
    assert _complete(client, "first")[0] == texts["first"]  # still serving


def test_without_runtime_updating_the_load_routes_are_not_found(cycle_model_dir, adapters):
    """--enable-lora and --lora-modules but no --allow-runtime-lora-updating: the adapter is served, and loading or
    unloading one is a 404 in OpenAI's format (the app in-process over a real engine; no step runs)."""
    import asyncio

    from jaxpaged import LLM
    from jaxpaged.engine.async_engine import AsyncLLMEngine
    from jaxpaged.entrypoints.openai import ServerSettings, build_app

    root, _ = adapters
    llm = LLM(str(cycle_model_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=2,
              max_num_batched_tokens=16, block_size=8, precompile=False, log_level="WARNING")  # fmt: skip
    settings = ServerSettings([CYCLE_MODEL], lora_modules=[("first", str(root / "first"))])
    app = build_app(AsyncLLMEngine(llm.engine), settings)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            models = (await client.get("/v1/models")).json()["data"]
            assert {m["id"]: m.get("parent") for m in models} == {CYCLE_MODEL: None, "first": CYCLE_MODEL}
            body = {"lora_name": "second", "lora_path": str(root / "second")}
            for route, payload in (("load", body), ("unload", {"lora_name": "first"})):
                r = await client.post(f"/v1/{route}_lora_adapter", json=payload)
                assert r.status_code == 404, (route, r.text)
                assert r.json()["error"]["type"] == "not_found" and r.json()["error"]["message"]
            assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [CYCLE_MODEL, "first"]

    asyncio.run(main())
    assert [r.lora_name for r in llm.engine.list_loras()] == ["first"]  # nothing loaded or unloaded by the 404s


def test_generate_cli_runs_the_prompt_with_the_adapter(cycle_model_dir, adapters, tmp_path, capsys):
    """`python -m jaxpaged.generate --lora first=PATH`: the text transformers + PEFT give with that adapter; a malformed
    flag or a bad adapter is exit status 2 with the reason."""
    import json

    from jaxpaged.entrypoints import generate

    root, texts = adapters
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    flags = ["--model", str(cycle_model_dir), "--dtype", "float32", "--max-tokens", str(MAX_TOKENS), "--max-num-seqs", "2",
             "--max-num-batched-tokens", "16", "--block-size", "8", "--max-lora-rank", "8", "--quiet"]  # fmt: skip
    out = tmp_path / "out.jsonl"
    assert generate.main([*flags, "--lora", f"first={root / 'first'}", "--prompts-file", str(prompts), "--output", str(out)]) == 0
    assert json.loads(out.read_text())["text"] == texts["first"] != texts["base"]
    assert generate.main([*flags, "--lora", str(root / "first"), "--prompts-file", str(prompts)]) == 2
    assert "--lora takes NAME=PATH" in capsys.readouterr().err
    assert generate.main([*flags, "--lora", f"gone={root / 'nowhere'}", "--prompts-file", str(prompts)]) == 2
    assert "not a folder" in capsys.readouterr().err

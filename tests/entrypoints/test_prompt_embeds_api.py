"""/v1/completions' prompt_embeds (vLLM's: base64 of torch.save'd [T, hidden] tensors) on the cycle model in-process:
the same text as the token prompt whose embeddings were sent, alone, listed and beside `prompt`, streamed; usage
counts the rows; 400s in OpenAI's format naming prompt_embeds for bad bytes, a wrong size, a server without
--enable-prompt-embeds and one without torch."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import sys

import httpx
import pytest

torch = pytest.importorskip("torch")
import transformers  # noqa: E402

ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32, block_size=8, num_kv_blocks=64,
              precompile=False, log_level="WARNING")  # fmt: skip


def _app(folder, **kwargs):
    from jaxpaged import LLM
    from jaxpaged.engine.async_engine import AsyncLLMEngine
    from jaxpaged.entrypoints.openai import ServerSettings, build_app

    engine = AsyncLLMEngine(LLM(str(folder), **{**ENGINE, **kwargs}).engine)
    return build_app(engine, ServerSettings(["m"])), engine


def _call(app, bodies: list[dict]) -> list[httpx.Response]:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            return [await c.post("/v1/completions", json=body) for body in bodies]

    return asyncio.run(main())


def _b64(tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def table(cycle_model_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(cycle_model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(cycle_model_dir)
    return lambda text: hf.get_input_embeddings()(torch.tensor(tok(text, add_special_tokens=False).input_ids)).detach()


@pytest.fixture(scope="module")
def served(cycle_model_dir):
    app, engine = _app(cycle_model_dir, enable_prompt_embeds=True)
    yield app
    engine.shutdown()


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_embeddings_complete_as_their_tokens_listed_streamed_and_beside_prompt(served, table):
    greedy = {"model": "m", "max_tokens": 6, "temperature": 0}
    by_text, alone, listed, both, streamed = _call(served, [
        {**greedy, "prompt": "ab"},
        {**greedy, "prompt_embeds": _b64(table("ab"))},
        {**greedy, "prompt_embeds": [_b64(table("ab")), _b64(table("ж a").to(torch.bfloat16))]},
        {**greedy, "prompt": "ж a", "prompt_embeds": _b64(table("ab")[None])},  # a batch of one, as vLLM squeezes
        {**greedy, "prompt_embeds": _b64(table("ab")), "stream": True, "stream_options": {"include_usage": True}},
    ])  # fmt: skip
    text = by_text.json()["choices"][0]["text"]
    assert text and alone.json()["choices"][0]["text"] == text
    assert alone.json()["usage"]["prompt_tokens"] == by_text.json()["usage"]["prompt_tokens"] == 2
    other = _call(served, [{**greedy, "prompt": "ж a"}])[0].json()["choices"][0]["text"]
    assert [c["text"] for c in listed.json()["choices"]] == [text, other]
    assert [c["text"] for c in both.json()["choices"]] == [text, other]  # the embeddings' prompts first (vLLM's order)
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    assert chunks[-1]["usage"]["prompt_tokens"] == 2


def test_bad_prompt_embeds_are_400s_naming_the_field(served, table, monkeypatch):
    buffer = io.BytesIO()
    torch.save({"not": "a tensor"}, buffer)
    cases = [
        ({"prompt_embeds": "not base64!"}, "prompt_embeds", "base64"),
        ({"prompt_embeds": base64.b64encode(b"junk").decode()}, "prompt_embeds", "torch.save"),
        ({"prompt_embeds": base64.b64encode(buffer.getvalue()).decode()}, "prompt_embeds", "tensor"),
        ({"prompt_embeds": _b64(torch.zeros(3, 7))}, "prompt_embeds", "hidden size"),
        ({"prompt_embeds": _b64(torch.full((2, table("a").shape[1]), float("nan")))}, "prompt_embeds", "non-finite"),
        ({"prompt_embeds": []}, "prompt_embeds", "non-empty"),
        ({"prompt_embeds": _b64(table("ab")), "echo": True}, "echo", "prompt_embeds"),
        ({"prompt_embeds": _b64(table("ab")), "prompt_logprobs": 1}, "prompt_logprobs", "prompt_embeds"),
        ({}, "prompt", "prompt_embeds"),
    ]
    responses = _call(served, [{"model": "m", "max_tokens": 2, **body} for body, _, _ in cases])
    for r, (_, param, words) in zip(responses, cases):
        err = _error(r)
        assert err["param"] == param and words in err["message"], err
    body = {"model": "m", "prompt_embeds": _b64(table("ab"))}
    monkeypatch.setitem(sys.modules, "torch", None)  # a server without torch
    err = _error(_call(served, [body])[0])
    assert err["param"] == "prompt_embeds" and "torch" in err["message"]
    monkeypatch.undo()
    assert _call(served, [{"model": "m", "prompt": "ab", "max_tokens": 2}])[0].status_code == 200  # still serving


def test_a_server_without_the_flag_refuses_prompt_embeds(cycle_model_dir, table):
    app, engine = _app(cycle_model_dir)
    try:
        r, ok = _call(app, [{"model": "m", "prompt_embeds": _b64(table("ab"))}, {"model": "m", "prompt": "ab", "max_tokens": 2}])
    finally:
        engine.shutdown()
    err = _error(r)
    assert err["param"] == "prompt_embeds" and "--enable-prompt-embeds" in err["message"]
    assert ok.status_code == 200

"""Beam search on the server (vLLM's use_beam_search, length_penalty; older vLLM's early_stopping).

A tiny random Llama over a 32-token vocabulary with two EOS ids (as tests/engine/test_beam_search.py), so beams end
on EOS at different lengths and length_penalty changes which win, with the cycle model's byte tokenizer (token i is
byte i, so a choice's text spells its token ids). The server's choices are the engine's own beams (LLM.beam_search,
computed before the server's loop starts) and transformers' generate(num_beams=...); streamed, each choice comes
whole in one chunk once the search ends, as vLLM's server sends beam search results.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.entrypoints.asgi import MODEL, run
from tests.hf_reference import random_hf_model, save_hf_model, tiny_llama_config, torch

PROMPT = [5, 9, 3]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\x05{% endfor %}"  # bytes below 32 only: in the vocabulary
MESSAGES = [{"role": "user", "content": "\x03\x04"}]  # rendered: ids [3, 4, 5]
CASES = [(3, 3, 20, 1.0, False), (3, 3, 20, 0.0, False), (4, 2, 12, 2.0, True), (3, 3, 20, 0.0, "never")]  # width, n, ...


def _text(ids: list[int]) -> str:
    return bytes(ids).decode()


def _hf_beams(model, prompt, width, max_tokens, length_penalty, early_stopping, eos) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), num_beams=width,
            num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens, length_penalty=length_penalty,
            early_stopping=early_stopping, eos_token_id=eos, pad_token_id=-1,
        )  # fmt: skip
    return [[t for t in seq[len(prompt) :].tolist() if t != -1] for seq in out]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(app, {(prompt, width, max_tokens, length_penalty, early_stopping): the engine's beams}, transformers' model)."""
    from jaxpaged import LLM, BeamSearchParams
    from jaxpaged.engine.async_engine import AsyncLLMEngine
    from jaxpaged.entrypoints.openai import ServerSettings, build_app
    from tests.cycle_model import _tokenizer

    hf = random_hf_model(tiny_llama_config(vocab_size=32, eos_token_id=[1, 2], num_key_value_heads=2), seed=3)
    folder = save_hf_model(hf, tmp_path_factory.mktemp("beams"))
    _tokenizer().save_pretrained(str(folder))
    # the model's sampling defaults, which beam search must not take (the engine refuses a repetition penalty)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "repetition_penalty": 1.3}))
    llm = LLM(str(folder), dtype="float32", max_num_seqs=16, max_num_batched_tokens=64, block_size=8, num_kv_blocks=256,
              max_model_len=256, precompile=False, log_level="WARNING")  # fmt: skip
    refs = {}
    for prompt in (PROMPT, [3, 4, 5]):
        for width, _, max_tokens, lp, es in CASES:
            params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=lp, early_stopping=es)
            (out,) = llm.beam_search([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            refs[tuple(prompt), width, max_tokens, lp, es] = out.sequences
    engine = AsyncLLMEngine(llm.engine)
    engine.start()
    yield build_app(engine, ServerSettings([MODEL], chat_template=CHAT_TEMPLATE)), refs, hf, llm.engine.eos_token_ids
    engine.shutdown()


def _post(app, path: str, body: dict) -> httpx.Response:
    async def work(http):
        return await http.post(path, json={"model": MODEL, **body})

    return run(app, work, base_url="http://t")


def _events(app, path: str, body: dict) -> list[dict]:
    r = _post(app, path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    lines = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("width,n,max_tokens,lp,es", CASES)
def test_completions_return_the_engines_best_beams(served, width, n, max_tokens, lp, es):
    app, refs, _, _ = served
    body = {"prompt": PROMPT, "use_beam_search": True, "n": n, "max_tokens": max_tokens, "length_penalty": lp,
            "early_stopping": es, **({"best_of": width} if width != n else {})}  # fmt: skip
    r = _post(app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    want = refs[tuple(PROMPT), width, max_tokens, lp, es][:n]
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(n))
    assert [c["text"] for c in choices] == [_text(s.output_token_ids) for s in want]
    assert [c["finish_reason"] for c in choices] == [s.finish_reason for s in want]
    assert r.json()["usage"]["completion_tokens"] == sum(len(s.output_token_ids) for s in want)
    events = _events(app, "/v1/completions", body)  # streamed: each choice once, whole, at the end
    assert sorted((e["choices"][0]["index"], e["choices"][0]["text"]) for e in events) == [
        (c["index"], c["text"]) for c in choices
    ]
    assert all(e["choices"][0]["finish_reason"] is not None for e in events)


def test_length_penalty_changes_the_answer_and_matches_transformers(served):
    app, refs, hf, eos = served
    texts = {}
    for lp in (1.0, 0.0):
        body = {"prompt": PROMPT, "use_beam_search": True, "n": 3, "max_tokens": 20, "length_penalty": lp}
        texts[lp] = [c["text"] for c in _post(app, "/v1/completions", body).json()["choices"]]
        assert texts[lp] == [_text(t) for t in _hf_beams(hf, PROMPT, 3, 20, lp, False, eos)]
    assert texts[1.0] != texts[0.0]  # the test model ends beams on EOS early enough for the penalty to matter


def test_chat_returns_the_beams_streamed_at_the_end(served):
    app, refs, _, _ = served
    body = {"messages": MESSAGES, "use_beam_search": True, "n": 3, "max_tokens": 20, "length_penalty": 0.0}
    r = _post(app, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    want = [_text(s.output_token_ids) for s in refs[(3, 4, 5), 3, 20, 0.0, False]]
    assert [c["message"]["content"] for c in r.json()["choices"]] == want
    assert r.json()["usage"]["prompt_tokens"] == 3
    events = _events(app, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    deltas = [e["choices"][0] for e in events if e["choices"]]
    assert [d["delta"] for d in deltas[:3]] == [{"role": "assistant", "content": ""}] * 3  # the openers
    assert sorted((d["index"], d["delta"]["content"]) for d in deltas[3:]) == list(enumerate(want))  # then each whole
    assert events[-1]["usage"] == r.json()["usage"]


@pytest.mark.parametrize("path,fields,param", [
    ("/v1/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"temperature": 0.7}, "temperature"),
    ("/v1/chat/completions", {"stop": ["\x06"]}, "stop"),
    ("/v1/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"min_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"n": 6}, "n"),  # wider than the candidate budget allows (3 EOS ids: at most 5)
    ("/v1/chat/completions", {"n": 6}, "n"),
    ("/v1/completions", {"n": 2, "best_of": 6}, "best_of"),
    ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"early_stopping": "sometimes"}, "early_stopping"),
    ("/v1/completions", {"length_penalty": "long"}, "length_penalty"),
    ("/v1/completions", {"use_beam_search": False, "length_penalty": 0.5}, "length_penalty"),
    ("/v1/chat/completions", {"use_beam_search": False, "early_stopping": True}, "early_stopping"),
])  # fmt: skip
def test_what_cannot_combine_is_a_400_naming_the_field(served, path, fields, param):
    app = served[0]
    prompt = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    r = _post(app, path, {**prompt, "use_beam_search": True, "max_tokens": 4, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert _post(app, path, {**prompt, "use_beam_search": True, "max_tokens": 4}).status_code == 200  # still serving

"""output_kind (vLLM's RequestOutputKind): FINAL_ONLY requests yield one output, when they end, and it equals the
last cumulative output; LLM.generate asks for it, so its step loop builds no outputs and decodes no text until a
request ends (the text of a request without stop strings is decoded once, then)."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, RequestOutputKind, SamplingParams
from jaxpaged.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(cycle_model_dir):
    return LLM(str(cycle_model_dir), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, block_size=8,
               log_level="WARNING")  # fmt: skip


def _summary(out):
    return [(c.text, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob,
             [sorted((t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()) for e in c.logprobs or []])
            for c in out.outputs]  # fmt: skip


def _run(engine, requests, kind):
    """Every output each step returns, per request id."""
    seen = {}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, SamplingParams(**params, output_kind=kind))
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


REQUESTS = [
    ("plain", "ab", dict(temperature=1.0, seed=1, max_tokens=30)),
    ("n3", "é日", dict(n=3, temperature=1.0, seed=2, max_tokens=25)),
    ("stop", "ab", dict(temperature=1.0, seed=3, max_tokens=40, stop=["🚀"])),  # decoded token by token
    ("logprobs", "ж", dict(temperature=1.0, seed=4, max_tokens=20, logprobs=2, prompt_logprobs=1)),
    ("greedy", "ab", dict(temperature=0.0, max_tokens=33)),
]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_final_only_is_the_last_cumulative_output(llm, async_scheduling):
    engine = llm.engine
    engine.config.async_scheduling = async_scheduling
    cumulative = _run(engine, REQUESTS, RequestOutputKind.CUMULATIVE)
    final = _run(engine, [(f"{rid}-final", p, kw) for rid, p, kw in REQUESTS], RequestOutputKind.FINAL_ONLY)
    for rid, _, _ in REQUESTS:
        many, (one,) = cumulative[rid], final[f"{rid}-final"]
        assert len(many) > 1 and one.finished and not any(o.finished for o in many[:-1])
        assert _summary(one) == _summary(many[-1])
        assert one.prompt_logprobs == many[-1].prompt_logprobs
    assert "é日🚀ж ab" in final["greedy-final"][0].outputs[0].text  # the cycle's multi-byte characters came through whole
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_generate_returns_what_cumulative_steps_end_with(llm):
    engine = llm.engine
    cumulative = _run(engine, REQUESTS, RequestOutputKind.CUMULATIVE)
    outs = llm.generate([p for _, p, _ in REQUESTS], [SamplingParams(**kw) for _, _, kw in REQUESTS], use_tqdm=False)
    for (rid, _, _), out in zip(REQUESTS, outs, strict=True):
        assert _summary(out) == _summary(cumulative[rid][-1])


def test_an_aborted_final_only_request_returns_its_text_so_far(llm):
    engine = llm.engine
    engine.add_request("cut", "ab", SamplingParams(temperature=0.0, max_tokens=40, output_kind=RequestOutputKind.FINAL_ONLY))
    for _ in range(6):
        assert engine.step() == []  # nothing before it ends
    out = engine.abort_request_with_output("cut")
    (completion,) = out.outputs
    assert out.finished and completion.finish_reason == "abort" and len(completion.token_ids) >= 4
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids)
    while engine.has_unfinished_requests():
        engine.step()


def test_output_kind_is_checked():
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=1)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final")


def test_push_many_gives_the_text_of_pushing_one_by_one(llm):
    tokenizer = llm.get_tokenizer()
    ids = list("é日🚀ж ab".encode()) * 3
    one_by_one = IncrementalDetokenizer(tokenizer, prompt_token_ids=[97, 98])
    for t in ids:
        one_by_one.push(t)
    one_by_one.flush()
    at_once = IncrementalDetokenizer(tokenizer, prompt_token_ids=[97, 98])
    at_once.push_many(ids[:4])
    at_once.push_many(ids[4:])
    at_once.flush()
    assert at_once.output_text == one_by_one.output_text == "é日🚀ж ab" * 3
    with pytest.raises(ValueError, match="stop string"):
        IncrementalDetokenizer(tokenizer, stop=["ab"]).push_many(ids)

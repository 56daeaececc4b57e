"""Async scheduling: step N+1 is scheduled, packed and dispatched before step N's tokens are read, and the outputs
are those of synchronous steps: the same tokens, stops and finish reasons, logprobs equal to the rounding that
batch composition always causes in the default mode, and bit for bit with batch_invariant=True."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.hf_reference import random_hf_model, random_prompts, save_hf_model, tiny_llama_config

VOCAB = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    hf = random_hf_model(tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))
    return str(save_hf_model(hf, tmp_path_factory.mktemp("tiny-llama-async")))


def _llm(model_dir, async_scheduling: bool, **kw) -> LLM:
    kw = {"dtype": "float32", "max_num_seqs": 16, "max_num_batched_tokens": 64, "block_size": 8, "log_level": "WARNING",
          **kw}  # fmt: skip
    return LLM(model_dir, async_scheduling=async_scheduling, **kw)


def _workload(seed: int):
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(VOCAB, rng.integers(1, 90, size=40).tolist(), seed=seed)]
    prompts += [{"prompt_token_ids": prompts[0]["prompt_token_ids"] * 3 + [7]}] * 2  # prefix-cache hits
    params = []
    for i in range(len(prompts)):
        params.append(SamplingParams(
            n=int(rng.choice([1, 1, 3])), temperature=float(rng.choice([0.0, 0.8])), seed=int(rng.integers(1000)),
            max_tokens=int(rng.integers(1, 40)), min_tokens=int(rng.integers(0, 3)),
            stop_token_ids=[int(t) for t in rng.integers(2, VOCAB, size=3)] if i % 2 else None,  # ends at random steps
            logprobs=2 if i % 5 == 0 else None, prompt_logprobs=1 if i % 7 == 0 else None,
            repetition_penalty=1.3 if i % 11 == 0 else 1.0,  # such sequences make the next step wait for this one
        ))  # fmt: skip
    return prompts, params


def _summary(outs):
    return [(o.prompt_logprobs, [(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]) for o in outs]


def _assert_same(got, want, exact: bool) -> None:
    """Exactly equal, or: tokens and stops equal, logprob entries for the same ids within 1e-5."""
    if exact:
        assert got == want
        return

    def numbers(entries):
        return [sorted((t, lp.logprob, lp.rank) for t, lp in e.items()) if e else e for e in entries or []]

    for (g_prompt, g_outs), (w_prompt, w_outs) in zip(got, want, strict=True):
        for g, w in zip(numbers(g_prompt) + [x for o in g_outs for x in numbers(o[3])],
                        numbers(w_prompt) + [x for o in w_outs for x in numbers(o[3])], strict=True):  # fmt: skip
            assert [(t, r) for t, _, r in g or []] == [(t, r) for t, _, r in w or []]
            np.testing.assert_allclose([lp for _, lp, _ in g or []], [lp for _, lp, _ in w or []], atol=1e-5, rtol=0)
        assert [o[:3] for o in g_outs] == [o[:3] for o in w_outs]


def _assert_clean(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_compiles_after_warmup"] == 0


@pytest.mark.parametrize(("num_kv_blocks", "batch_invariant"), [(None, False), (40, False), (None, True)])
def test_outputs_equal_synchronous_steps(model_dir, num_kv_blocks, batch_invariant):
    """40 blocks: preemption on top of prefix caching and forks."""
    prompts, params = _workload(seed=3)
    runs = {}
    for mode in (False, True):
        llm = _llm(model_dir, mode, num_kv_blocks=num_kv_blocks, batch_invariant=batch_invariant)
        runs[mode] = _summary(llm.generate(prompts, params, use_tqdm=False))
        stats = llm.get_stats()
        assert (stats["num_overlapped_steps"] > 0) == mode
        assert (stats["num_preemptions"] > 0) == (num_kv_blocks is not None)
        assert stats["prefix_cache_hits"] > 0
        _assert_clean(llm)
    _assert_same(runs[True], runs[False], exact=batch_invariant)
    finish = {c[1] for _, cs in runs[True] for c in cs}
    assert finish == {"stop", "length"}  # stop tokens ended some sequences while the next step was in flight


def test_stop_strings_and_text_equal_synchronous_steps(cycle_model_dir):
    """The cycle model has a tokenizer; at temperature 0.5 it mostly walks its cycle, which holds the stop strings."""
    prompts = ["ab", "é", "x y", "ж"] * 4
    params = [SamplingParams(temperature=0.5, seed=i, max_tokens=2 + 2 * i, stop=["ж", "b é"]) for i in range(len(prompts))]
    texts = {}
    for mode in (False, True):
        llm = LLM(str(cycle_model_dir), async_scheduling=mode, dtype="float32", max_num_seqs=8, max_num_batched_tokens=32,
                  block_size=8, max_model_len=128, log_level="WARNING")  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        texts[mode] = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].stop_reason) for o in outs]
        _assert_clean(llm)
    assert texts[True] == texts[False]
    assert sum(t[2] is not None for t in texts[True]) >= 4 and any(t[2] is None for t in texts[True])


def test_abort_while_a_step_is_in_flight(model_dir):
    prompts = random_prompts(VOCAB, [30, 12, 50, 5], seed=9)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(model_dir, False).generate(
        [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]  # fmt: skip
    llm = _llm(model_dir, True)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, greedy)
    done = {}
    for _ in range(6):
        for out in engine.step():
            done[out.request_id] = out
    assert any(req.seq_id.startswith("1#") for req in engine._in_flight.sampled_rows)  # "1" samples in the step in flight
    assert engine.abort_request("1")
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    for i in (0, 2, 3):
        assert done[str(i)].outputs[0].token_ids == want[i]
    _assert_clean(llm)


def test_constrained_and_penalised_steps_overlap_and_equal_synchronous_steps(cycle_model_dir):
    """A grammar's mask and a penalty's history need the previous token on the host: the next step's forward is
    dispatched before it is read, its sampler after, and the outputs are those of synchronous steps."""
    from jaxpaged import StructuredOutputsParams
    from tests.structured_cases import REGEX, SCHEMA

    constraints = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": ["yes", "no", "maybe é"]}, None]
    prompts, params = [], []
    for i in range(12):
        constraint = constraints[i % 4]
        prompts.append(f"request {i}")
        params.append(SamplingParams(
            temperature=0.0 if i % 3 == 0 else 1.0, seed=i, max_tokens=60 if constraint else 5 + i, n=2 if i % 5 == 0 else 1,
            repetition_penalty=1.2 if i % 4 == 3 else 1.0, logprobs=1 if i % 2 else None,
            structured_outputs=StructuredOutputsParams(**constraint) if constraint else None,
        ))  # fmt: skip
    runs = {}
    for mode in (False, True):
        llm = LLM(str(cycle_model_dir), async_scheduling=mode, dtype="float32", max_num_seqs=8, max_num_batched_tokens=32,
                  block_size=8, max_model_len=256, log_level="WARNING")  # fmt: skip
        runs[mode] = _summary(llm.generate(prompts, params, use_tqdm=False))
        assert (llm.get_stats()["num_overlapped_steps"] > 0) == mode
        _assert_clean(llm)
    _assert_same(runs[True], runs[False], exact=False)

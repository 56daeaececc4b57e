"""Speculative decoding (ngram): proposals, the rejection rule's distribution, and the engine's output unchanged."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.spec_decode.config import SpeculativeConfig
from jaxpaged.spec_decode.proposer import NgramProposer
from jaxpaged.worker.sampler import SamplingRow, build_sampling_metadata, sample
from tests.hf_reference import random_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}  # fmt: skip
ENGINE = dict(dtype="float32", max_num_seqs=16, max_num_batched_tokens=64, block_size=8, log_level="WARNING")


def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(1, 3)
    seqs = [[1, 2, 3, 4, 1, 2], [5, 6, 7], [9, 8, 9, 8, 7, 9, 8], [3, 1, 2, 5, 1, 2, 6, 0, 1, 2]]
    assert proposer.propose(seqs, [3, 2, 4, 2]) == [[3, 4, 1], [], [7, 9, 8], [6, 0]]
    assert NgramProposer(2, 3).propose([[4, 1, 7, 1]], [2]) == [[]]  # a 1-gram match is below prompt_lookup_min


@pytest.mark.parametrize("bad, name", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ("{not json", "speculative_config"),
])  # fmt: skip
def test_bad_config_is_a_value_error_naming_the_field(bad, name):
    with pytest.raises(ValueError, match=name):
        SpeculativeConfig.parse(bad)


def test_point_mass_rejection_rule_gives_the_target_distribution():
    """Many rows of one distribution, each verifying the same proposal with its own seed: the tokens must follow
    the target (temperature and top-k applied), whether the proposal is likely, unlikely or outside top-k."""
    vocab, n = 6, 20000
    logits = np.log(np.array([0.05, 0.4, 0.2, 0.15, 0.12, 0.08], np.float32)) * 0.7  # temperature 0.7 undoes it
    params = SamplingParams(temperature=0.7, top_k=5, seed=0)
    kept = np.exp(logits / 0.7)
    kept[0] = 0.0  # the least likely token is outside top-5
    target = kept / kept.sum()
    for draft in (1, 4, 0):
        rows = [SamplingRow(params, [1], [], seed, draft=draft) for seed in range(n)]
        meta = build_sampling_metadata(rows, n, 4)
        tokens = np.asarray(jax.jit(sample)(np.tile(logits, (n, 1)), meta).tokens)
        freq = np.bincount(tokens, minlength=vocab) / n
        assert 0.5 * np.abs(freq - target).sum() < 0.015, (draft, freq, target)


@pytest.fixture(scope="module")
def engines(model_dir):
    return LLM(model_dir, **ENGINE), LLM(model_dir, speculative_config=NGRAM, **ENGINE)


def _workload(count: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = [p * 3 for p in random_prompts(256, rng.integers(2, 12, size=count).tolist(), seed=seed)]  # repeats
    params = []
    for i, m in enumerate(rng.integers(6, 30, size=count).tolist()):
        kw = dict(temperature=0.0, max_tokens=int(m), ignore_eos=True)
        if i % 5 == 1:
            kw["logprobs"] = 2
        if i % 5 == 3:
            kw["n"] = 2
        params.append(SamplingParams(**kw))
    return prompts, params


def _tokens(llm: LLM, prompts, params) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def _assert_clean(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_compiles_after_warmup"] == 0


def test_greedy_identical_in_a_mixed_batch_and_again_from_the_prefix_cache(engines):
    base, spec = engines
    prompts, params = _workload(10, seed=1)
    expected = _tokens(base, prompts, params)
    assert _tokens(spec, prompts, params) == expected
    stats = spec.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats  # some rejected
    assert _tokens(spec, prompts, params) == expected  # blocks registered by verifying steps are found again
    assert spec.get_stats()["prefix_cache_hits"] > 0
    _assert_clean(spec)


def test_greedy_identical_one_at_a_time_with_logprobs_unchanged(engines):
    """Batch 1: every step verifies; a request with logprobs runs beside one without and gets the same numbers."""
    base, spec = engines
    prompts, _ = _workload(3, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for p in prompts:
        assert _tokens(spec, [p], [params]) == _tokens(base, [p], [params])
    lp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    a = base.generate([{"prompt_token_ids": prompts[0]}], [lp], use_tqdm=False)[0].outputs[0]
    b = spec.generate([{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": prompts[1]}], [lp, params], use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose([d[t].logprob for d, t in zip(b.logprobs, b.token_ids)],
                               [d[t].logprob for d, t in zip(a.logprobs, a.token_ids)], rtol=1e-5, atol=1e-5)  # fmt: skip
    _assert_clean(spec)


def test_greedy_identical_under_preemption_and_chunked_prefill(model_dir, engines):
    base, _ = engines
    prompts, params = _workload(10, seed=3)
    expected = _tokens(base, prompts, params)
    tight = LLM(model_dir, speculative_config=NGRAM, **{**ENGINE, "num_kv_blocks": 20, "max_num_batched_tokens": 16,
                                                          "max_num_seqs": 8})  # fmt: skip
    assert _tokens(tight, prompts, params) == expected
    stats = tight.get_stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, stats
    _assert_clean(tight)


def test_penalties_min_tokens_and_logprobs_speculate_with_output_unchanged(engines):
    """Each verifying row samples as if the proposals before it were output: its penalties count them, min_tokens
    still suppresses a stop id a proposal brings too early, and its logprobs are that position's."""
    base, spec = engines
    prompts, _ = _workload(3, seed=5)
    free = _tokens(base, prompts[:1], [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)])[0][0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0, presence_penalty=1.0),
    ] + [  # the stop id comes at output m + 1 (and maybe earlier): suppressed until m; some step verifies across m
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[free[m + 1]], min_tokens=m,
                       logprobs=0) for m in (6, 7, 8, 9)
    ]  # fmt: skip
    drafts = accepted = 0
    for p in params:
        stats = spec.get_stats()
        for prompt in prompts:
            a = base.generate([{"prompt_token_ids": prompt}], [p], use_tqdm=False)[0].outputs[0]
            b = spec.generate([{"prompt_token_ids": prompt}], [p], use_tqdm=False)[0].outputs[0]
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), p
            assert len(b.token_ids) >= p.min_tokens
            if p.logprobs is not None:
                assert [sorted(d) for d in a.logprobs] == [sorted(d) for d in b.logprobs]
                np.testing.assert_allclose([d[t].logprob for d in b.logprobs for t in sorted(d)],
                                           [d[t].logprob for d in a.logprobs for t in sorted(d)], rtol=1e-5, atol=1e-5)  # fmt: skip
        after = spec.get_stats()
        assert after["spec_decode_num_draft_tokens"] > stats["spec_decode_num_draft_tokens"], p  # it speculated
        drafts += after["spec_decode_num_draft_tokens"] - stats["spec_decode_num_draft_tokens"]
        accepted += after["spec_decode_num_accepted_tokens"] - stats["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafts
    _assert_clean(spec)


def test_each_verifying_row_samples_as_if_the_proposals_before_it_were_output(engines):
    """The definition behind the test above, checked on every verifying step's sampling rows: row j of a sequence
    verifying k proposals samples output index n + j, its penalties' history holds the proposals before it, and
    min_tokens suppresses its stop ids exactly while n + j < min_tokens."""
    _, spec = engines
    builder = spec.engine.runner.input_batch
    build, checked = builder.build, []

    def checking_build(output, with_sampling=True):
        step = build(output, with_sampling)
        for item in output.scheduled if with_sampling else ():
            drafts, req = list(item.draft_token_ids), item.request
            if not drafts:
                continue
            prompt, p = list(req.prompt_token_ids), req.params
            known = list(req.output_token_ids[: item.num_output_tokens])
            for j, draft in enumerate([*drafts, -1]):
                row, outputs = item.row + j, known + drafts[:j]
                assert step.sampling.step_index[row] == len(outputs)
                assert step.sampling.draft_ids[row] == draft
                history = step.sampling.history[row].tolist()
                assert history[: len(prompt) + len(outputs) + 1] == prompt + outputs + [-1]
                suppressed = set(step.sampling.suppress_ids[row].tolist()) - {-1}
                assert suppressed == (set(p.stop_token_ids) if len(outputs) < p.min_tokens else set()), (j, outputs)
            checked.append(len(drafts))
        return step

    prompts, _ = _workload(4, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.05,
                             stop_token_ids=[0], min_tokens=m) for m in (9, 10, 11, 12)]  # fmt: skip
    builder.build = checking_build
    try:
        spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        builder.build = build
    assert len(checked) > 5 and max(checked) > 1
    _assert_clean(spec)


def test_stops_and_max_tokens_as_without_speculation(engines):
    base, spec = engines
    prompts, _ = _workload(4, seed=4)
    free = _tokens(base, prompts[:1], [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)])[0][0]
    stop_id = free[9]  # a token it produces: generation must end at its first occurrence
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, min_tokens=5)]  # fmt: skip
    for p in params:
        a = base.generate([{"prompt_token_ids": prompts[0]}], [p], use_tqdm=False)[0].outputs[0]
        b = spec.generate([{"prompt_token_ids": prompts[0]}], [p], use_tqdm=False)[0].outputs[0]
        assert (a.token_ids, a.finish_reason, a.stop_reason) == (b.token_ids, b.finish_reason, b.stop_reason)
    _assert_clean(spec)


def test_metrics_export_the_spec_decode_stats(engines):
    """The server's /metrics and LLM.get_metrics() read one list (engine/metrics.py): it holds the drafts' stats."""
    names = {m.name for m in engines[1].get_metrics()}
    assert {"jaxpaged:spec_decode_acceptance_rate", "jaxpaged:spec_decode_mean_accepted_length",
            "jaxpaged:spec_decode_num_accepted_tokens", "jaxpaged:spec_decode_num_draft_tokens"} <= names  # fmt: skip
    assert "jaxpaged:spec_decode_num_draft_tokens" not in {m.name for m in engines[0].get_metrics()}

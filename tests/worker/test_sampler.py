"""The in-jit sampler against numpy / transformers references: greedy, temperature, top-k/p, min-p,
penalties, suppression, per-row seeds, logprobs, all-masked rows, the host builder, one compile."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.sampler import (
    SamplerOutput,
    SamplingMetadata,
    SamplingRow,
    apply_penalties,
    apply_top_k_top_p_min_p,
    build_sampling_metadata,
    first_argmax,
    sample,
)

SAMPLE = jax.jit(sample)
# Chi-square critical values at p = 1e-4 (the draws are seeded, so a pass is deterministic anyway).
CHI2_CRITICAL = {3: 21.11, 4: 23.51, 5: 25.74, 7: 29.88}


def make_md(num_rows: int, history_width: int = 8, num_suppress: int = 4, **fields) -> SamplingMetadata:
    """Neutral, greedy metadata with `fields` overriding (scalars broadcast over rows)."""
    s = num_rows
    base = dict(
        temperature=np.zeros(s, np.float32),
        top_k=np.zeros(s, np.int32),
        top_p=np.ones(s, np.float32),
        min_p=np.zeros(s, np.float32),
        presence_penalty=np.zeros(s, np.float32),
        frequency_penalty=np.zeros(s, np.float32),
        repetition_penalty=np.ones(s, np.float32),
        seeds=np.arange(s, dtype=np.uint32),
        step_index=np.zeros(s, np.int32),
        history=np.full((s, history_width), -1, np.int32),
        prompt_lens=np.zeros(s, np.int32),
        suppress_ids=np.full((s, num_suppress), -1, np.int32),
        any_penalty=np.array(False),
        any_top=np.array(False),
        want_logprobs=np.array(False),
        bitmask=np.full((s, 8), -1, np.int32),  # a vocabulary of up to 256
        any_constrained=np.array(False),
        logit_bias=np.full((s, 2, 4), -1, np.int32),
        mask_logprobs=np.ones(s, bool),
    )
    for name, value in fields.items():
        old = base[name]
        base[name] = np.broadcast_to(np.asarray(value, old.dtype), old.shape).copy()
    return SamplingMetadata(**base)


def run(logits, attn_metadata: SamplingMetadata) -> SamplerOutput:
    out = SAMPLE(jnp.asarray(logits, jnp.float32), attn_metadata)
    return jax.tree.map(np.asarray, out)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def reference_allowed(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens vLLM / HF may sample: top-k, then the smallest nucleus reaching top_p, then min-p."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x)
    k = len(x) if top_k <= 0 or top_k > len(x) else top_k
    kept = order[:k]
    p = softmax(x[kept])
    if top_p < 1:
        m = int(np.searchsorted(np.cumsum(p), top_p) + 1)  # smallest m with cumsum[m-1] >= top_p
        kept, p = kept[:m], p[:m]
    kept = kept[p >= min_p * p.max()]
    return {int(t) for t in kept}


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_equals_argmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(16, 300)).astype(np.float32) * 3
    temperature = np.where(np.arange(16) % 2 == 0, 0.0, 1.0)
    temperature[1] = 1e-6  # below _GREEDY_EPS: greedy too
    out = run(logits, make_md(16, temperature=temperature, top_k=7, top_p=0.3, any_top=True))
    greedy = temperature < 1e-5
    np.testing.assert_array_equal(out.tokens[greedy], logits[greedy].argmax(-1))
    assert out.tokens.dtype == np.int32


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.5], np.float32)
    rows = 6000
    attn_metadata = make_md(
        rows,
        temperature=temperature,
        seeds=np.arange(rows) * 7919 + 12345,
        step_index=np.arange(rows) % 13,
    )
    out = run(np.broadcast_to(logits, (rows, 6)), attn_metadata)
    counts = np.bincount(out.tokens, minlength=6)
    probs = softmax(logits.astype(np.float64) / temperature)
    assert chi_square(counts, probs) < CHI2_CRITICAL[5]


def test_top_k_only_returns_the_k_most_likely():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=64).astype(np.float32)
    rows = 3000
    out = run(np.broadcast_to(logits, (rows, 64)), make_md(rows, temperature=2.0, top_k=5, any_top=True))
    top5 = set(np.argsort(-logits)[:5].tolist())
    assert set(out.tokens.tolist()) == top5  # never outside, and every one of them reachable
    counts = np.array([np.sum(out.tokens == t) for t in sorted(top5)])
    probs = softmax(logits[sorted(top5)].astype(np.float64) / 2.0)
    assert chi_square(counts, probs) < CHI2_CRITICAL[4]


def test_top_k_larger_than_vocab_is_no_limit():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, 10)).astype(np.float32)
    masked = np.asarray(
        apply_top_k_top_p_min_p(jnp.asarray(logits), jnp.array([10, 11, 10**6]), jnp.ones(3), jnp.zeros(3))
    )
    np.testing.assert_array_equal(masked, logits)


def test_truncation_mask_matches_reference():
    rng = np.random.default_rng(3)
    rows, vocab = 400, 40
    logits = (rng.normal(size=(rows, vocab)) * rng.uniform(0.3, 4, size=(rows, 1))).astype(np.float32)
    top_k = rng.choice([0, 1, 3, 10, 39, 40, 100], size=rows)
    top_p = rng.choice([1.0, 0.95, 0.8, 0.5, 0.1, 1e-4], size=rows)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.2, 0.9, 1.0], size=rows)
    masked = np.asarray(
        jax.jit(apply_top_k_top_p_min_p)(
            jnp.asarray(logits), jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32),
            jnp.asarray(min_p, jnp.float32),
        )
    )
    for i in range(rows):
        allowed = reference_allowed(logits[i], 1.0, top_k[i], top_p[i], min_p[i])
        assert set(np.flatnonzero(np.isfinite(masked[i])).tolist()) == allowed, (top_k[i], top_p[i], min_p[i])
        kept = np.isfinite(masked[i])
        np.testing.assert_array_equal(masked[i][kept], logits[i][kept])


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 0, 0.6, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 6, 0.8, 0.0), (1.0, 0, 1.0, 0.1), (2.0, 8, 0.95, 0.05)],
)
def test_sampling_stays_in_the_reference_set(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(4)
    logits = rng.normal(size=32).astype(np.float32) * 1.5
    rows = 3000
    attn_metadata = make_md(rows, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, any_top=True)
    out = run(np.broadcast_to(logits, (rows, 32)), attn_metadata)
    allowed = reference_allowed(logits, temperature, top_k, top_p, min_p)
    sampled = set(out.tokens.tolist())
    assert sampled <= allowed
    if len(allowed) <= 8:  # then each allowed token has enough mass to show up
        assert sampled == allowed
        order = sorted(allowed)
        probs = softmax(logits[order].astype(np.float64) / temperature)
        counts = np.array([np.sum(out.tokens == t) for t in order])
        dof = len(order) - 1
        if dof in CHI2_CRITICAL:
            assert chi_square(counts, probs) < CHI2_CRITICAL[dof]


def _history(rng, rows, width, vocab):
    history = np.full((rows, width), -1, np.int32)
    prompt_lens = rng.integers(0, width // 2, size=rows)
    for i in range(rows):
        n = rng.integers(prompt_lens[i], width + 1)
        history[i, :n] = rng.integers(0, vocab, size=n)
    return history, prompt_lens.astype(np.int32)


def test_repetition_penalty_matches_transformers():
    rng = np.random.default_rng(5)
    rows, width, vocab = 12, 24, 30
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 2
    history, prompt_lens = _history(rng, rows, width, vocab)
    penalty = rng.choice([1.0, 1.3, 0.7, 2.5], size=rows).astype(np.float32)
    attn_metadata = make_md(rows, width, history=history, prompt_lens=prompt_lens, repetition_penalty=penalty)
    ours = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), attn_metadata))
    for i in range(rows):
        ids = history[i][history[i] >= 0]
        scores = torch.tensor(logits[i : i + 1])
        if len(ids):
            scores = RepetitionPenaltyLogitsProcessor(float(penalty[i]))(torch.tensor(ids[None]), scores)
        np.testing.assert_allclose(ours[i], scores[0].numpy(), rtol=1e-6)


def test_presence_frequency_penalties_match_reference():
    rng = np.random.default_rng(6)
    rows, width, vocab = 12, 24, 10  # small vocab: repeats are common
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    history, prompt_lens = _history(rng, rows, width, vocab)
    presence = rng.uniform(-2, 2, size=rows).astype(np.float32)
    frequency = rng.uniform(-2, 2, size=rows).astype(np.float32)
    repetition = rng.choice([1.0, 1.2], size=rows).astype(np.float32)
    attn_metadata = make_md(
        rows, width, history=history, prompt_lens=prompt_lens, presence_penalty=presence,
        frequency_penalty=frequency, repetition_penalty=repetition,
    )
    ours = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), attn_metadata))
    for i in range(rows):
        row = history[i][history[i] >= 0]
        x = logits[i].astype(np.float64)
        seen = np.bincount(row, minlength=vocab) > 0
        x = np.where(seen, np.where(x > 0, x / repetition[i], x * repetition[i]), x)
        out_counts = np.bincount(row[prompt_lens[i] :], minlength=vocab)  # prompt tokens are not counted
        x = x - frequency[i] * out_counts - presence[i] * (out_counts > 0)
        np.testing.assert_allclose(ours[i], x, rtol=1e-5, atol=1e-5)


def test_penalties_change_the_sample_only_when_flagged():
    logits = np.array([[3.0, 2.9, 0.0, -1.0]], np.float32)
    history = np.array([[0, 0, -1, -1]], np.int32)
    fields = dict(history=history, prompt_lens=[1], presence_penalty=0.5)
    assert run(logits, make_md(1, 4, **fields, any_penalty=True)).tokens[0] == 1
    assert run(logits, make_md(1, 4, **fields)).tokens[0] == 0  # flag off: the work is skipped
    # Prompt-only occurrences get no presence penalty.
    fields["prompt_lens"] = [2]
    assert run(logits, make_md(1, 4, **fields, any_penalty=True)).tokens[0] == 0


def test_suppressed_ids_are_never_sampled():
    rng = np.random.default_rng(7)
    vocab = 12
    logits = rng.normal(size=vocab).astype(np.float32)
    best = np.argsort(-logits)
    rows = 2000
    suppress = np.full((rows, 4), -1, np.int32)
    suppress[:, :2] = best[:2]
    temperature = np.where(np.arange(rows) < 10, 0.0, 1.5)
    attn_metadata = make_md(rows, suppress_ids=suppress, temperature=temperature, top_k=3, any_top=True, want_logprobs=True)
    out = run(np.broadcast_to(logits, (rows, vocab)), attn_metadata)
    assert np.all(out.tokens[:10] == best[2])  # greedy skips them too
    assert set(out.tokens[10:].tolist()) == set(best[2:5].tolist())
    # The raw distribution is still what is reported.
    np.testing.assert_allclose(out.logprobs, log_softmax(logits)[out.tokens], rtol=1e-5)


def test_seeded_row_ignores_the_rest_of_the_batch():
    rng = np.random.default_rng(8)
    vocab = 500
    row_logits = rng.normal(size=vocab).astype(np.float32) * 0.1  # flat: the noise decides
    params = dict(temperature=1.0, top_k=0, top_p=0.9, seeds=2**32 - 5, step_index=3)

    tokens = set()
    for num_rows, position, other_seed in [(4, 0, 1), (4, 3, 99), (16, 7, 2**31), (16, 0, 7)]:
        logits = rng.normal(size=(num_rows, vocab)).astype(np.float32) * 5
        logits[position] = row_logits
        fields = dict(
            temperature=rng.choice([0.0, 0.5, 1.0], size=num_rows),
            top_k=rng.integers(0, 5, size=num_rows),
            top_p=rng.uniform(0.5, 1.0, size=num_rows),
            seeds=np.full(num_rows, other_seed),
            step_index=rng.integers(0, 50, size=num_rows),
        )
        for name, value in params.items():
            fields[name][position] = value
        tokens.add(int(run(logits, make_md(num_rows, **fields, any_top=True)).tokens[position]))
    assert len(tokens) == 1


def test_different_seeds_give_different_streams():
    vocab = 1000
    logits = np.zeros((1, vocab), np.float32)

    def stream(seed):
        return [int(run(logits, make_md(1, temperature=1.0, seeds=seed, step_index=s)).tokens[0]) for s in range(8)]

    a, b = stream(0), stream(1)
    assert a == stream(0)  # reproducible
    assert a != b
    assert len(set(a)) > 1  # the step index moves the stream on


def test_logprobs_are_the_raw_distribution():
    rng = np.random.default_rng(9)
    rows, vocab = 6, 200
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 3
    history = np.tile(np.arange(8, dtype=np.int32), (rows, 1))
    attn_metadata = make_md(
        rows, 8, temperature=[0.0, 0.5, 1.0, 1.5, 0.0, 2.0], top_k=4, history=history, prompt_lens=4,
        repetition_penalty=1.5, frequency_penalty=1.0, any_penalty=True, any_top=True, want_logprobs=True,
    )
    out = run(logits, attn_metadata)
    ref = log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(rows), out.tokens], rtol=1e-5, atol=1e-5)
    assert out.top_ids.shape == (rows, 20) and out.top_ids.dtype == np.int32
    for i in range(rows):
        np.testing.assert_array_equal(np.sort(out.top_ids[i]), np.sort(np.argsort(-logits[i])[:20]))
        np.testing.assert_allclose(out.top_logprobs[i], ref[i, out.top_ids[i]], rtol=1e-5, atol=1e-5)
        assert np.all(np.diff(out.top_logprobs[i]) <= 0)

    off = run(logits, dataclasses.replace(attn_metadata, want_logprobs=np.array(False)))
    assert not off.top_ids.any() and not off.top_logprobs.any() and not off.logprobs.any()  # nothing computed
    np.testing.assert_array_equal(off.tokens, out.tokens)


def test_vocab_smaller_than_twenty_pads_top_logprobs():
    logits = np.array([[0.0, 1.0, 2.0]], np.float32)
    out = run(logits, make_md(1, want_logprobs=True))
    np.testing.assert_array_equal(out.top_ids[0, :3], [2, 1, 0])
    assert np.all(np.isneginf(out.top_logprobs[0, 3:]))


def test_all_masked_rows_return_a_valid_id_without_nan():
    vocab = 16
    logits = np.random.default_rng(10).normal(size=(4, vocab)).astype(np.float32)
    logits[0] = -np.inf
    logits[1] = -np.inf
    suppress = np.full((4, vocab), -1, np.int32)
    suppress[2] = np.arange(vocab)  # every id suppressed
    attn_metadata = make_md(
        4, history_width=4, num_suppress=vocab, temperature=[0.0, 1.0, 1.0, 0.0], top_k=3, top_p=0.5, min_p=0.1,
        suppress_ids=suppress,
        history=np.zeros((4, 4)), prompt_lens=2, repetition_penalty=1.3, presence_penalty=1.0,
        frequency_penalty=-1.0, any_penalty=True, any_top=True, want_logprobs=True,
    )
    out = run(logits, attn_metadata)
    assert np.all((out.tokens >= 0) & (out.tokens < vocab))
    for field in dataclasses.fields(out):
        assert not np.isnan(getattr(out, field.name)).any(), field.name
    assert np.isneginf(out.logprobs[:2]).all() and np.isfinite(out.logprobs[2:]).all()


def test_build_sampling_metadata_pads_and_flags():
    rows = [
        SamplingRow(SamplingParams(temperature=0.8, top_p=0.9, seed=3), [5, 6, 7], [8], seed=3, eos_token_ids=[2]),
        SamplingRow(SamplingParams(temperature=0.0, top_k=5), [1], [], seed=2**40 + 9, eos_token_ids=[2]),
    ]
    attn_metadata = build_sampling_metadata(rows, num_rows=4, history_width=6)
    assert isinstance(attn_metadata.temperature, np.ndarray)
    np.testing.assert_allclose(attn_metadata.temperature, [0.8, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(attn_metadata.top_k, [0, 0, 0, 0])  # greedy: vLLM drops truncation
    np.testing.assert_allclose(attn_metadata.top_p, [0.9, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(attn_metadata.step_index, [1, 0, 0, 0])
    np.testing.assert_array_equal(attn_metadata.prompt_lens, [3, 1, 0, 0])
    assert attn_metadata.seeds.dtype == np.uint32 and attn_metadata.seeds[0] == 3 and attn_metadata.seeds[1] != attn_metadata.seeds[2]
    assert attn_metadata.history.shape == (4, 6) and (attn_metadata.history == -1).all()  # no penalty: not filled
    assert (attn_metadata.suppress_ids == -1).all() and attn_metadata.suppress_ids.shape == (4, 64)
    assert bool(attn_metadata.any_top) and not bool(attn_metadata.any_penalty) and not bool(attn_metadata.want_logprobs)
    dtypes = {f.name: getattr(attn_metadata, f.name).dtype for f in dataclasses.fields(attn_metadata)}
    assert dtypes["temperature"] == np.float32 and dtypes["history"] == np.int32 and dtypes["any_top"] == bool

    pen = [SamplingRow(SamplingParams(frequency_penalty=0.5, logprobs=3), [5, 6], [7, 8, 9], seed=0)]
    attn_metadata = build_sampling_metadata(pen + rows[1:], num_rows=3, history_width=6)
    np.testing.assert_array_equal(attn_metadata.history, [[5, 6, 7, 8, 9, -1], [1, -1, -1, -1, -1, -1], [-1] * 6])
    assert bool(attn_metadata.any_penalty) and bool(attn_metadata.want_logprobs) and not bool(attn_metadata.any_top)
    np.testing.assert_allclose(attn_metadata.frequency_penalty, [0.5, 0, 0])
    np.testing.assert_allclose(attn_metadata.repetition_penalty, [1, 1, 1])

    only_greedy = [SamplingRow(SamplingParams(temperature=0), [1], [], seed=0)]
    attn_metadata = build_sampling_metadata(only_greedy, num_rows=2, history_width=1)
    assert not bool(attn_metadata.any_top) and not bool(attn_metadata.want_logprobs)
    chosen_only = [SamplingRow(SamplingParams(temperature=0, logprobs=0), [1], [], seed=0)]
    assert bool(build_sampling_metadata(chosen_only, num_rows=2, history_width=1).want_logprobs)


def test_build_sampling_metadata_min_tokens_suppression():
    def row(output, **kw):
        return SamplingRow(SamplingParams(min_tokens=3, **kw), [1, 2], output, seed=0, eos_token_ids=[0, 2])

    rows = [
        row([]),
        row([5, 6]),
        row([5, 6, 7]),  # min_tokens reached
        row([5], stop_token_ids=[9, 2]),
        row([5], ignore_eos=True, stop_token_ids=[9]),
        SamplingRow(SamplingParams(), [1], [], seed=0, eos_token_ids=[0]),  # min_tokens 0
    ]
    attn_metadata = build_sampling_metadata(rows, num_rows=8, history_width=8, max_suppress=4)
    expected = [[0, 2], [0, 2], [], [0, 2, 9], [9], [], [], []]
    for i, ids in enumerate(expected):
        assert attn_metadata.suppress_ids[i].tolist() == ids + [-1] * (4 - len(ids)), i

    # End to end: the suppressed ids are never drawn, even when they are the model's favourites.
    logits = np.zeros((8, 12), np.float32)
    logits[:, [0, 2, 9]] = 50.0
    tokens = run(logits, attn_metadata).tokens
    assert all(t not in ids for t, ids in zip(tokens, expected))
    assert tokens[2] in (0, 2, 9)


def test_build_sampling_metadata_errors():
    row = SamplingRow(SamplingParams(), [1, 2, 3], [4, 5], seed=0)
    with pytest.raises(ValueError, match="history_width"):
        build_sampling_metadata([row], num_rows=2, history_width=4)
    with pytest.raises(ValueError, match="num_rows"):
        build_sampling_metadata([row, row], num_rows=1, history_width=8)
    many = SamplingRow(SamplingParams(min_tokens=1, stop_token_ids=[3, 4, 5]), [1], [], seed=0, eos_token_ids=[2])
    with pytest.raises(ValueError, match="max_suppress"):
        build_sampling_metadata([many], num_rows=1, history_width=8, max_suppress=3)


def test_compiles_once_for_any_parameter_values():
    jitted = jax.jit(lambda x, attn_metadata: sample(x, attn_metadata))  # its own cache: SAMPLE shares `sample`'s
    logits = jnp.asarray(np.random.default_rng(11).normal(size=(4, 50)), jnp.float32)
    variants = [
        [SamplingParams(temperature=0)],
        [SamplingParams(temperature=0.7, top_k=5, seed=1), SamplingParams(top_p=0.5)],
        [SamplingParams(repetition_penalty=1.2, presence_penalty=0.5, min_tokens=2, logprobs=5)],
        [SamplingParams(min_p=0.3, frequency_penalty=-1, logprobs=20)] * 4,
        [],
    ]
    for i, params in enumerate(variants):
        rows = [SamplingRow(p, [1, 2], [3] * i, seed=i, eos_token_ids=[0]) for p in params]
        out = jitted(logits, build_sampling_metadata(rows, num_rows=4, history_width=16))
        assert out.tokens.shape == (4,)
    assert jitted._cache_size() == 1


def test_first_argmax_is_jnp_argmax_with_ties_nan_and_masked_rows():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 1000)).astype(np.float32)
    x[1, [5, 700]] = 10.0  # a tie: the first wins
    x[2, :] = -np.inf  # every token suppressed
    x[3, [40, 90]] = np.nan  # NaN counts as the maximum, the first one
    x[4, :] = 3.0  # all equal
    x[5, 999] = np.inf
    x[6] = np.round(x[6])  # many ties
    got = jax.jit(first_argmax)(jnp.asarray(x))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert list(np.asarray(got)[1:6]) == [5, 0, 40, 0, 999]

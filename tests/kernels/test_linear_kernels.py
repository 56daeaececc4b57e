"""The linear layers' kernels (gated delta rule, Mamba-2's SSD, the causal convolution) on ragged steps against the
naive per-token recurrences: decode rows, prefill chunks with and without context, chunks longer than the kernel's
chunk, padded rows and tokens; the state each row leaves; and one compile for every mix of rows in a bucket."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpaged.pallas_kernels.gated_delta import gated_delta_rule
from jaxpaged.pallas_kernels.linear_scan import chunk_list
from jaxpaged.pallas_kernels.recurrent_reference import naive_causal_conv, naive_gated_delta, naive_ssd
from jaxpaged.pallas_kernels.ssd import ssd_scan
from jaxpaged.pallas_kernels.state_cache import Rows, causal_conv
from jaxpaged.utils import compile_monitor

T, S = 96, 8
H = 3
# (q_lens, context before the step) per row: decode rows beside prefill chunks, a lone fresh token, a chunk spanning
# several kernel chunks, a fresh prompt of two tokens; the rest of the S rows are padding
STEPS = [
    ([1, 40, 1, 5, 33, 2], [3, 0, 0, 10, 4, 0]),
    ([1, 1, 1, 1], [7, 1, 2, 90]),
    ([70], [0]),
]


def _rows(q_lens, context):
    qsl = np.zeros(S + 1, np.int32)
    qsl[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    qsl[len(q_lens) + 1 :] = qsl[len(q_lens)]
    seq_lens = np.zeros(S, np.int32)
    seq_lens[: len(q_lens)] = np.add(q_lens, context)
    slots = np.full(S, 100, np.int32)
    slots[: len(q_lens)] = np.arange(len(q_lens))[::-1]
    return qsl, seq_lens, slots


def _each_row(q_lens, context, qsl):
    for r, (n, c) in enumerate(zip(q_lens, context)):
        yield r, int(qsl[r]), n, c > 0


def _l2(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


# One jitted step per kernel (and chunk), shared by the tests: every step has the shapes of one bucket (T tokens, S
# rows), so the three mixes of rows run one executable, as test_one_compile_serves_every_mix_of_rows checks.
@functools.partial(jax.jit, static_argnames="chunk")
def _gated_delta_step(q, k, v, g, beta, cache, qsl, seq_lens, slots, *, chunk):
    rows = Rows.of(qsl, seq_lens, slots, T)
    return gated_delta_rule(q, k, v, g, beta, rows.initial(cache), rows, chunk=chunk)


@functools.partial(jax.jit, static_argnames="chunk")
def _ssd_step(x, dt, b, c, a, cache, qsl, seq_lens, slots, *, chunk):
    rows = Rows.of(qsl, seq_lens, slots, T)
    return ssd_scan(x, dt, b, c, a, rows.initial(cache), rows, chunk=chunk)


@jax.jit
def _conv_step(x, weight, bias, cache, qsl, seq_lens, slots):
    rows = Rows.of(qsl, seq_lens, slots, T)
    return causal_conv(x, weight, bias, rows.initial(cache), rows)


@pytest.mark.parametrize("chunk", [8, 64])
@pytest.mark.parametrize("step", range(len(STEPS)))
def test_gated_delta_rule_equals_the_per_token_recurrence(step, chunk):
    q_lens, context = STEPS[step]
    qsl, seq_lens, slots = _rows(q_lens, context)
    rng = np.random.default_rng(step)
    dk, dv = 8, 6
    q = (_l2(rng.standard_normal((T, H, dk))) * dk**-0.5).astype(np.float32)
    k = _l2(rng.standard_normal((T, H, dk))).astype(np.float32)
    v = rng.standard_normal((T, H, dv)).astype(np.float32)
    g = (-np.abs(rng.standard_normal((T, H))) * 0.5).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, H))))).astype(np.float32)
    cache = rng.standard_normal((S, H, dk, dv)).astype(np.float32)  # by slot; rows without context ignore theirs

    o, final = (np.asarray(a) for a in _gated_delta_step(q, k, v, g, beta, cache, qsl, seq_lens, slots, chunk=chunk))
    for r, s, n, has_context in _each_row(q_lens, context, qsl):
        start = cache[slots[r]] if has_context else np.zeros((H, dk, dv))
        want_o, want_state = naive_gated_delta(q[s : s + n], k[s : s + n], v[s : s + n], g[s : s + n], beta[s : s + n], start)
        np.testing.assert_allclose(o[s : s + n], want_o, atol=2e-5, rtol=0)
        np.testing.assert_allclose(final[r], want_state, atol=2e-5, rtol=0)
    assert np.all(o[qsl[-1] :] == 0)  # padding tokens belong to no row


@pytest.mark.parametrize("chunk", [8, 64])
@pytest.mark.parametrize("step", range(len(STEPS)))
def test_ssd_equals_the_per_token_recurrence(step, chunk):
    q_lens, context = STEPS[step]
    qsl, seq_lens, slots = _rows(q_lens, context)
    rng = np.random.default_rng(10 + step)
    p, n_state = 4, 5
    x = rng.standard_normal((T, H, p)).astype(np.float32)
    dt = (np.abs(rng.standard_normal((T, H))) * 0.3).astype(np.float32)
    b, c = (rng.standard_normal((T, H, n_state)).astype(np.float32) for _ in range(2))
    a = -np.abs(rng.standard_normal(H)).astype(np.float32) - 0.1
    cache = rng.standard_normal((S, H, p, n_state)).astype(np.float32)

    y, final = (np.asarray(v) for v in _ssd_step(x, dt, b, c, a, cache, qsl, seq_lens, slots, chunk=chunk))
    for r, s, n, has_context in _each_row(q_lens, context, qsl):
        start = cache[slots[r]] if has_context else np.zeros((H, p, n_state))
        want_y, want_state = naive_ssd(x[s : s + n], dt[s : s + n], b[s : s + n], c[s : s + n], a, start)
        np.testing.assert_allclose(y[s : s + n], want_y, atol=2e-5, rtol=0)
        np.testing.assert_allclose(final[r], want_state, atol=2e-5, rtol=0)


@pytest.mark.parametrize("step", range(len(STEPS)))
def test_causal_conv_continues_each_rows_window(step):
    q_lens, context = STEPS[step]
    qsl, seq_lens, slots = _rows(q_lens, context)
    rng = np.random.default_rng(20 + step)
    channels, width = 7, 4
    x = rng.standard_normal((T, channels)).astype(np.float32)
    weight = rng.standard_normal((width, channels)).astype(np.float32)
    bias = rng.standard_normal(channels).astype(np.float32)
    cache = rng.standard_normal((S, width - 1, channels)).astype(np.float32)

    y, state = (np.asarray(v) for v in _conv_step(x, weight, bias, cache, qsl, seq_lens, slots))
    for r, s, n, has_context in _each_row(q_lens, context, qsl):
        start = cache[slots[r]] if has_context else np.zeros((width - 1, channels))
        want_y, want_state = naive_causal_conv(x[s : s + n], weight, bias, start)
        np.testing.assert_allclose(y[s : s + n], want_y, atol=1e-5, rtol=0)
        np.testing.assert_allclose(state[r], want_state, atol=0, rtol=0)


def test_chunks_cover_the_prefill_rows_only_in_token_order():
    q_lens, context = STEPS[0]
    qsl, seq_lens, slots = _rows(q_lens, context)
    rows = Rows.of(jnp.asarray(qsl), jnp.asarray(seq_lens), jnp.asarray(slots), T)
    row, start, length, live = (np.asarray(a) for a in chunk_list(rows, T, 16))
    live = int(live)
    assert live == sum(-(-n // 16) for n in q_lens if n >= 2)  # decode rows take the one-step path
    assert len(row) == -(-T // 16) + S  # the static bound
    covered = [t for c in range(live) for t in range(start[c], start[c] + length[c])]
    assert covered == [t for n, s in zip(q_lens, qsl) if n >= 2 for t in range(s, s + n)]
    assert all(np.diff(start[:live]) > 0)


def test_one_compile_serves_every_mix_of_rows():
    """Fixed shapes: decode-only, mixed and prefill-only steps of one bucket run the one executable."""
    rng = np.random.default_rng(5)
    dk = dv = 4
    args = [rng.standard_normal(shape).astype(np.float32) for shape in [(T, H, dk), (T, H, dk), (T, H, dv)]]
    g = -np.abs(rng.standard_normal((T, H))).astype(np.float32)
    beta = np.full((T, H), 0.5, np.float32)
    cache = np.zeros((S, H, dk, dv), np.float32)

    @jax.jit
    def run(qsl, seq_lens, slots):
        rows = Rows.of(qsl, seq_lens, slots, T)
        return gated_delta_rule(*args, g, beta, rows.initial(cache), rows, chunk=16)

    jax.block_until_ready(run(*_rows(*STEPS[0])))
    before = compile_monitor.compile_count()
    for step in STEPS:
        jax.block_until_ready(run(*_rows(*step)))
    assert compile_monitor.compile_count() == before

"""The pure-JAX paged attention the engine runs equals the naive definition, on ragged steps.

Both run jitted, as the engine runs them (op by op, each case compiled dozens of small programs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpaged.pallas_kernels import AttentionSpec, stack_new_kv, write_kv
from jaxpaged.pallas_kernels.reference import naive_paged_attention, reference_paged_attention

from tests.attention_cases import attention_args, random_case

# jitted; the layer and spec static as in the engine's compiled step
naive = jax.jit(naive_paged_attention, static_argnames=("layer", "spec"))
reference = jax.jit(reference_paged_attention, static_argnames=("layer", "spec", "batch_invariant"))

SHAPES = [
    # (seq_lens, q_lens): decode, prefill chunks over cached context, fresh prefills, partial blocks
    ([1], [1]),
    ([37, 5, 300, 129], [1, 5, 40, 1]),
    ([16, 17, 15, 2000], [16, 1, 3, 1]),
    ([64, 64, 64], [64, 1, 33]),
]


# one block size and GQA ratio (1, 2, 4, 8) per shape, each block size and ratio met at least once (a shape in two
# block sizes compiled the same code twice)
CASES = [(SHAPES[0], 8, (4, 4)), (SHAPES[1], 16, (8, 2)), (SHAPES[2], 16, (8, 1)), (SHAPES[3], 32, (4, 2))]


@pytest.mark.parametrize("shape,block_size,heads", CASES)
def test_reference_equals_naive(shape, block_size, heads):
    (seq_lens, q_lens), (heads, kv_heads) = shape, heads
    rng = np.random.default_rng(len(seq_lens) * 100 + block_size + heads * 7 + kv_heads)
    case = random_case(
        rng, seq_lens=seq_lens, q_lens=q_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=32, block_size=block_size
    )
    written = write_kv(case.kv_cache, stack_new_kv([(case.k, case.v)]), case.attn_metadata.slot_mapping)
    want = naive(case.q, written, 0, case.attn_metadata, AttentionSpec(0.2))
    got = reference(case.q, case.k, case.v, case.kv_cache, 0, case.attn_metadata, AttentionSpec(0.2))
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(got[:n]), np.asarray(want[:n]), atol=1e-5, rtol=0)
    assert np.all(np.asarray(got[n:]) == 0)  # padding rows read nothing


@pytest.mark.parametrize(
    "window,cap,alibi", [(7, None, False), (None, 30.0, False), (64, 5.0, False), (None, None, True), (16, None, True)]
)
def test_sliding_window_soft_cap_and_alibi(window, cap, alibi):
    rng = np.random.default_rng(3)
    case = random_case(rng, seq_lens=[200, 9, 70], q_lens=[30, 9, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    written = write_kv(case.kv_cache, stack_new_kv([(case.k, case.v)]), case.attn_metadata.slot_mapping)
    slopes = jnp.asarray([0.5, 0.25, 0.0625, 0.01], jnp.float32) if alibi else None
    kw = dict(scale=0.25, sliding_window=window, soft_cap=cap, alibi_slopes=slopes)
    want = naive(case.q, written, 0, case.attn_metadata, *attention_args(**kw))
    n = case.num_real_tokens
    for batch_invariant in (False, True):  # the fast path and the batch-invariant one
        got = reference(case.q, case.k, case.v, case.kv_cache, 0, case.attn_metadata, *attention_args(**kw), batch_invariant=batch_invariant)
        np.testing.assert_allclose(np.asarray(got[:n]), np.asarray(want[:n]), atol=1e-5, rtol=0)


def test_bfloat16_inputs_accumulate_in_float32():
    rng = np.random.default_rng(4)
    case = random_case(
        rng, seq_lens=[500, 33], q_lens=[1, 33], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.bfloat16
    )
    written = write_kv(case.kv_cache, stack_new_kv([(case.k, case.v)]), case.attn_metadata.slot_mapping)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = naive(f32(case.q), f32(written), 0, case.attn_metadata, AttentionSpec(0.125))
    got = reference(case.q, case.k, case.v, case.kv_cache, 0, case.attn_metadata, AttentionSpec(0.125))
    assert got.dtype == jnp.bfloat16
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(f32(got[:n])), np.asarray(want[:n]), atol=2e-2, rtol=0)


def test_write_kv_drops_padding_rows_and_fills_slots():
    rng = np.random.default_rng(5)
    case = random_case(rng, seq_lens=[20, 3], q_lens=[4, 3], num_heads=2, num_kv_heads=1, head_dim=8, block_size=8)
    written = np.asarray(write_kv(case.kv_cache, stack_new_kv([(case.k, case.v)]), case.attn_metadata.slot_mapping))
    before = np.array(case.kv_cache)
    slots = np.asarray(case.attn_metadata.slot_mapping)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        block, offset = divmod(int(slot), 8)
        np.testing.assert_array_equal(written[0, 0, block, :, offset], np.asarray(case.k[t]))
        np.testing.assert_array_equal(written[0, 1, block, :, offset], np.asarray(case.v[t]))
        before[0, :, block, :, offset] = written[0, :, block, :, offset]
    np.testing.assert_array_equal(written, before)  # nothing else changed


def test_alibi_definition_matches_an_explicit_bias():
    """naive_paged_attention with slopes equals softmax(scale * q.k + slope * (key_pos - query_pos)) by hand."""
    rng = np.random.default_rng(6)
    case = random_case(rng, seq_lens=[12], q_lens=[5], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4,
                       padded_seqs=0, padded_tokens=0)  # fmt: skip
    slopes = np.array([0.3, 0.07], np.float32)
    written = write_kv(case.kv_cache, stack_new_kv([(case.k, case.v)]), case.attn_metadata.slot_mapping)
    got = np.asarray(naive(case.q, written, 0, case.attn_metadata, AttentionSpec(0.5), jnp.asarray(slopes)))
    table = np.asarray(case.attn_metadata.block_tables[0])
    cache = np.asarray(written)[0]
    keys = np.concatenate([cache[0, b, 0] for b in table])[:12]  # [12, D], one KV head
    values = np.concatenate([cache[1, b, 0] for b in table])[:12]
    q = np.asarray(case.q)
    for t in range(5):
        pos = 7 + t
        for h in range(2):
            s = 0.5 * keys[: pos + 1] @ q[t, h] + slopes[h] * (np.arange(pos + 1) - pos)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(got[t, h], (p / p.sum()) @ values[: pos + 1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_join_the_denominator_as_transformers_gpt_oss(window):
    """GPT-OSS's sinks: each head's logit is appended to the row's scores, softmaxed with them, and dropped (no value):
    the definition against that computed densely in numpy, then the reference (fast and batch-invariant) against it."""
    rng = np.random.default_rng(5)
    case = random_case(rng, seq_lens=[23, 40], q_lens=[23, 7], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    written = write_kv(case.kv_cache, stack_new_kv([(case.k, case.v)]), case.attn_metadata.slot_mapping)
    sinks = jnp.asarray([-1.0, 0.5, 2.0, 4.0], jnp.float32)
    kw = dict(scale=0.25, sliding_window=window, sinks=sinks)
    want = np.asarray(naive(case.q, written, 0, case.attn_metadata, *attention_args(**kw)))
    q, k, v = (np.asarray(x, np.float64) for x in (case.q, case.k, case.v))
    for t in range(23):  # the first sequence is all new: its keys are this step's
        for h in range(4):
            keys = [j for j in range(t + 1) if window is None or j > t - window]
            logits = np.array([q[t, h] @ k[j, h // 2] * 0.25 for j in keys] + [float(sinks[h])])
            p = np.exp(logits - logits.max())
            p = p[:-1] / p.sum()
            np.testing.assert_allclose(want[t, h], p @ v[keys, h // 2], atol=1e-5, rtol=0)
    n = case.num_real_tokens
    for batch_invariant in (False, True):
        got = reference(case.q, case.k, case.v, case.kv_cache, 0, case.attn_metadata, *attention_args(**kw),
                        batch_invariant=batch_invariant)  # fmt: skip
        np.testing.assert_allclose(np.asarray(got[:n]), want[:n], atol=1e-5, rtol=0)
        assert np.all(np.asarray(got[n:]) == 0)

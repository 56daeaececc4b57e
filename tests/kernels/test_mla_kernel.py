"""The MLA absorbed-decode GPU kernel (pallas_kernels/mla_gpu.py): interpreted on CPU against the pure-JAX MLA on a
ragged step (decode rows over long contexts, a chunked prompt, a fresh one, padding), with latent widths of one and of
two power-of-two segments; and lowered (exported) for cuda at DeepSeek-V3's shape, 128 heads over 512 + 64."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jaxpaged.pallas_kernels import AttentionMetadata, kv_cache_shape
from jaxpaged.pallas_kernels.mla import mla_reference
from jaxpaged.pallas_kernels.mla_gpu import gpu_mla_cached, segments

from tests.exporting import TRITON_CALLS, export_checks, kernel_calls, lowering_for


def test_segments_are_powers_of_two():
    assert segments(288) == ((0, 256), (256, 32))
    assert segments(32) == ((0, 32),)
    assert segments(48) == ((0, 32), (32, 16))


def _step(rng, rank, rope, bs, cached, new, tokens):
    width = -(-max(c + n for c, n in zip(cached, new)) // bs)
    seqs = len(cached)
    tables = rng.permutation(seqs * width).astype(np.int32).reshape(seqs, width)
    cache = jnp.asarray(rng.standard_normal(kv_cache_shape(2, 1, seqs * width, bs, (rank + rope) // 2)), jnp.float32)
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    slots = np.full(tokens, -1, np.int32)
    for s, (c, n) in enumerate(zip(cached, new)):
        p = np.arange(c, c + n)
        slots[qsl[s] : qsl[s] + n] = tables[s][p // bs] * bs + p % bs
    md = AttentionMetadata(jnp.asarray(slots), jnp.asarray(tables), jnp.asarray(np.add(cached, new), np.int32), jnp.asarray(qsl))
    return cache, md


@pytest.mark.parametrize("rank,rope,heads", [(48, 16, 4), (80, 16, 20)])  # one segment; two (48 = 32 + 16), 32 rows
def test_kernel_equals_reference_interpreted(rank, rope, heads):
    rng = np.random.default_rng(1)
    nope, vdim, bs, tokens = 16, 16, 8, 24
    cached, new = [70, 3, 40, 0], [1, 1, 6, 9]
    cache, md = _step(rng, rank, rope, bs, cached, new, tokens)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    args = (f(tokens, heads, nope), f(tokens, heads, rope), f(tokens, rank), f(tokens, rope), f(rank, heads, nope),
            f(rank, heads, vdim), cache, 1, md, 0.1)  # fmt: skip
    want = mla_reference(*args)
    got = mla_reference(*args, absorbed=functools.partial(gpu_mla_cached, interpret=True, kv_chunk=16))
    live = int(sum(new))
    np.testing.assert_allclose(np.asarray(got)[:live], np.asarray(want)[:live], rtol=2e-5, atol=2e-5)
    assert not np.asarray(got)[live:].any()
    jax.clear_caches()


def test_kernel_lowers_for_cuda_at_deepseek_v3_shape():
    """128 heads, the row 512 + 64 (two planes of 288 = 256 + 32), bfloat16, a traced layer: one Triton call."""
    sd = jax.ShapeDtypeStruct
    tokens, seqs, width, blocks, bs = 64, 32, 16, 256, 16
    md = AttentionMetadata(sd((tokens,), jnp.int32), sd((seqs, width), jnp.int32), sd((seqs,), jnp.int32), sd((seqs + 1,), jnp.int32))
    fn = jax.jit(lambda q, cache, layer, md: gpu_mla_cached(q, cache, layer, md, 0.1))
    with lowering_for("cuda"):
        exported = export.export(fn, platforms=["cuda"], **export_checks("cuda"))(
            sd((tokens, 128, 576), jnp.bfloat16), sd((4, 2, blocks, 1, bs, 288), jnp.bfloat16), sd((), jnp.int32), md)
    assert len(kernel_calls(exported.mlir_module(), TRITON_CALLS)) == 1

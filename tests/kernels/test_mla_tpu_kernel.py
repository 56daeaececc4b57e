"""The MLA absorbed-decode TPU kernel (pallas_kernels/mla_tpu.py): interpreted on CPU (Pallas' interpreter and TPU
interpret mode, which simulates the DMAs and semaphores, fills fresh VMEM with NaN and looks for races) against the
pure-JAX MLA on mixed steps (decode rows at several context lengths, a chunked prefill reading its earlier chunks, a
fresh prompt, padding rows) in float32 and bfloat16 (held as uint16 bits, as the CPU engine stores it), from block
tables full of garbage past each sequence's live pages; DeepSeek-V3's head layout scaled down (16 heads, latent 64 +
rope 16) and at its own shape (128 heads, 512 + 64); and lowered (exported) for "tpu" at DeepSeek-V3's shape, one
Mosaic kernel for every layer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu
from jaxpaged.pallas_kernels import AttentionMetadata, kv_cache_shape
from jaxpaged.pallas_kernels.kv_quant import QuantizedKV
from jaxpaged.pallas_kernels.mla import mla_reference
from jaxpaged.pallas_kernels.mla_tpu import takes, tpu_mla_cached

from tests.exporting import MOSAIC_CALL, kernel_bodies, kernel_calls
from tests.kernels.test_tpu_attention import _tpu_interpret_state

_sd = jax.ShapeDtypeStruct


def _step(rng, rank, rope, bs, cached, new, tokens, dtype, width):
    """A step's metadata over a cache of random latent rows (dtype; bfloat16 stored as uint16 bits), its tables
    `width` wide: each sequence's live pages distinct blocks, every other entry garbage (out of range or wrong)."""
    seqs = len(cached)
    pages = [-(-(c + n) // bs) for c, n in zip(cached, new)]
    num_blocks = sum(pages) + 3
    live = rng.permutation(num_blocks)[: sum(pages)]
    tables = np.where(rng.random((seqs, width)) < 0.5, rng.integers(-(2**31), 2**31 - 1, (seqs, width)),
                      rng.integers(0, num_blocks, (seqs, width))).astype(np.int32)  # fmt: skip
    at = 0
    for s, n in enumerate(pages):
        tables[s, :n] = live[at : at + n]
        at += n
    cache = jnp.asarray(rng.standard_normal(kv_cache_shape(2, 1, num_blocks, bs, (rank + rope) // 2)), dtype)
    if dtype == jnp.bfloat16:
        cache = jax.lax.bitcast_convert_type(cache, jnp.uint16)
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    slots = np.full(tokens, -1, np.int32)
    for s, (c, n) in enumerate(zip(cached, new)):
        p = np.arange(c, c + n)
        slots[qsl[s] : qsl[s] + n] = tables[s][p // bs] * bs + p % bs
    md = AttentionMetadata(jnp.asarray(slots), jnp.asarray(tables), jnp.asarray(np.add(cached, new), np.int32), jnp.asarray(qsl))
    return cache, md


def _args(rng, heads, rank, rope, cached, new, tokens, dtype, bs=16, nope=16, vdim=16, width=64):
    cache, md = _step(rng, rank, rope, bs, cached, new, tokens, dtype, width)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    w = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), dtype)
    return (f(tokens, heads, nope), f(tokens, heads, rope), f(tokens, rank), f(tokens, rope), w(rank, heads, nope),
            w(rank, heads, vdim), cache, 1, md, 0.3 / np.sqrt(nope + rope))  # fmt: skip


def _mla(args, absorbed=None):
    """mla_reference over _args' arguments, jitted (one compile instead of op-by-op); absorbed: the cached part's kernel."""
    layer, scale = args[7], args[9]
    fn = jax.jit(lambda *a: mla_reference(*a[:7], layer, a[7], scale, absorbed=absorbed))
    return np.asarray(fn(*args[:7], args[8]), np.float32)


# decode rows at 300, 3, 128 (exactly one iteration's keys) and 129 cached tokens, a 6-token chunk over 40 cached
# (two tiles of 4 tokens at 16 heads), a fresh 9-token prompt (nothing cached), 4 padding rows
CACHED, NEW = [300, 3, 128, 129, 40, 0], [1, 1, 1, 1, 6, 9]


def test_kernel_equals_reference_interpreted_bfloat16():
    """16 heads over latent 64 + rope 16, bfloat16 (float32: test_dmas_fetch_only_live_pages; heads that are no
    multiple of 16, padded: the engine test's 4)."""
    rng = np.random.default_rng(1)
    tokens = sum(NEW) + 4
    args = _args(rng, 16, 64, 16, CACHED, NEW, tokens, jnp.bfloat16)
    want, got = _mla(args), _mla(args, functools.partial(tpu_mla_cached, interpret=True))
    live = sum(NEW)
    np.testing.assert_allclose(got[:live], want[:live], rtol=0, atol=2e-2 * np.abs(want).max())
    assert not got[live:].any()
    jax.clear_caches()


def test_kernel_at_deepseek_v3_shape_interpreted():
    """128 heads (one token a tile), the row 512 + 64 (planes of 288, padded to 384 lanes), bfloat16: a decode row
    and a 2-token chunk over 130 cached tokens, a padding row."""
    rng = np.random.default_rng(2)
    args = _args(rng, 128, 512, 64, [200, 130], [1, 2], 4, jnp.bfloat16, nope=32, vdim=32, width=16)
    want, got = _mla(args), _mla(args, functools.partial(tpu_mla_cached, interpret=True))
    np.testing.assert_allclose(got[:3], want[:3], rtol=0, atol=2e-2 * np.abs(want).max())
    assert not got[3:].any()
    jax.clear_caches()


def test_dmas_fetch_only_live_pages():
    """TPU interpret mode: DMAs counted, races looked for (pages and table chunks double-buffered within a program and
    into the next), fresh VMEM NaN (the pad lanes and unfetched rows the select must keep out). The K and V planes of
    each live page, once per tile: 19 + 1 + 8 + 9 pages for the decode rows, 3 for each of the chunk's two tiles; plus
    one table chunk per program that reads pages, in chunks of 8 entries here (so the rows of 19 and 9 pages refill
    theirs: 3 and 2 chunks). Nothing else, from a 512-wide table of garbage (max_model_len 8192)."""
    rng = np.random.default_rng(3)
    tokens = sum(NEW) + 4
    args = _args(rng, 16, 64, 16, CACHED, NEW, tokens, jnp.float32, width=512)
    want = _mla(args)
    absorbed = functools.partial(tpu_mla_cached, interpret=pltpu.InterpretParams(detect_races=True), table_chunk=8)
    try:
        got = _mla(args, absorbed)
        dmas, races = _tpu_interpret_state()
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    assert dmas == 2 * (19 + 1 + 8 + 9 + 2 * 3) + 6 + 2 + 1 and not races
    np.testing.assert_allclose(got[: sum(NEW)], want[: sum(NEW)], rtol=0, atol=2e-5)
    jax.clear_caches()


def test_takes_float_caches_with_blocks_of_16_or_more():
    shape = lambda bs: kv_cache_shape(2, 1, 8, bs, 40)
    assert takes(_sd(shape(16), jnp.bfloat16)) and takes(_sd(shape(256), jnp.uint16))
    assert not takes(_sd(shape(8), jnp.float32))  # a page under a sublane tile of bfloat16: the pure-JAX path
    quantized = QuantizedKV(_sd(shape(16), jnp.int8), _sd(shape(16)[:-1], jnp.float32), "int8")
    assert not takes(quantized)


@pytest.mark.parametrize("heads,rank,rope", [(128, 512, 64), (16, 64, 16)])
def test_kernel_lowers_for_tpu(heads, rank, rope):
    """DeepSeek-V3's shape (128 heads over 512 + 64) and the scaled-down one, bfloat16, block 16, the layer traced:
    four layers' calls share one Mosaic kernel (one custom call, in the jitted kernel's function; an interpreted one
    would lower to no custom call)."""
    tokens, seqs, width, blocks, bs = 64, 32, 512, 256, 16
    md = AttentionMetadata(_sd((tokens,), jnp.int32), _sd((seqs, width), jnp.int32), _sd((seqs,), jnp.int32),
                           _sd((seqs + 1,), jnp.int32))  # fmt: skip

    def layers(q, cache, md):
        return [tpu_mla_cached(q, cache, layer, md, 0.1) for layer in range(4)]

    exported = export.export(jax.jit(layers), platforms=["tpu"])(
        _sd((tokens, heads, rank + rope), jnp.bfloat16), _sd((4, 2, blocks, 1, bs, (rank + rope) // 2), jnp.bfloat16), md)
    module = exported.mlir_module()
    (call,) = kernel_calls(module, (MOSAIC_CALL,))
    assert len(kernel_bodies(module, (MOSAIC_CALL,))) == 1
    lanes = 2 * (-(-(rank + rope) // 2 // 128) * 128)  # each plane padded to whole 128-lane tiles: 288 -> 384
    assert f"x{lanes}xbf16>" in call and f"x{lanes}xf32>" in call


def _values(jaxpr):
    """Every non-scalar value a (kernel) jaxpr computes, nested jaxprs included: (primitive, shape)."""
    out = set()
    for eqn in jaxpr.eqns:
        out |= {(eqn.primitive.name, tuple(v.aval.shape)) for v in eqn.outvars if getattr(v.aval, "shape", ())}
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out |= _values(sub)
    return out


def test_kernel_values_fill_whole_tiles_at_deepseek_v3_shape():
    """Mosaic's vector layout: every value the kernel computes is [sublanes, lanes] with sublanes a multiple of 16 (a
    bfloat16 tile) and lanes a multiple of 128, or a row statistic [rows, 1] (and [rows] between a reduction and its
    keepdims): the page tile [128 keys, 768 lanes],
    the scores [128 rows, 128 keys], the sum [128, 768]. (Exporting alone does not run Mosaic's layout passes.)"""
    from tests.kernels.test_tpu_attention import _pallas_calls

    tokens, seqs, width, blocks, bs = 64, 32, 512, 256, 16
    md = AttentionMetadata(_sd((tokens,), jnp.int32), _sd((seqs, width), jnp.int32), _sd((seqs,), jnp.int32),
                           _sd((seqs + 1,), jnp.int32))  # fmt: skip
    jaxpr = jax.make_jaxpr(lambda q, c, md: tpu_mla_cached(q, c, 0, md, 0.1))(
        _sd((tokens, 128, 576), jnp.bfloat16), _sd((4, 2, blocks, 1, bs, 288), jnp.bfloat16), md)
    (eqn,) = _pallas_calls(jaxpr.jaxpr)
    shapes = {shape for _, shape in _values(eqn.params["jaxpr"])}
    assert {(128, 768), (128, 128), (128, 1)} <= shapes
    rows_only = {s for s in shapes if len(s) == 1}  # a reduction's result, before its keepdims [rows, 1]
    assert rows_only == {(128,)}
    assert all(s[0] % 16 == 0 and (s[1] % 128 == 0 or s[1] == 1) for s in shapes - rows_only), shapes

"""The absorbed half of MLA (pallas_kernels/mla.py) as a GPU kernel, in Pallas' Triton dialect (interpreted on CPU).

One program per query row: it holds the row's H heads' absorbed queries ([q_nope W_UK^T, q_pe], R + P wide; the heads
padded to at least 16, tl.dot's smallest M) and streams the row's cached latent rows once for all of them, chunk by
chunk through the block table, with an online softmax in float32: MQA with one KV head, as FlashMLA does, each
latent read serving every head. It returns the partial softmax (peak, denominator, latent sum) that mla_reference
merges with this step's own keys (the expanded part, in JAX).

The cache row [c, k_pe] lies in the KV array as a K plane and a V plane of (R + P) / 2 each (288 for DeepSeek's 512 +
64), not a power of two as Triton's tensors must be: each plane is read as power-of-two column segments (288 = 256 +
32), the query split to match, so the scores are a sum of segment dots and the latent sum is kept per segment.

A decode row reads its context once; a prefill row with cached context reads it once per row (no query tiling yet).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxpaged.pallas_kernels.metadata import AttentionMetadata
from jaxpaged.pallas_kernels.reference import token_layout
from jaxpaged.pallas_kernels.tiles import MASK_VALUE

MIN_ROWS = 16  # tl.dot's smallest M, N and K


def segments(width: int) -> tuple[tuple[int, int], ...]:
    """(offset, size) power-of-two pieces of [0, width), largest first: 288 -> (0, 256), (256, 32)."""
    out, at = [], 0
    for bit in reversed(range(width.bit_length())):
        if width & (1 << bit):
            out.append((at, 1 << bit))
            at += 1 << bit
    return tuple(out)


def _kernel(layer_ref, seq_ref, cached_ref, tables_ref, q_ref, cache_ref, acc_ref, peak_ref, denom_ref, *,
            kv_chunk, num_blocks, pieces, scale, precision):  # fmt: skip
    row = pl.program_id(0)
    seq, cached = seq_ref[row], cached_ref[row]
    block_size = cache_ref.shape[1]
    k_base = layer_ref[0] * 2 * num_blocks  # this layer's K planes; its V planes follow
    offsets = jnp.arange(kv_chunk, dtype=jnp.int32)
    half = cache_ref.shape[-1]
    # the query's columns, per plane and segment: plane 0 covers [0, half), plane 1 [half, 2 half)
    qs = [q_ref[:, pl.ds(plane * half + at, size)] for plane in (0, 1) for at, size in pieces]
    heads = qs[0].shape[0]

    def body(j, carry):
        accs, peak, denom = carry[:-2], carry[-2], carry[-1]
        key_pos = j * kv_chunk + offsets
        block = jnp.clip(tables_ref[seq, key_pos // block_size], 0, num_blocks - 1)
        within = key_pos % block_size
        tiles = [cache_ref[base + block, within, pl.ds(at, size)] for base in (k_base, k_base + num_blocks) for at, size in pieces]
        s = plgpu.dot(qs[0], tiles[0], trans_b=True, precision=precision)
        for q, tile in zip(qs[1:], tiles[1:]):
            s = s + plgpu.dot(q, tile, trans_b=True, precision=precision)
        s = s * scale
        mask = jnp.broadcast_to(key_pos[None, :] < cached, (heads, kv_chunk))
        s = jnp.where(mask, s, MASK_VALUE)
        new_peak = jnp.maximum(peak, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - new_peak[:, None]), 0.0)
        correction = jnp.exp(peak - new_peak)
        accs = [acc * correction[:, None] + plgpu.dot(p.astype(tile.dtype), tile, precision=precision)
                for acc, tile in zip(accs, tiles)]  # fmt: skip
        return (*accs, new_peak, denom * correction + jnp.sum(p, axis=1))

    init = (*[jnp.zeros((heads, size), jnp.float32) for _ in (0, 1) for _, size in pieces],
            jnp.full((heads,), MASK_VALUE, jnp.float32), jnp.zeros((heads,), jnp.float32))  # fmt: skip
    out = jax.lax.fori_loop(0, pl.cdiv(cached, kv_chunk), body, init)
    for (plane, (at, size)), acc in zip([(p, s) for p in (0, 1) for s in pieces], out[:-2]):
        acc_ref[:, pl.ds(plane * half + at, size)] = acc
    peak_ref[...] = out[-2]
    denom_ref[...] = out[-1]


def gpu_mla_cached(q_abs, kv_cache, layer, attn_metadata: AttentionMetadata, scale: float, *, interpret: bool = False,
                   kv_chunk: int = 32) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """q_abs [T, H, R + P] (W_UK folded into q_nope, then q_pe) over each row's cached latent rows -> the partial
    softmax (peak [T, 1, H], denom [T, 1, H], latent sum [T, 1, H, R + P]) as mla_reference's cached part gives it
    (its first R columns the latent's; rows with nothing cached: peak -inf, zeros)."""
    num_tokens, num_heads, width = q_abs.shape
    num_layers, _, num_blocks, _, block_size, half = kv_cache.shape
    if kv_cache.dtype == jnp.uint16:  # a CPU cache of 16-bit floats holds their bits (interpret mode only)
        kv_cache = jax.lax.bitcast_convert_type(kv_cache, q_abs.dtype)
    heads = max(MIN_ROWS, 1 << (num_heads - 1).bit_length())
    seq, _, valid = token_layout(attn_metadata, num_tokens)
    q_lens = attn_metadata.query_start_loc[seq + 1] - attn_metadata.query_start_loc[seq]
    cached = jnp.where(valid, attn_metadata.seq_lens[seq] - q_lens, 0).astype(jnp.int32)
    table_width = attn_metadata.block_tables.shape[1]
    keys = -(-table_width * block_size // kv_chunk) * kv_chunk  # the table padded to whole chunks
    tables = jnp.pad(attn_metadata.block_tables, ((0, 0), (0, -(-keys // block_size) - table_width)))
    q = jnp.pad(q_abs, ((0, 0), (0, heads - num_heads), (0, 0)))
    cache = kv_cache.reshape(num_layers * 2 * num_blocks, block_size, half)  # one KV head: the layer an offset
    whole = lambda shape: pl.BlockSpec(shape, lambda t: (0,) * len(shape))
    kernel = functools.partial(_kernel, kv_chunk=kv_chunk, num_blocks=num_blocks, pieces=segments(half), scale=scale,
                               precision=jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)  # fmt: skip
    acc, peak, denom = pl.pallas_call(
        kernel,
        grid=(num_tokens,),
        in_specs=[whole((1,)), whole(seq.shape), whole(cached.shape), whole(tables.shape),
                  pl.BlockSpec((None, heads, width), lambda t: (t, 0, 0)), whole(cache.shape)],
        out_specs=[pl.BlockSpec((None, heads, width), lambda t: (t, 0, 0)), pl.BlockSpec((None, heads), lambda t: (t, 0)),
                   pl.BlockSpec((None, heads), lambda t: (t, 0))],
        out_shape=[jax.ShapeDtypeStruct((num_tokens, heads, width), jnp.float32),
                   jax.ShapeDtypeStruct((num_tokens, heads), jnp.float32), jax.ShapeDtypeStruct((num_tokens, heads), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=f"mla_absorbed_h{heads}_w{width}_kv{kv_chunk}",
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), seq, cached, tables, q, cache)
    acc, peak, denom = acc[:, None, :num_heads], peak[:, None, :num_heads], denom[:, None, :num_heads]
    return jnp.where(denom > 0, peak, -jnp.inf), denom, acc

"""Ragged paged attention for GPUs, in Pallas' Triton dialect (also run in interpret mode on CPU).

One program per (query tile, KV head). It holds a tile's query rows for all the query heads
that share the KV head (tokens x padded group, at least 16 rows for the tensor cores), streams
the sequence's cached K/V through its block-table row, a few blocks per iteration, then this
step's own K/V (not in the cache yet: the runner writes it after the forward pass), with an
online softmax in float32. Each KV block is loaded once per program and serves every query
head of its group.

Triton rather than Mosaic GPU: it runs on every NVIDIA GPU JAX supports, exports for "cuda"
without one, and runs interpreted on CPU (docs/design.md, "The Pallas kernels").

Shapes the wrapper fixes so the kernel never reads out of bounds: the flat token axis gets
one tile of padding rows, the block table is padded to whole iterations, and block ids are
clamped into the pool. Padding rows and padded sequence slots are covered by no tile; their
output rows stay zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxpaged.pallas_kernels.metadata import AttentionMetadata, AttentionSpec
from jaxpaged.pallas_kernels.tiles import MASK_VALUE, check_head_dim, query_tiles, tile_shape

MIN_ROWS = 16  # tl.dot's smallest M, N and K
KV_TOKENS_PER_ITER = 64  # cached tokens per inner iteration (whole blocks)
NEW_KEYS_PER_ITER = 32  # this step's keys per inner iteration


def _kernel(
    tile_seq_ref, tile_start_ref, tile_len_ref, query_start_ref, seq_lens_ref, tables_ref,
    q_ref, k_new_ref, v_new_ref, k_cache_ref, v_cache_ref, slope_ref, _zeros_ref, o_ref,
    *, group_pad, tokens_per_tile, pages_per_iter, new_per_iter, num_blocks, spec,
    use_alibi, precision,
):  # fmt: skip
    scale, sliding_window, soft_cap = spec.scale, spec.sliding_window, spec.soft_cap
    tile = pl.program_id(0)
    n_tok = tile_len_ref[tile]
    rows = tokens_per_tile * group_pad
    block_size, head_dim = k_cache_ref.shape[-2], k_cache_ref.shape[-1]
    kv_tokens = pages_per_iter * block_size

    @pl.when(n_tok > 0)
    def _():
        seq, t0 = tile_seq_ref[tile], tile_start_ref[tile]
        q_start, q_end = query_start_ref[seq], query_start_ref[seq + 1]
        cached = seq_lens_ref[seq] - (q_end - q_start)  # context positions already in the cache
        pos0 = cached + t0 - q_start  # position of the tile's first token
        q = q_ref[pl.ds(t0 * group_pad, rows), :]
        row_pos = pos0 + jnp.arange(rows, dtype=jnp.int32) // group_pad
        slopes = slope_ref[...] if use_alibi else None  # [rows]: each row's query head's ALiBi slope

        def fold(carry, k, v, mask, key_pos):
            acc, peak, denom = carry
            s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            if use_alibi:
                s = s + slopes[:, None] * (key_pos[None, :] - row_pos[:, None]).astype(jnp.float32)
            s = jnp.where(mask, s, MASK_VALUE)
            new_peak = jnp.maximum(peak, jnp.max(s, axis=1))
            p = jnp.where(mask, jnp.exp(s - new_peak[:, None]), 0.0)
            correction = jnp.exp(peak - new_peak)
            pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)
            return acc * correction[:, None] + pv, new_peak, denom * correction + jnp.sum(p, axis=1)

        lowest = 0 if sliding_window is None else jnp.maximum(0, pos0 - sliding_window + 1)

        def cached_iter(j, carry):
            ids = jnp.clip(tables_ref[seq, pl.ds(j * pages_per_iter, pages_per_iter)], 0, num_blocks - 1)
            k = k_cache_ref[ids].reshape(kv_tokens, head_dim)
            v = v_cache_ref[ids].reshape(kv_tokens, head_dim)
            key_pos = j * kv_tokens + jnp.arange(kv_tokens, dtype=jnp.int32)
            mask = jnp.broadcast_to(key_pos[None, :] < cached, (rows, kv_tokens))
            if sliding_window is not None:
                mask &= key_pos[None, :] > row_pos[:, None] - sliding_window
            return fold(carry, k, v, mask, key_pos)

        carry = (
            jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
        )
        carry = jax.lax.fori_loop(lowest // kv_tokens, pl.cdiv(cached, kv_tokens), cached_iter, carry)

        first_new = q_start + jnp.maximum(0, lowest - cached)  # this step's keys the tile can see
        last_new = t0 + n_tok  # exclusive: causal

        def new_iter(j, carry):
            start = first_new + j * new_per_iter
            k = k_new_ref[pl.ds(start, new_per_iter), :]
            v = v_new_ref[pl.ds(start, new_per_iter), :]
            key_pos = cached + start - q_start + jnp.arange(new_per_iter, dtype=jnp.int32)
            mask = key_pos[None, :] <= row_pos[:, None]
            if sliding_window is not None:
                mask &= key_pos[None, :] > row_pos[:, None] - sliding_window
            return fold(carry, k, v, mask, key_pos)

        acc, _, denom = jax.lax.fori_loop(0, pl.cdiv(last_new - first_new, new_per_iter), new_iter, carry)
        out = acc / jnp.where(denom == 0.0, 1.0, denom)[:, None]
        live = (jnp.arange(rows, dtype=jnp.int32) // group_pad < n_tok)[:, None]
        plgpu.store(o_ref.at[pl.ds(t0 * group_pad, rows), :], out.astype(o_ref.dtype), mask=live)


@functools.partial(jax.jit, static_argnames=("layer", "spec", "interpret", "num_warps", "num_stages"))
def gpu_paged_attention(q, k, v, kv_cache, layer: int, attn_metadata: AttentionMetadata, spec: AttentionSpec, alibi_slopes=None,
                        *, interpret: bool = False, num_warps: int = 4, num_stages: int = 2) -> jax.Array:  # fmt: skip
    """reference_paged_attention's contract: q [T, H, D], this step's k/v [T, H_kv, D] -> [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    check_head_dim(head_dim)
    shape = tile_shape(num_heads, num_kv_heads, block_size, MIN_ROWS, KV_TOKENS_PER_ITER)
    group, group_pad, tokens_per_tile = shape.group, shape.group_pad, shape.tokens_per_tile
    rows, pages_per_iter = shape.rows, shape.pages_per_iter

    seq, start, length = query_tiles(attn_metadata.query_start_loc, num_tokens, tokens_per_tile)
    width = attn_metadata.block_tables.shape[1]
    tables = jnp.pad(attn_metadata.block_tables, ((0, 0), (0, -width % pages_per_iter)))

    # [T, H, D] -> [H_kv, (T + tile) * G', D]: a KV head's query rows, token-major, group padded to G'.
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, tokens_per_tile), (0, 0), (0, group_pad - group), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
    kn, vn = (jnp.pad(x, ((0, NEW_KEYS_PER_ITER), (0, 0), (0, 0))).transpose(1, 0, 2) for x in (k, v))
    # Each query row's slope, [H_kv, rows]: row r of a tile is head r % G' of its KV head's group.
    use_alibi = alibi_slopes is not None
    slopes = jnp.zeros((num_heads,), jnp.float32) if alibi_slopes is None else alibi_slopes.astype(jnp.float32)
    slopes = jnp.pad(slopes.reshape(num_kv_heads, group), ((0, 0), (0, group_pad - group)))
    slopes = jnp.tile(slopes, (1, tokens_per_tile))

    whole = lambda shape: pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))
    per_head = lambda n: pl.BlockSpec((None, n, head_dim), lambda i, h: (h, 0, 0))
    slope_spec = pl.BlockSpec((None, rows), lambda i, h: (h, 0))
    cache_spec = lambda kv: pl.BlockSpec(
        (None, None, num_blocks, None, block_size, head_dim), lambda i, h: (layer, kv, 0, h, 0, 0)
    )
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel, group_pad=group_pad, tokens_per_tile=tokens_per_tile, pages_per_iter=pages_per_iter,
        new_per_iter=NEW_KEYS_PER_ITER, num_blocks=num_blocks, spec=spec, use_alibi=use_alibi, precision=precision,
    )  # fmt: skip
    out_rows = qg.shape[1]
    out = pl.pallas_call(
        kernel,
        grid=(seq.shape[0], num_kv_heads),
        in_specs=[
            whole(seq.shape), whole(start.shape), whole(length.shape),
            whole(attn_metadata.query_start_loc.shape), whole(attn_metadata.seq_lens.shape), whole(tables.shape),
            per_head(out_rows), per_head(kn.shape[1]), per_head(vn.shape[1]), cache_spec(0), cache_spec(1),
            slope_spec, per_head(out_rows),
        ],
        out_specs=per_head(out_rows),
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, out_rows, head_dim), q.dtype),
        input_output_aliases={12: 0},  # start from zeros: rows no tile covers (padding) stay 0
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_r{rows}_kv{pages_per_iter * block_size}",
    )(
        seq, start, length, attn_metadata.query_start_loc, attn_metadata.seq_lens, tables,
        qg, kn, vn, kv_cache, kv_cache, slopes, jnp.zeros((num_kv_heads, out_rows, head_dim), q.dtype),
    )
    out = out.reshape(num_kv_heads, num_tokens + tokens_per_tile, group_pad, head_dim)[:, :num_tokens, :group]
    return out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim)

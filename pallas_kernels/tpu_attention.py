"""Ragged paged attention for TPUs, in Pallas' Mosaic TPU dialect.

Same work split as the GPU kernel (one program per query tile and KV head, each KV block loaded
once for the whole head group, online softmax in float32). The grid is only (tiles, KV heads):
a grid axis over block-table columns would give every program one mostly idle step per column of
the padded table, thousands at long max_model_len. Instead the cache stays in HBM and each program
DMAs just the pages it reads (from the first one its sliding window reaches to its sequence's last),
double-buffered, and starts the next program's first DMA before it finishes, so the grid runs in
order. This step's own K/V is DMA'd the same way in aligned chunks. The block tables stay in HBM too
(S x W int32 is 8 MiB at 256 slots and max_model_len 131072, far beyond SMEM): each program DMAs the
span of its row it walks into SMEM in chunks of TABLE_CHUNK entries, double-buffered and refilled as its
page loop advances, and fetches the next program's first chunk before starting that program's first page
DMA, so SMEM holds a few KiB whatever the table width. The layer is a scalar operand, so a model's layers
share one compiled kernel. Queries and outputs are laid out tile-major by the wrapper because a
BlockSpec cannot start at a ragged row. An int8 or fp8 cache (a QuantizedKV) is DMA'd in 8 bits, each
page's scales beside it, decoded in VMEM and scaled on the scores' and probabilities' columns. The page
and table pipeline and the online softmax are tpu_pipeline.py's, shared with the MLA kernel (mla_tpu.py).

Checked on CPU in interpret mode (TPU interpret mode counts its DMAs and looks for races) and by
exporting for "tpu"; no TPU was at hand to run it compiled.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxpaged.pallas_kernels.metadata import AttentionMetadata, AttentionSpec
from jaxpaged.pallas_kernels.tiles import (
    MASK_VALUE,
    check_head_dim,
    decode_kv,
    first_visible,
    is_local,
    kv_operands,
    query_tiles,
    tile_shape,
    token_tiles,
)
from jaxpaged.pallas_kernels.tpu_pipeline import PagePipeline, div, softmax_fold, softmax_init, start, wait

ROWS = 16  # query rows per program: tokens x padded group
KV_TOKENS_PER_ITER = 64
NEW_KEYS_PER_ITER = 32
TABLE_CHUNK = 128  # block-table entries per DMA into SMEM (512 bytes; two slots)


class _Tile(NamedTuple):
    """Where one program's work lies (scalars read from SMEM): a query tile and a KV head."""

    seq: jax.Array
    head: jax.Array  # the KV head
    t0: jax.Array  # first flat row
    n_tok: jax.Array
    q_start: jax.Array  # its sequence's first flat row
    cached: jax.Array  # its sequence's context before this step
    pos0: jax.Array  # its first query position
    lowest: jax.Array  # the first key position any of its rows sees
    first_page: jax.Array  # it reads cached pages first_page .. first_page + num_pages - 1
    num_pages: jax.Array
    num_groups: jax.Array  # ... in groups of pages_per_iter


def _kernel(
    *refs,  # SMEM: layer, tile_seq, tile_start, tile_len, query_start, seq_lens, [tile_end (image spans)];
    # inputs: q, slope, sink, then in HBM tables, cache, k_new, v_new, [scale (an int8/fp8 cache's scales)]; [row_end];
    # o_ref; scratch: k_buf, v_buf, k_new_buf, v_new_buf, sems, table_buf, table_sems, acc_ref, peak_ref, denom_ref,
    # state_ref, [k_scale_buf, v_scale_buf]
    group_pad, width, spec, use_alibi, precision, kv_kind, bidirectional=False, use_sinks=False,
):  # fmt: skip
    layer_ref, tile_seq_ref, tile_start_ref, tile_len_ref, query_start_ref, seq_lens_ref, *refs = refs
    tile_end_ref = refs.pop(0) if bidirectional else None  # each tile's last visible new key, flat, exclusive
    q_ref, slope_ref, sink_ref, tables_hbm, cache_hbm, k_new_hbm, v_new_hbm, *refs = refs
    scale_hbm = refs.pop(0) if kv_kind else None
    row_end_ref = refs.pop(0) if bidirectional else None  # [rows, 1] each query row's last visible position
    if kv_kind:
        o_ref, *refs, k_scale_buf, v_scale_buf = refs
    else:
        k_scale_buf = v_scale_buf = None
        o_ref, *refs = refs
    k_buf, v_buf, k_new_buf, v_new_buf, sems, table_buf, table_sems, acc_ref, peak_ref, denom_ref, state_ref = refs
    scale, soft_cap = spec.scale, spec.soft_cap
    tile, head = pl.program_id(0), pl.program_id(1)
    num_tiles, num_heads = pl.num_programs(0), pl.num_programs(1)
    rows = q_ref.shape[0]
    _, pages_per_iter, block_size, _ = k_buf.shape
    new_per_iter = k_new_buf.shape[1]
    num_blocks = cache_hbm.shape[2]
    layer = jnp.clip(layer_ref[0], 0, cache_hbm.shape[0] - 1)

    def tile_info(i, h) -> _Tile:
        n_tok = tile_len_ref[i]
        seq, t0 = tile_seq_ref[i], tile_start_ref[i]
        q_start, q_end = query_start_ref[seq], query_start_ref[seq + 1]
        cached = seq_lens_ref[seq] - (q_end - q_start)
        pos0 = cached + t0 - q_start
        lowest = first_visible(pos0, spec)  # its window's or its chunk's first
        first_page = div(lowest, block_size)
        end_page = div(cached + block_size - 1, block_size)
        num_pages = jnp.where((n_tok > 0) & (cached > lowest), end_page - first_page, 0)
        num_groups = div(num_pages + pages_per_iter - 1, pages_per_iter)
        return _Tile(seq, h, t0, n_tok, q_start, cached, pos0, lowest, first_page, num_pages, num_groups)

    def page_copies(t: _Tile, slot, p, block):
        """K and V of one page (and an 8-bit cache's scales) into position p of buffer `slot`."""
        copies = [pltpu.make_async_copy(cache_hbm.at[layer, kv, block, t.head], buf.at[slot, p], sems.at[0, slot])
                  for kv, buf in ((0, k_buf), (1, v_buf))]  # fmt: skip
        copies += [pltpu.make_async_copy(scale_hbm.at[layer, kv, block, t.head], buf.at[slot, p], sems.at[2, slot])
                   for kv, buf in (((0, k_scale_buf), (1, v_scale_buf)) if kv_kind else ())]  # fmt: skip
        return copies

    def page_waits(slot, p):
        copies = [pltpu.make_async_copy(cache_hbm.at[0, kv, 0, 0], buf.at[slot, p], sems.at[0, slot])
                  for kv, buf in ((0, k_buf), (1, v_buf))]  # fmt: skip
        copies += [pltpu.make_async_copy(scale_hbm.at[0, kv, 0, 0], buf.at[slot, p], sems.at[2, slot])
                   for kv, buf in (((0, k_scale_buf), (1, v_scale_buf)) if kv_kind else ())]  # fmt: skip
        return copies

    cur = tile_info(tile, head)
    # The program after this one (the grid runs in order, heads innermost) and whether it reads any page.
    last_head = head == num_heads - 1
    next_tile = jnp.where(last_head, tile + 1, tile)
    nxt = tile_info(jnp.minimum(next_tile, num_tiles - 1), jnp.where(last_head, 0, head + 1))
    pipe = PagePipeline(
        cur, nxt, (next_tile < num_tiles) & (nxt.num_groups > 0), (tile == 0) & (head == 0), tables_hbm=tables_hbm,
        table_buf=table_buf, table_sems=table_sems, state_ref=state_ref, width=width, pages_per_iter=pages_per_iter,
        num_blocks=num_blocks, page_copies=page_copies, page_waits=page_waits,
    )  # fmt: skip

    # This step's keys the tile reads: aligned chunks from the first one the window reaches to its last row.
    first_chunk = div(jnp.maximum(cur.q_start, cur.lowest - cur.cached + cur.q_start), new_per_iter)
    last_new = cur.t0 + cur.n_tok if tile_end_ref is None else jnp.maximum(cur.t0 + cur.n_tok, tile_end_ref[tile])
    num_chunks = jnp.where(cur.n_tok > 0, div(last_new - 1, new_per_iter) - first_chunk + 1, 0)

    def chunk_copies(chunk, slot):
        return [
            (True, pltpu.make_async_copy(src.at[head, first_chunk + chunk], buf.at[slot], sems.at[1, slot]))
            for src, buf in ((k_new_hbm, k_new_buf), (v_new_hbm, v_new_buf))
        ]

    pipe.start_first()
    pl.when(num_chunks > 0)(lambda: start(chunk_copies(0, 0)))  # arrives while the context is folded
    softmax_init(acc_ref, peak_ref, denom_ref, sink_ref if use_sinks else None)

    def fold(k, v, key_pos, extra_mask, k_scale=None, v_scale=None):
        """k_scale, v_scale [1, keys]: a quantized page's per-key scales, applied to the scores' columns
        (q . k s = (q . k) s) and to p's (p . v s = (p s) . v) rather than to the page's head_dim-wide rows."""
        q = q_ref[...]
        row_pos = cur.pos0 + div(jax.lax.broadcasted_iota(jnp.int32, (rows, k.shape[0]), 0), group_pad)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
        s = s * scale if k_scale is None else s * (k_scale * scale)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        if use_alibi:  # slope_ref: [rows, 1], each row's query head's slope
            s = s + slope_ref[...] * (key_pos - row_pos).astype(jnp.float32)
        row_end = row_pos if row_end_ref is None else jnp.maximum(row_pos, row_end_ref[...])  # image spans: past itself
        mask = (key_pos <= row_end) & extra_mask
        if is_local(spec):  # a sliding window or a chunk
            mask &= key_pos >= first_visible(row_pos, spec)
        s = jnp.where(mask, s, MASK_VALUE)
        softmax_fold(acc_ref, peak_ref, denom_ref, s, mask, v, precision=precision, p_scale=v_scale)

    def fold_group(group, slot):
        for p in range(pages_per_iter):
            i = group * pages_per_iter + p

            @pl.when(i < cur.num_pages)
            def _():
                key_pos = (cur.first_page + i) * block_size + jax.lax.broadcasted_iota(jnp.int32, (rows, block_size), 1)
                if kv_kind:
                    k, v = (decode_kv(buf[slot, p], kv_kind, q_ref.dtype) for buf in (k_buf, v_buf))
                    fold(k, v, key_pos, key_pos < cur.cached, k_scale_buf[slot, p], v_scale_buf[slot, p])
                else:
                    fold(k_buf[slot, p], v_buf[slot, p], key_pos, key_pos < cur.cached)

    pipe.fold_groups(fold_group)

    def new_keys(chunk, carry):
        slot = jax.lax.rem(chunk, 2)
        pl.when(chunk + 1 < num_chunks)(lambda: start(chunk_copies(chunk + 1, 1 - slot)))
        wait(chunk_copies(chunk, slot))
        flat = (first_chunk + chunk) * new_per_iter + jax.lax.broadcasted_iota(jnp.int32, (rows, new_per_iter), 1)
        fold(k_new_buf[slot], v_new_buf[slot], cur.cached + flat - cur.q_start, flat >= cur.q_start)
        return carry

    jax.lax.fori_loop(0, num_chunks, new_keys, 0)

    denom = denom_ref[...]
    o_ref[...] = (acc_ref[...] / jnp.where(denom == 0.0, 1.0, denom)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("spec", "interpret", "table_chunk"))
def tpu_paged_attention(q, k, v, kv_cache, layer, attn_metadata: AttentionMetadata, spec: AttentionSpec, alibi_slopes=None,
                        sinks=None, *, interpret: bool | pltpu.InterpretParams = False,
                        table_chunk: int = TABLE_CHUNK) -> jax.Array:  # fmt: skip
    """reference_paged_attention's contract: q [T, H, D], this step's k/v [T, H_kv, D] -> [T, H, D].

    kv_cache: the float cache or a QuantizedKV. `layer` (a Python int or an int32 scalar) is traced: every layer
    runs the same compiled kernel.
    `interpret`: True for Pallas' generic interpreter, or pltpu.InterpretParams for TPU interpret mode
    (which simulates the DMAs and semaphores and can detect races). `table_chunk`: block-table entries per
    DMA into SMEM (rounded down to a multiple of the pages per iteration; a narrower table is fetched whole)."""
    num_tokens, num_heads, head_dim = q.shape
    kv_cache, kv_scale, kv_kind = kv_operands(kv_cache)
    num_layers, _, num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    check_head_dim(head_dim)
    shape = tile_shape(num_heads, num_kv_heads, block_size, ROWS, KV_TOKENS_PER_ITER)
    group, group_pad, tokens_per_tile = shape.group, shape.group_pad, shape.tokens_per_tile
    rows, pages_per_iter = shape.rows, shape.pages_per_iter

    seq, start, length = query_tiles(attn_metadata.query_start_loc, num_tokens, tokens_per_tile)
    num_tiles = seq.shape[0]
    width = attn_metadata.block_tables.shape[1]
    # The block tables stay in HBM, [S, W] (a rank-1 operand in HBM would need a TPU to lower); programs DMA
    # slices of their rows.
    tables = attn_metadata.block_tables
    table_chunk = max(pages_per_iter, table_chunk // pages_per_iter * pages_per_iter)
    table_chunk = min(width, table_chunk)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)

    # Tile-major queries: [tiles, H_kv, tokens_per_tile * G', D].
    token = jnp.minimum(start[:, None] + jnp.arange(tokens_per_tile, dtype=jnp.int32)[None, :], num_tokens - 1)
    qg = jnp.pad(q.reshape(num_tokens, num_kv_heads, group, head_dim), ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    q_tiles = qg[token].transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, rows, head_dim)
    # This step's K/V in aligned chunks, [H_kv, chunks, NEW_KEYS_PER_ITER, D]: a chunk is one DMA.
    num_chunks = -(-num_tokens // NEW_KEYS_PER_ITER)
    pad_new = num_chunks * NEW_KEYS_PER_ITER - num_tokens
    kn, vn = (
        jnp.pad(x, ((0, pad_new), (0, 0), (0, 0))).reshape(num_chunks, NEW_KEYS_PER_ITER, num_kv_heads, head_dim)
        .transpose(2, 0, 1, 3)
        for x in (k, v)
    )  # fmt: skip
    # Each query row's ALiBi slope, [H_kv, rows, 1]: row r of a tile is head r % G' of its group.
    use_alibi = alibi_slopes is not None
    slopes = jnp.zeros((num_heads,), jnp.float32) if alibi_slopes is None else alibi_slopes.astype(jnp.float32)
    slopes = jnp.pad(slopes.reshape(num_kv_heads, group), ((0, 0), (0, group_pad - group)))
    slopes = jnp.tile(slopes, (1, tokens_per_tile))[..., None]
    use_sinks = sinks is not None  # each query row's sink logit, laid out as the slopes
    sink_rows = jnp.zeros((num_heads,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    sink_rows = jnp.pad(sink_rows.reshape(num_kv_heads, group), ((0, 0), (0, group_pad - group)))
    sink_rows = jnp.tile(sink_rows, (1, tokens_per_tile))[..., None]

    # image spans (Gemma 3): each query row's last visible position, tile-major [tiles, rows, 1], and each tile's
    # last visible new key (flat, exclusive) among its live rows
    bidirectional = attn_metadata.key_ends is not None
    end_prefetch, end_operands, end_specs = [], [], []
    if bidirectional:
        qsl = attn_metadata.query_start_loc
        live = jnp.arange(tokens_per_tile, dtype=jnp.int32)[None, :] < length[:, None]
        ends = jnp.where(live, attn_metadata.key_ends.astype(jnp.int32)[token], -1)  # [tiles, tokens]
        cached = attn_metadata.seq_lens[seq] - (qsl[seq + 1] - qsl[seq])
        end_prefetch = [qsl[seq] + jnp.max(ends, axis=1) - cached + 1]
        end_operands = [jnp.repeat(ends, group_pad, axis=1)[..., None]]
        end_specs = [pl.BlockSpec((None, rows, 1), lambda i, h, *_: (i, 0, 0))]
    tile_spec = pl.BlockSpec((None, None, rows, head_dim), lambda i, h, *_: (i, h, 0, 0))
    slope_spec = pl.BlockSpec((None, rows, 1), lambda i, h, *_: (h, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(
        _kernel, group_pad=group_pad, width=width, spec=spec, use_alibi=use_alibi, kv_kind=kv_kind, bidirectional=bidirectional,
        use_sinks=use_sinks,
        precision=jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
    )  # fmt: skip
    scale_operands, scale_specs, scale_scratch = [], [], []
    if kv_kind:  # the scales in HBM as [L, 2, blocks, H_kv, 1, block_size] (a free reshape): a page's is a (1, bs) DMA
        scale_operands = [kv_scale.reshape(num_layers, 2, num_blocks, num_kv_heads, 1, block_size)]
        scale_specs = [hbm]
        scale_scratch = [pltpu.VMEM((2, pages_per_iter, 1, block_size), jnp.float32)] * 2
    out_tiles = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6 + len(end_prefetch),
            grid=(num_tiles, num_kv_heads),
            in_specs=[tile_spec, slope_spec, slope_spec, hbm, hbm, hbm, hbm, *scale_specs, *end_specs],
            out_specs=tile_spec,
            scratch_shapes=[
                pltpu.VMEM((2, pages_per_iter, block_size, head_dim), kv_cache.dtype),
                pltpu.VMEM((2, pages_per_iter, block_size, head_dim), kv_cache.dtype),
                pltpu.VMEM((2, NEW_KEYS_PER_ITER, head_dim), kn.dtype),
                pltpu.VMEM((2, NEW_KEYS_PER_ITER, head_dim), vn.dtype),
                pltpu.SemaphoreType.DMA((3 if kv_kind else 2, 2)),  # [context pages | new keys | scales, slot]
                pltpu.SMEM((2, table_chunk), jnp.int32),  # block-table chunks, double-buffered
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((rows, head_dim), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.SMEM((3,), jnp.int32),  # carried from program to program (tpu_pipeline.PagePipeline)
                *scale_scratch,
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((num_tiles, num_kv_heads, rows, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret,
        name=f"ragged_paged_attention_tpu_r{rows}_kv{pages_per_iter * block_size}" + (f"_{kv_kind}" if kv_kind else ""),
    )(
        layer, seq, start, length, attn_metadata.query_start_loc, attn_metadata.seq_lens, *end_prefetch,
        q_tiles, slopes, sink_rows, tables, kv_cache, kn, vn, *scale_operands, *end_operands,
    )  # fmt: skip

    # Back to token order.
    tile_of, row, valid = token_tiles(attn_metadata.query_start_loc, num_tokens, tokens_per_tile, num_tiles)
    out = out_tiles.reshape(num_tiles, num_kv_heads, tokens_per_tile, group_pad, head_dim)
    out = out[tile_of, :, row, :group]  # [T, H_kv, G, D]
    out = jnp.where(valid[:, None, None, None], out, 0)
    return out.reshape(num_tokens, num_heads, head_dim)

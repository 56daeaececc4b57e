"""Ragged paged attention for TPUs, in Pallas' Mosaic TPU dialect.

Same work split as the GPU kernel (one program per query tile and KV head, each KV block
loaded once for the whole head group, online softmax in float32), written the TPU way: the
tile list and block tables are scalar-prefetched into SMEM, and the innermost grid axis walks
KV blocks through BlockSpecs whose index maps read the block table, so Pallas' pipeline DMAs
block j+1 while block j is computed. Steps past a sequence's last block repeat the previous
block index, which Pallas does not fetch again, and skip their compute.

The axis first walks the cached context (pages_per_iter blocks per step), then this step's
own K/V in aligned tiles of NEW_KEYS_PER_ITER rows (rows of other sequences are masked).
Queries and outputs are laid out tile-major by the wrapper (a cheap gather of q-sized
arrays) because a BlockSpec cannot start at a ragged row.

Checked on CPU with Pallas' generic interpreter and by exporting for "tpu"; no TPU was at hand
to run it compiled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxpaged.pallas_kernels.metadata import AttentionMetadata, AttentionSpec
from jaxpaged.pallas_kernels.tiles import MASK_VALUE, check_head_dim, query_tiles, tile_shape

ROWS = 16  # query rows per program: tokens x padded group
KV_TOKENS_PER_ITER = 64
NEW_KEYS_PER_ITER = 32


def _div(a, b: int):
    """a // b for a >= 0. Mosaic lowers floor division through sign(), which needs a TPU to lower."""
    return jax.lax.div(a, jnp.int32(b))


def _kernel(
    tile_seq_ref, tile_start_ref, tile_len_ref, query_start_ref, seq_lens_ref, tables_ref,  # scalar prefetch (SMEM)
    q_ref, *refs,
    group_pad, pages_per_iter, cached_steps, spec, use_alibi, precision,
):  # fmt: skip
    scale, sliding_window, soft_cap = spec.scale, spec.sliding_window, spec.soft_cap
    k_pages, v_pages = refs[:pages_per_iter], refs[pages_per_iter : 2 * pages_per_iter]
    k_new_ref, v_new_ref, slope_ref, o_ref, acc_ref, peak_ref, denom_ref = refs[2 * pages_per_iter :]
    tile, step = pl.program_id(0), pl.program_id(2)
    rows = q_ref.shape[0]
    block_size = k_pages[0].shape[0]
    new_per_iter = k_new_ref.shape[0]

    @pl.when(step == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        peak_ref[...] = jnp.full_like(peak_ref, MASK_VALUE)
        denom_ref[...] = jnp.zeros_like(denom_ref)

    n_tok = tile_len_ref[tile]
    seq, t0 = tile_seq_ref[tile], tile_start_ref[tile]
    q_start, q_end = query_start_ref[seq], query_start_ref[seq + 1]
    cached = seq_lens_ref[seq] - (q_end - q_start)
    pos0 = cached + t0 - q_start
    lowest = 0 if sliding_window is None else jnp.maximum(0, pos0 - sliding_window + 1)

    def fold(k, v, key_pos, extra_mask=None):
        q = q_ref[...]
        row_pos = pos0 + _div(jax.lax.broadcasted_iota(jnp.int32, (rows, k.shape[0]), 0), group_pad)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
        s = s * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        if use_alibi:  # slope_ref: [rows, 1], each row's query head's slope
            s = s + slope_ref[...] * (key_pos - row_pos).astype(jnp.float32)
        mask = key_pos <= row_pos
        if sliding_window is not None:
            mask &= key_pos > row_pos - sliding_window
        if extra_mask is not None:
            mask &= extra_mask
        s = jnp.where(mask, s, MASK_VALUE)
        peak = peak_ref[...]
        new_peak = jnp.maximum(peak, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - new_peak), 0.0)
        correction = jnp.exp(peak - new_peak)
        pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        acc_ref[...] = acc_ref[...] * correction + pv
        denom_ref[...] = denom_ref[...] * correction + jnp.sum(p, axis=1, keepdims=True)
        peak_ref[...] = new_peak

    kv_tokens = pages_per_iter * block_size
    live = n_tok > 0

    @pl.when(live & (step < cached_steps) & (step * kv_tokens < cached) & ((step + 1) * kv_tokens > lowest))
    def _():
        for p in range(pages_per_iter):
            first = (step * pages_per_iter + p) * block_size
            key_pos = first + jax.lax.broadcasted_iota(jnp.int32, (rows, block_size), 1)
            fold(k_pages[p][...], v_pages[p][...], key_pos, key_pos < cached)

    new_block = _div(q_start, new_per_iter) + step - cached_steps  # the window, if any, is left to the mask

    @pl.when(live & (step >= cached_steps) & (new_block * new_per_iter < t0 + n_tok))
    def _():
        flat = new_block * new_per_iter + jax.lax.broadcasted_iota(jnp.int32, (rows, new_per_iter), 1)
        fold(k_new_ref[...], v_new_ref[...], cached + flat - q_start, flat >= q_start)

    @pl.when(step == pl.num_programs(2) - 1)
    def _():
        denom = denom_ref[...]
        o_ref[...] = (acc_ref[...] / jnp.where(denom == 0.0, 1.0, denom)).astype(o_ref.dtype)


def _index_maps(layer, pages_per_iter, cached_steps, width, block_size, new_per_iter, num_blocks):
    """BlockSpec index maps; each clamps to the last block its program needs so idle steps fetch nothing."""

    def tile_info(tile, tile_seq, tile_start, tile_len, query_start_loc, seq_lens):
        seq = tile_seq[tile]
        q_start, q_end = query_start_loc[seq], query_start_loc[seq + 1]
        return seq, q_start, seq_lens[seq] - (q_end - q_start), tile_start[tile] + tile_len[tile]

    def page(kv, p):
        def index(tile, h, step, tile_seq, tile_start, tile_len, query_start_loc, seq_lens, tables):
            seq, _, cached, _ = tile_info(tile, tile_seq, tile_start, tile_len, query_start_loc, seq_lens)
            last = jnp.maximum(_div(cached + pages_per_iter * block_size - 1, pages_per_iter * block_size) - 1, 0)
            col = jnp.minimum(jnp.minimum(step, cached_steps - 1), last) * pages_per_iter + p
            block = jnp.clip(tables[seq * width + col], 0, num_blocks - 1)
            return layer, kv, block, h, 0, 0

        return index

    def new_keys(tile, h, step, tile_seq, tile_start, tile_len, query_start_loc, seq_lens, tables):
        _, q_start, _, end = tile_info(tile, tile_seq, tile_start, tile_len, query_start_loc, seq_lens)
        first, last = _div(q_start, new_per_iter), _div(jnp.maximum(end - 1, 0), new_per_iter)
        return h, jnp.clip(first + step - cached_steps, first, last), 0

    return page, new_keys


@functools.partial(jax.jit, static_argnames=("layer", "spec", "interpret"))
def tpu_paged_attention(q, k, v, kv_cache, layer: int, attn_metadata: AttentionMetadata, spec: AttentionSpec, alibi_slopes=None,
                        *, interpret: bool = False) -> jax.Array:  # fmt: skip
    """reference_paged_attention's contract: q [T, H, D], this step's k/v [T, H_kv, D] -> [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    check_head_dim(head_dim)
    shape = tile_shape(num_heads, num_kv_heads, block_size, ROWS, KV_TOKENS_PER_ITER)
    group, group_pad, tokens_per_tile = shape.group, shape.group_pad, shape.tokens_per_tile
    rows, pages_per_iter = shape.rows, shape.pages_per_iter

    seq, start, length = query_tiles(attn_metadata.query_start_loc, num_tokens, tokens_per_tile)
    num_tiles = seq.shape[0]
    width = attn_metadata.block_tables.shape[1] + (-attn_metadata.block_tables.shape[1] % pages_per_iter)
    tables = jnp.pad(attn_metadata.block_tables, ((0, 0), (0, width - attn_metadata.block_tables.shape[1]))).reshape(-1)
    cached_steps = width // pages_per_iter
    new_steps = -(-num_tokens // NEW_KEYS_PER_ITER) + 1  # aligned tiles a ragged run of <= T keys can touch

    # Tile-major queries: [tiles, H_kv, tokens_per_tile * G', D].
    token = jnp.minimum(start[:, None] + jnp.arange(tokens_per_tile, dtype=jnp.int32)[None, :], num_tokens - 1)
    qg = jnp.pad(q.reshape(num_tokens, num_kv_heads, group, head_dim), ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    q_tiles = qg[token].transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, rows, head_dim)
    pad_new = -(-num_tokens // NEW_KEYS_PER_ITER) * NEW_KEYS_PER_ITER - num_tokens
    kn, vn = (jnp.pad(x, ((0, pad_new), (0, 0), (0, 0))).transpose(1, 0, 2) for x in (k, v))
    # Each query row's ALiBi slope, [H_kv, rows, 1]: row r of a tile is head r % G' of its group.
    use_alibi = alibi_slopes is not None
    slopes = jnp.zeros((num_heads,), jnp.float32) if alibi_slopes is None else alibi_slopes.astype(jnp.float32)
    slopes = jnp.pad(slopes.reshape(num_kv_heads, group), ((0, 0), (0, group_pad - group)))
    slopes = jnp.tile(slopes, (1, tokens_per_tile))[..., None]

    page, new_keys = _index_maps(
        layer, pages_per_iter, cached_steps, width, block_size, NEW_KEYS_PER_ITER, num_blocks
    )
    page_spec = lambda kv, p: pl.BlockSpec((None, None, None, None, block_size, head_dim), page(kv, p))
    tile_spec = pl.BlockSpec((None, None, rows, head_dim), lambda i, h, j, *_: (i, h, 0, 0))
    new_spec = pl.BlockSpec((None, NEW_KEYS_PER_ITER, head_dim), new_keys)
    slope_spec = pl.BlockSpec((None, rows, 1), lambda i, h, j, *_: (h, 0, 0))
    kernel = functools.partial(
        _kernel, group_pad=group_pad, pages_per_iter=pages_per_iter, cached_steps=cached_steps,
        spec=spec, use_alibi=use_alibi,
        precision=jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
    )  # fmt: skip
    out_tiles = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(num_tiles, num_kv_heads, cached_steps + new_steps),
            in_specs=[tile_spec]
            + [page_spec(0, p) for p in range(pages_per_iter)]
            + [page_spec(1, p) for p in range(pages_per_iter)]
            + [new_spec, new_spec, slope_spec],
            out_specs=tile_spec,
            scratch_shapes=[
                pltpu.VMEM((rows, head_dim), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((num_tiles, num_kv_heads, rows, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name=f"ragged_paged_attention_tpu_r{rows}_kv{pages_per_iter * block_size}",
    )(
        seq, start, length, attn_metadata.query_start_loc, attn_metadata.seq_lens, tables,
        q_tiles, *([kv_cache] * (2 * pages_per_iter)), kn, vn, slopes,
    )  # fmt: skip

    # Back to token order: token t of sequence s sits in tile first_tile[s] + (t - q_start) // tokens_per_tile.
    rows_idx = jnp.arange(num_tokens, dtype=jnp.int32)
    query_start_loc = attn_metadata.query_start_loc
    tok_seq = jnp.minimum(jnp.searchsorted(query_start_loc[1:], rows_idx, side="right"), query_start_loc.shape[0] - 2)
    valid = rows_idx < query_start_loc[-1]
    per_seq = (query_start_loc[1:] - query_start_loc[:-1] + tokens_per_tile - 1) // tokens_per_tile
    first_tile = jnp.cumsum(per_seq) - per_seq
    offset = rows_idx - query_start_loc[tok_seq]
    tile_of = jnp.clip(first_tile[tok_seq] + offset // tokens_per_tile, 0, num_tiles - 1)
    out = out_tiles.reshape(num_tiles, num_kv_heads, tokens_per_tile, group_pad, head_dim)
    out = out[tile_of, :, offset % tokens_per_tile, :group]  # [T, H_kv, G, D]
    out = jnp.where(valid[:, None, None, None], out, 0)
    return out.reshape(num_tokens, num_heads, head_dim)

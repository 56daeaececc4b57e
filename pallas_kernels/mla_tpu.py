"""The absorbed half of MLA (pallas_kernels/mla.py) as a TPU kernel, in Pallas' Mosaic TPU dialect (interpreted on CPU).

The TPU counterpart of mla_gpu.py: the same contract (absorbed queries [q_nope W_UK^T, q_pe] over each row's cached
latent rows -> the partial softmax (peak, denominator, latent sum) that mla_reference merges with this step's own keys),
and the same work split as tpu_attention.py. One program per query tile: up to `tokens_per_tile` tokens of one
sequence, each with all its H heads (MQA with one KV head: every head scores the same latent rows, as FlashMLA),
so a tile's rows are tokens x heads (heads padded to a multiple of 16). Every token of a sequence sees the same cached
context (this step's own keys are the expanded part, in JAX), so the mask is one per tile: key position < cached.
The cache and the block tables stay in HBM; each program DMAs only its sequence's live pages (0 .. ceil(cached / bs)
- 1) into VMEM, double-buffered, starting the next program's first pages before it finishes, and walks its table row
in SMEM chunks of TABLE_CHUNK entries, double-buffered: tpu_pipeline.py's pipeline, shared with tpu_attention.py.
The layer is a scalar operand: a model's layers share one compiled kernel.

Lanes. The cache row [c, k_pe] lies in the KV array as a K plane and a V plane of (R + P) / 2 values each (288 for
DeepSeek-V3's 512 + 64), not a multiple of 128 lanes, and its layout is the engine's (blocks, tables, writes), so the
kernel pads in VMEM instead: a group of pages lands in a [keys, 2 x half_pad] buffer (half_pad: the half-row rounded up
to 128; 288 -> 384, so 768 lanes), the K plane DMA'd into lanes [0, half) and the V plane into [half_pad, half_pad +
half); the query is laid out the same way by the wrapper (zeros in the pad lanes), and the latent sum comes back in it
(the wrapper drops the pad lanes). The pad lanes, the rows of pages past the sequence's last and the positions past
its context are never written by a DMA and may hold anything (TPU interpret mode fills fresh VMEM with NaN): one select
zeroes them on the loaded [keys, lanes] tile before both matmuls, so the scores are [rows, keys] and the sum [rows,
lanes] with keys a multiple of 128 (128 keys per iteration: 128 / bs pages) and rows a multiple of 16. Block sizes
of 16 to 256 tokens (a page's DMA fills whole sublane tiles); smaller ones, and 8-bit caches, run the pure-JAX path.

Checked on CPU in interpret mode (TPU interpret mode counts the DMAs and looks for races) and by exporting for "tpu";
no TPU was at hand to compile or run it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxpaged.pallas_kernels.kv_quant import QuantizedKV
from jaxpaged.pallas_kernels.metadata import AttentionMetadata
from jaxpaged.pallas_kernels.tiles import MASK_VALUE, query_tiles, token_tiles
from jaxpaged.pallas_kernels.tpu_pipeline import PagePipeline, div, softmax_fold, softmax_init

ROWS = 64  # query rows per program (tokens x padded heads); one token when the heads fill it (DeepSeek-V3: 128)
HEAD_ROWS = 16  # heads padded to a multiple of this: a bfloat16 sublane tile
LANES = 128
KV_TOKENS_PER_ITER = 128  # keys per iteration: the scores' lane width
TABLE_CHUNK = 128  # block-table entries per DMA into SMEM
MIN_BLOCK_SIZE = 16


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def takes(kv_cache) -> bool:
    """Whether the kernel takes this latent cache: a float one (not 8-bit) with blocks of 16 to 256 tokens (a power of
    two). Under tensor parallelism the cache holds a copy per device, and each device's (one KV head) is the kernel's."""
    if isinstance(kv_cache, QuantizedKV):
        return False
    block_size = kv_cache.shape[4]
    return MIN_BLOCK_SIZE <= block_size <= 256 and not block_size & (block_size - 1)


class _Tile(NamedTuple):
    seq: jax.Array
    first_page: int  # 0: it reads its sequence's cached pages 0 .. num_pages - 1
    num_pages: jax.Array
    num_groups: jax.Array  # ... in groups of pages_per_iter


def _kernel(layer_ref, tile_seq_ref, tile_len_ref, query_start_ref, seq_lens_ref,  # SMEM (scalar prefetch)
            q_ref, tables_hbm, cache_hbm,  # q: this tile's [rows, lanes]; tables and cache in HBM
            acc_out, stats_out,  # [rows, lanes] latent sum, [rows, LANES] (lane 0 the peak, lane 1 the denominator)
            lat_buf, sems, table_buf, table_sems, acc_ref, peak_ref, denom_ref, state_ref,  # scratch
            *, half, half_pad, width, scale, precision):  # fmt: skip
    tile, num_tiles = pl.program_id(0), pl.num_programs(0)
    rows, lanes = q_ref.shape
    _, keys, _ = lat_buf.shape
    block_size, num_blocks = cache_hbm.shape[4], cache_hbm.shape[2]
    pages_per_iter = keys // block_size
    layer = jnp.clip(layer_ref[0], 0, cache_hbm.shape[0] - 1)

    def cached_of(seq):
        return seq_lens_ref[seq] - (query_start_ref[seq + 1] - query_start_ref[seq])

    def tile_info(i) -> _Tile:
        seq = tile_seq_ref[i]
        cached = cached_of(seq)
        num_pages = jnp.where((tile_len_ref[i] > 0) & (cached > 0), div(cached + block_size - 1, block_size), 0)
        return _Tile(seq, 0, num_pages, div(num_pages + pages_per_iter - 1, pages_per_iter))

    def page_dst(slot, p, plane):
        return lat_buf.at[slot, pl.ds(p * block_size, block_size), pl.ds(plane * half_pad, half)]

    def page_copies(t: _Tile, slot, p, block):
        """The K and V planes of one page into their lanes of position p of buffer `slot`."""
        return [pltpu.make_async_copy(cache_hbm.at[layer, plane, block, 0], page_dst(slot, p, plane), sems.at[slot])
                for plane in (0, 1)]  # fmt: skip

    def page_waits(slot, p):
        return [pltpu.make_async_copy(cache_hbm.at[0, plane, 0, 0], page_dst(slot, p, plane), sems.at[slot])
                for plane in (0, 1)]  # fmt: skip

    cur = tile_info(tile)
    cached = cached_of(cur.seq)
    nxt = tile_info(jnp.minimum(tile + 1, num_tiles - 1))
    pipe = PagePipeline(
        cur, nxt, (tile + 1 < num_tiles) & (nxt.num_groups > 0), tile == 0, tables_hbm=tables_hbm, table_buf=table_buf,
        table_sems=table_sems, state_ref=state_ref, width=width, pages_per_iter=pages_per_iter, num_blocks=num_blocks,
        page_copies=page_copies, page_waits=page_waits,
    )  # fmt: skip
    pipe.start_first()

    softmax_init(acc_ref, peak_ref, denom_ref)
    q = q_ref[...]
    row_of = jax.lax.broadcasted_iota(jnp.int32, (keys, lanes), 0)
    lane = jax.lax.broadcasted_iota(jnp.int32, (keys, lanes), 1)
    data_lane = (lane < half) | ((lane >= half_pad) & (lane < half_pad + half))

    def fold_group(group, slot):
        """The group in buffer `slot`, its first `live` keys in the context: one select keeps the DMA'd values only."""
        live = cached - group * keys
        x = jnp.where(data_lane & (row_of < live), lat_buf[slot], 0).astype(q.dtype)
        s = jax.lax.dot_general(q, x, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
        mask = jax.lax.broadcasted_iota(jnp.int32, (rows, keys), 1) < live
        s = jnp.where(mask, s * scale, MASK_VALUE)
        softmax_fold(acc_ref, peak_ref, denom_ref, s, mask, x, precision=precision)

    pipe.fold_groups(fold_group)

    acc_out[...] = acc_ref[...]
    stat_lane = jax.lax.broadcasted_iota(jnp.int32, (rows, LANES), 1)
    stats_out[...] = jnp.where(stat_lane == 0, peak_ref[...], jnp.where(stat_lane == 1, denom_ref[...], 0.0))


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "table_chunk"))
def tpu_mla_cached(q_abs, kv_cache, layer, attn_metadata: AttentionMetadata, scale: float, *,
                   interpret: bool | pltpu.InterpretParams = False,
                   table_chunk: int = TABLE_CHUNK) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """mla_gpu.gpu_mla_cached's contract: q_abs [T, H, R + P] (W_UK folded into q_nope, then q_pe) over each row's
    cached latent rows -> (peak [T, 1, H], denom [T, 1, H], latent sum [T, 1, H, R + P]); rows with nothing cached:
    peak -inf, zeros. kv_cache: [L, 2, blocks, 1, bs, (R + P) / 2] (takes() says which); `layer` may be traced.
    `interpret`: True for Pallas' generic interpreter, or pltpu.InterpretParams for TPU interpret mode."""
    num_tokens, num_heads, width = q_abs.shape
    if not takes(kv_cache):
        raise ValueError(f"the MLA TPU kernel takes a float latent cache with blocks of {MIN_BLOCK_SIZE} to 256 tokens")
    if kv_cache.dtype == jnp.uint16:  # a CPU cache of 16-bit floats holds their bits (interpret mode only)
        kv_cache = jax.lax.bitcast_convert_type(kv_cache, q_abs.dtype)
    _, _, _, num_kv_heads, block_size, half = kv_cache.shape
    assert width == 2 * half and num_kv_heads == 1, (width, kv_cache.shape)
    half_pad = _round_up(half, LANES)
    lanes = 2 * half_pad
    heads = _round_up(num_heads, HEAD_ROWS)
    tokens_per_tile = max(1, ROWS // heads)
    rows = tokens_per_tile * heads
    keys = max(KV_TOKENS_PER_ITER, block_size)
    table_width = attn_metadata.block_tables.shape[1]
    pages_per_iter = keys // block_size
    table_chunk = min(table_width, max(pages_per_iter, table_chunk // pages_per_iter * pages_per_iter))

    qsl = attn_metadata.query_start_loc
    seq, start, length = query_tiles(qsl, num_tokens, tokens_per_tile)
    num_tiles = seq.shape[0]
    # the query in the buffer's lanes: [K plane's half, 0 pad, V plane's half, 0 pad], heads padded; tile-major
    q = jnp.pad(q_abs.reshape(num_tokens, num_heads, 2, half), ((0, 0), (0, heads - num_heads), (0, 0), (0, half_pad - half)))
    token = jnp.minimum(start[:, None] + jnp.arange(tokens_per_tile, dtype=jnp.int32)[None, :], num_tokens - 1)
    q_tiles = q.reshape(num_tokens, heads, lanes)[token].reshape(num_tiles, rows, lanes)

    tile_spec = lambda width_: pl.BlockSpec((None, rows, width_), lambda i, *_: (i, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, half=half, half_pad=half_pad, width=table_width, scale=scale,
                               precision=jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)  # fmt: skip
    acc_tiles, stats = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_tiles,),
            in_specs=[tile_spec(lanes), hbm, hbm],
            out_specs=[tile_spec(lanes), tile_spec(LANES)],
            scratch_shapes=[
                pltpu.VMEM((2, keys, lanes), kv_cache.dtype),  # a group's pages, double-buffered, lanes padded
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((2, table_chunk), jnp.int32),  # block-table chunks, double-buffered
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((rows, lanes), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.SMEM((3,), jnp.int32),  # carried from program to program (tpu_pipeline.PagePipeline)
            ],
        ),
        out_shape=[jax.ShapeDtypeStruct((num_tiles, rows, width_), jnp.float32) for width_ in (lanes, LANES)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name=f"mla_absorbed_tpu_r{rows}_l{lanes}_kv{keys}",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1), seq, length, qsl, attn_metadata.seq_lens,
        q_tiles, attn_metadata.block_tables, kv_cache,
    )  # fmt: skip

    # Back to token order.
    tile_of, row, valid = token_tiles(qsl, num_tokens, tokens_per_tile, num_tiles)
    acc = acc_tiles.reshape(num_tiles, tokens_per_tile, heads, 2, half_pad)[tile_of, row, :num_heads]
    acc = acc[..., :half].reshape(num_tokens, num_heads, width)
    stats = stats.reshape(num_tiles, tokens_per_tile, heads, LANES)[tile_of, row, :num_heads]
    denom = jnp.where(valid[:, None], stats[..., 1], 0.0)
    peak = jnp.where(denom > 0, stats[..., 0], -jnp.inf)
    acc = jnp.where(valid[:, None, None], acc, 0.0)
    return peak[:, None], denom[:, None], acc[:, None]

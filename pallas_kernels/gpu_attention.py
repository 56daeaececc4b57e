"""Ragged paged attention for GPUs, in Pallas' Triton dialect (also run in interpret mode on CPU).

One program per (query tile, KV head, KV split). A program holds a tile's query rows for all the
query heads that share its KV head (tokens x padded group), streams its share of the sequence's
cached K/V, gathered token by token through the block table (so a chunk may span blocks or part of
one), then this step's own K/V (not in the cache yet: the runner writes it after the forward pass),
with an online softmax in float32. Each K/V chunk is loaded once and serves every query head of its
group.

Decode buckets split each sequence's context over several programs when batch x KV heads would leave
most of the GPU's cores idle (one long request has only its KV heads' worth of programs); each split
returns its unnormalised sum, running max and denominator, and a combine step merges them, as
FlashDecoding does. Prefill buckets take bigger tiles (up to 128 query rows, more warps and pipeline
stages) as far as the device's shared memory allows. The layer is a runtime operand (an offset into
the cache), so every layer of a model runs the same compiled kernel.

Triton rather than Mosaic GPU: it runs on every NVIDIA GPU JAX supports (Colab's T4, L4 and A100
included; Mosaic GPU needs Hopper), exports for "cuda" without one, and runs interpreted on CPU.

An int8 or fp8 cache (a QuantizedKV) is read in 8 bits, with its per-token scales as one more operand: a
chunk is decoded to the queries' dtype (exactly) and its scales multiply the scores' and probabilities'
columns, so its reads are about half of bfloat16's and the dots stay in the float path's dtype.

The wrapper pads the token axis by one tile and the block table to whole chunks, and clamps block
ids into the pool, so the kernel never reads out of bounds; rows no tile covers (padding) are zero.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
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
)

MIN_ROWS = 16  # tl.dot's smallest M, N and K
MAX_SPLITS = 16
DEFAULT_SHARED_MEMORY = 99 * 1024  # sm_86/89/120 (A10, L4, RTX); A100 has 163 KiB, H100 227 KiB, T4 64 KiB
SHARED_MEMORY_MARGIN = 0.85  # the estimate leaves Triton's own buffers (layout conversions, barriers) this much room


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How one bucket's kernel is cut: query rows and keys per program step, Triton's warps and stages, KV splits."""

    rows: int  # query rows per program (tokens x padded group), at least MIN_ROWS
    kv_chunk: int  # keys per inner iteration, cached or new
    num_warps: int
    num_stages: int
    num_splits: int = 1


# Preferred first; the first that fits the device's shared memory is taken.
PREFILL_CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2),
                   (32, 32, 4, 2), (16, 32, 4, 2), (16, 16, 4, 1)]  # fmt: skip
DECODE_CONFIGS = [(16, 128, 4, 3), (16, 64, 4, 3), (16, 64, 4, 2), (16, 32, 4, 2), (16, 16, 4, 1)]


def shared_memory_estimate(rows: int, kv_chunk: int, head_dim: int, itemsize: int, num_stages: int,
                           kv_itemsize: int | None = None) -> int:  # fmt: skip
    """Bytes of shared memory a program needs: K and V chunks per pipeline stage, the query tile, the
    probabilities staged for the second dot. An 8-bit cache (kv_itemsize 1) pipelines its chunks in 8 bits, and
    one chunk of K and V decoded to the dots' dtype is counted on top (their operands' layout conversion)."""
    kv_itemsize = itemsize if kv_itemsize is None else kv_itemsize
    decoded = 2 * kv_chunk * head_dim * itemsize if kv_itemsize < itemsize else 0
    return (2 * num_stages * kv_chunk * head_dim * kv_itemsize + decoded
            + (rows * head_dim + rows * kv_chunk) * itemsize)  # fmt: skip


def choose_splits(num_seqs: int, num_kv_heads: int, num_cores: int) -> int:
    """Splits enough for num_seqs x KV heads x splits programs to fill the cores: a power of two up to MAX_SPLITS
    (1 when the core count is unknown)."""
    splits = 1
    while splits < MAX_SPLITS and num_seqs * num_kv_heads * splits * 2 <= num_cores:
        splits *= 2
    return splits


def launch_config(num_tokens: int, num_seqs: int, head_dim: int, itemsize: int, *, shared_memory: int,
                  num_cores: int, num_kv_heads: int, kv_itemsize: int | None = None) -> LaunchConfig:  # fmt: skip
    """Decode buckets (a token per sequence at most) take MIN_ROWS-row tiles and split the context; prefill
    buckets take the biggest tile that fits, with at most 16k accumulator elements per program (registers).
    kv_itemsize: the cache's bytes per value when it differs from the queries' (1 for an int8/fp8 cache)."""
    decode = num_tokens <= num_seqs
    budget = shared_memory * SHARED_MEMORY_MARGIN
    for rows, kv_chunk, warps, stages in DECODE_CONFIGS if decode else PREFILL_CONFIGS:
        used = shared_memory_estimate(rows, kv_chunk, head_dim, itemsize, stages, kv_itemsize)
        if rows * head_dim <= 128 * 128 and used <= budget:
            break
    # The grid's splits: enough for the fewest sequences a decode bucket holds (a quarter of its slots; buckets
    # double); the kernel then uses as many as the step's live sequences need (_live_splits).
    splits = choose_splits(max(1, num_seqs // 4), num_kv_heads, num_cores) if decode else 1
    return LaunchConfig(rows, kv_chunk, warps, stages, splits)


def _live_splits(tile_len, num_kv_heads: int, num_cores: int, grid_splits: int):
    """On device, from this step's live tiles: the splits that fill the cores, at most the grid's; the programs
    of the others exit at once."""
    if num_cores <= 0 or grid_splits == 1:
        return jnp.full((1,), grid_splits, jnp.int32)
    programs = jnp.maximum(jnp.sum(tile_len > 0), 1) * num_kv_heads
    return jnp.clip(num_cores // programs, 1, grid_splits).astype(jnp.int32).reshape(1)


def _kernel(
    layer_ref, splits_ref, tile_seq_ref, tile_start_ref, tile_len_ref, query_start_ref, seq_lens_ref, tables_ref,
    q_ref, k_new_ref, v_new_ref, cache_ref, slope_ref, sink_ref, *refs,
    group_pad, tokens_per_tile, kv_chunk, num_blocks, grid_splits, spec, use_alibi, precision, kv_kind, bidirectional=False,
    use_sinks=False,
):  # fmt: skip
    scale_ref, out_refs = (refs[0], refs[1:]) if kv_kind else (None, refs)  # an int8/fp8 cache's scales
    key_end_ref, out_refs = (out_refs[0], out_refs[1:]) if bidirectional else (None, out_refs)  # image spans (Gemma 3)
    scale, soft_cap = spec.scale, spec.soft_cap
    tile, split = pl.program_id(0), pl.program_id(2)
    n_tok = tile_len_ref[tile]
    rows = tokens_per_tile * group_pad
    block_size = cache_ref.shape[-2]
    k_base = layer_ref[0] * 2 * num_blocks  # this layer's K blocks; its V blocks follow
    v_base = k_base + num_blocks

    @pl.when(n_tok > 0)
    def _():
        seq, t0 = tile_seq_ref[tile], tile_start_ref[tile]
        q_start, q_end = query_start_ref[seq], query_start_ref[seq + 1]
        cached = seq_lens_ref[seq] - (q_end - q_start)  # context positions already in the cache
        pos0 = cached + t0 - q_start  # position of the tile's first token
        q = q_ref[pl.ds(t0 * group_pad, rows), :]
        row_pos = pos0 + jnp.arange(rows, dtype=jnp.int32) // group_pad
        slopes = slope_ref[...] if use_alibi else None  # [rows]: each row's query head's ALiBi slope
        offsets = jnp.arange(kv_chunk, dtype=jnp.int32)

        def fold(carry, k, v, mask, key_pos, k_scale=None, v_scale=None):
            """k_scale, v_scale [kv_chunk]: a quantized chunk's per-key scales, applied to the scores' columns
            (q . k s = (q . k) s) and to p's (p . v s = (p s) . v) rather than to the chunk's head_dim-wide rows."""
            acc, peak, denom = carry
            s = plgpu.dot(q, k, trans_b=True, precision=precision)
            s = s * scale if k_scale is None else s * (k_scale * scale)[None, :]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            if use_alibi:
                s = s + slopes[:, None] * (key_pos[None, :] - row_pos[:, None]).astype(jnp.float32)
            s = jnp.where(mask, s, MASK_VALUE)
            new_peak = jnp.maximum(peak, jnp.max(s, axis=1))
            p = jnp.where(mask, jnp.exp(s - new_peak[:, None]), 0.0)
            correction = jnp.exp(peak - new_peak)
            pv = plgpu.dot((p if v_scale is None else p * v_scale[None, :]).astype(v.dtype), v, precision=precision)
            return acc * correction[:, None] + pv, new_peak, denom * correction + jnp.sum(p, axis=1)

        lowest = first_visible(pos0, spec)  # the first key any row of the tile sees (its window's or chunk's)
        row_lowest = first_visible(row_pos, spec)[:, None] if is_local(spec) else None  # [rows, 1] each row's

        def cached_iter(j, carry):
            key_pos = j * kv_chunk + offsets
            block = jnp.clip(tables_ref[seq, key_pos // block_size], 0, num_blocks - 1)
            within = key_pos % block_size
            k = cache_ref[k_base + block, within]
            v = cache_ref[v_base + block, within]
            mask = jnp.broadcast_to(key_pos[None, :] < cached, (rows, kv_chunk))
            if row_lowest is not None:  # a sliding window or a chunk
                mask &= key_pos[None, :] >= row_lowest
            if kv_kind:
                k_scale, v_scale = scale_ref[k_base + block, within], scale_ref[v_base + block, within]
                k, v = decode_kv(k, kv_kind, q.dtype), decode_kv(v, kv_kind, q.dtype)
                return fold(carry, k, v, mask, key_pos, k_scale, v_scale)
            return fold(carry, k, v, mask, key_pos)

        num_splits = splits_ref[0]  # the splits this step uses: programs past them find no chunks and no new keys
        carry = (
            jnp.zeros((rows, q.shape[1]), jnp.float32),
            jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
        )
        if use_sinks:  # each row's sink: a key of that score and value 0, in one split only (the one with new keys)
            here = (split == num_splits - 1).astype(jnp.float32)  # arithmetic: Triton cannot select on a scalar
            carry = (carry[0], sink_ref[...] * here + MASK_VALUE * (1.0 - here), carry[2] + here)
        first, end = lowest // kv_chunk, pl.cdiv(cached, kv_chunk)  # this program's share of the chunks
        per_split = pl.cdiv(jnp.maximum(end - first, 0), num_splits)
        lo = first + split * per_split
        carry = jax.lax.fori_loop(lo, jnp.minimum(lo + per_split, end), cached_iter, carry)

        first_new = q_start + jnp.maximum(0, lowest - cached)  # this step's keys the tile can see
        last_new = t0 + n_tok  # exclusive: causal
        row_end = row_pos  # the last position each row sees
        if bidirectional:  # an image's tokens see to the span's end (AttentionMetadata.key_ends)
            live_rows = jnp.arange(rows, dtype=jnp.int32) // group_pad < n_tok
            row_end = jnp.where(live_rows, jnp.maximum(key_end_ref[pl.ds(t0 * group_pad, rows)], row_pos), row_pos)
            last_new = jnp.minimum(jnp.maximum(last_new, q_start + jnp.max(row_end) - cached + 1), q_end)

        def new_iter(j, carry):
            start = first_new + j * kv_chunk
            k = k_new_ref[pl.ds(start, kv_chunk), :]
            v = v_new_ref[pl.ds(start, kv_chunk), :]
            key_pos = cached + start - q_start + offsets
            mask = key_pos[None, :] <= row_end[:, None]
            if row_lowest is not None:  # a sliding window or a chunk
                mask &= key_pos[None, :] >= row_lowest
            return fold(carry, k, v, mask, key_pos)

        new_iters = jnp.where(split == num_splits - 1, pl.cdiv(last_new - first_new, kv_chunk), 0)  # the last split's
        acc, peak, denom = jax.lax.fori_loop(0, new_iters, new_iter, carry)
        live = jnp.arange(rows, dtype=jnp.int32) // group_pad < n_tok
        here = pl.ds(t0 * group_pad, rows)
        if grid_splits == 1:
            (o_ref,) = out_refs
            out = acc / jnp.where(denom == 0.0, 1.0, denom)[:, None]
            plgpu.store(o_ref.at[here, :], out.astype(o_ref.dtype), mask=live[:, None])
        else:  # partial results, merged by _combine
            acc_ref, peak_ref, denom_ref = out_refs
            plgpu.store(acc_ref.at[here, :], acc, mask=live[:, None])
            plgpu.store(peak_ref.at[here], peak, mask=live)
            plgpu.store(denom_ref.at[here], denom, mask=live)


def _combine(acc, peak, denom):
    """Merge the splits' online-softmax states [splits, ...] into normalised outputs."""
    top = jnp.max(peak, axis=0)
    weight = jnp.exp(peak - top)  # a split that saw no key has denom 0 and adds nothing
    total = jnp.sum(weight * denom, axis=0)
    out = jnp.sum(weight[..., None] * acc, axis=0)
    return out / jnp.where(total == 0.0, 1.0, total)[..., None]


@functools.partial(jax.jit, static_argnames=("spec", "interpret", "num_cores", "shared_memory", "launch"))
def gpu_paged_attention(q, k, v, kv_cache, layer, attn_metadata: AttentionMetadata, spec: AttentionSpec, alibi_slopes=None,
                        sinks=None, *, interpret: bool = False, num_cores: int = 0, shared_memory: int = DEFAULT_SHARED_MEMORY,
                        launch: LaunchConfig | None = None) -> jax.Array:  # fmt: skip
    """reference_paged_attention's contract: q [T, H, D], this step's k/v [T, H_kv, D] -> [T, H, D].

    kv_cache: the float cache or a QuantizedKV. layer: an int or int32 scalar, traced (one kernel for every layer).
    num_cores (the GPU's SMs; 0: unknown) and shared_memory (bytes per block) choose the launch; `launch` overrides
    the choice (tests)."""
    num_tokens, num_heads, head_dim = q.shape
    kv_cache, kv_scale, kv_kind = kv_operands(kv_cache)
    num_layers, _, num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    num_seqs = attn_metadata.block_tables.shape[0]
    check_head_dim(head_dim)
    if launch is None:
        launch = launch_config(num_tokens, num_seqs, head_dim, q.dtype.itemsize, shared_memory=shared_memory,
                               num_cores=num_cores, num_kv_heads=num_kv_heads,
                               kv_itemsize=kv_cache.dtype.itemsize)  # fmt: skip
    shape = tile_shape(num_heads, num_kv_heads, block_size, launch.rows, launch.kv_chunk)
    group, group_pad, tokens_per_tile, rows = shape.group, shape.group_pad, shape.tokens_per_tile, shape.rows
    kv_chunk, splits = launch.kv_chunk, launch.num_splits

    seq, start, length = query_tiles(attn_metadata.query_start_loc, num_tokens, tokens_per_tile)
    width = attn_metadata.block_tables.shape[1]
    keys = -(-width * block_size // kv_chunk) * kv_chunk  # the table padded to whole chunks
    tables = jnp.pad(attn_metadata.block_tables, ((0, 0), (0, -(-keys // block_size) - width)))

    # [T, H, D] -> [H_kv, (T + tile) * G', D]: a KV head's query rows, token-major, group padded to G'.
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, tokens_per_tile), (0, 0), (0, group_pad - group), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
    kn, vn = (jnp.pad(x, ((0, kv_chunk), (0, 0), (0, 0))).transpose(1, 0, 2) for x in (k, v))
    # the cache as [L * 2 * blocks, H_kv, block_size, D] (a free reshape): the layer becomes an offset
    cache = kv_cache.reshape(num_layers * 2 * num_blocks, num_kv_heads, block_size, head_dim)
    # Each query row's slope, [H_kv, rows]: row r of a tile is head r % G' of its KV head's group.
    use_alibi = alibi_slopes is not None
    slopes = jnp.zeros((num_heads,), jnp.float32) if alibi_slopes is None else alibi_slopes.astype(jnp.float32)
    slopes = jnp.pad(slopes.reshape(num_kv_heads, group), ((0, 0), (0, group_pad - group)))
    slopes = jnp.tile(slopes, (1, tokens_per_tile))
    use_sinks = sinks is not None  # each query row's sink logit, laid out as the slopes
    sink_rows = jnp.zeros((num_heads,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    sink_rows = jnp.tile(jnp.pad(sink_rows.reshape(num_kv_heads, group), ((0, 0), (0, group_pad - group))), (1, tokens_per_tile))

    out_rows = qg.shape[1]
    # image spans (Gemma 3): each query row's last visible position, token-major with the group padded as qg's rows
    bidirectional = attn_metadata.key_ends is not None
    end_operands, end_specs = [], []
    if bidirectional:
        ends = jnp.pad(attn_metadata.key_ends.astype(jnp.int32), (0, tokens_per_tile))
        end_operands = [jnp.repeat(ends, group_pad)]
        end_specs = [pl.BlockSpec(end_operands[0].shape, lambda i, h, s: (0,))]
    whole = lambda shape: pl.BlockSpec(shape, lambda i, h, s: (0,) * len(shape))
    per_head = lambda n: pl.BlockSpec((None, n, head_dim), lambda i, h, s: (h, 0, 0))
    cache_spec = pl.BlockSpec((cache.shape[0], None, block_size, head_dim), lambda i, h, s: (0, h, 0, 0))
    scale_operands, scale_specs = [], []
    if kv_kind:  # the scales as the cache, less head_dim: [L * 2 * blocks, H_kv, block_size]
        scale_operands = [kv_scale.reshape(num_layers * 2 * num_blocks, num_kv_heads, block_size)]
        scale_specs = [pl.BlockSpec((cache.shape[0], None, block_size), lambda i, h, s: (0, h, 0))]
    if splits == 1:
        out_specs = per_head(out_rows)
        out_shape = jax.ShapeDtypeStruct((num_kv_heads, out_rows, head_dim), q.dtype)
    else:
        out_specs = [
            pl.BlockSpec((None, None, out_rows, head_dim), lambda i, h, s: (s, h, 0, 0)),
            pl.BlockSpec((None, None, out_rows), lambda i, h, s: (s, h, 0)),
            pl.BlockSpec((None, None, out_rows), lambda i, h, s: (s, h, 0)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((splits, num_kv_heads, out_rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_kv_heads, out_rows), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_kv_heads, out_rows), jnp.float32),
        ]
    kernel = functools.partial(
        _kernel, group_pad=group_pad, tokens_per_tile=tokens_per_tile, kv_chunk=kv_chunk, num_blocks=num_blocks,
        grid_splits=splits, spec=spec, use_alibi=use_alibi, kv_kind=kv_kind, bidirectional=bidirectional,
        use_sinks=use_sinks, precision=jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
    )  # fmt: skip
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    out = pl.pallas_call(
        kernel,
        grid=(seq.shape[0], num_kv_heads, splits),
        in_specs=[
            whole((1,)), whole((1,)), whole(seq.shape), whole(start.shape), whole(length.shape),
            whole(attn_metadata.query_start_loc.shape), whole(attn_metadata.seq_lens.shape), whole(tables.shape),
            per_head(out_rows), per_head(kn.shape[1]), per_head(vn.shape[1]), cache_spec,
            pl.BlockSpec((None, rows), lambda i, h, s: (h, 0)), pl.BlockSpec((None, rows), lambda i, h, s: (h, 0)),
            *scale_specs, *end_specs,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_r{rows}_kv{kv_chunk}_s{splits}" + (f"_{kv_kind}" if kv_kind else ""),
    )(
        layer, _live_splits(length, num_kv_heads, num_cores, splits), seq, start, length, attn_metadata.query_start_loc, attn_metadata.seq_lens, tables,
        qg, kn, vn, cache, slopes, sink_rows, *scale_operands, *end_operands,
    )  # fmt: skip
    if splits > 1:
        out = _combine(*out).astype(q.dtype)
    out = out.reshape(num_kv_heads, num_tokens + tokens_per_tile, group_pad, head_dim)[:, :num_tokens, :group]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim)
    covered = jnp.arange(num_tokens) < attn_metadata.query_start_loc[-1]  # rows no tile wrote hold garbage
    return jnp.where(covered[:, None, None], out, jnp.zeros((), q.dtype))


__all__ = ["LaunchConfig", "gpu_paged_attention", "launch_config"]

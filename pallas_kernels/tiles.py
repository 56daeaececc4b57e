"""Query tiles: how a step's ragged sequences are cut into fixed-size pieces of kernel work.

A kernel program handles up to `tokens_per_tile` consecutive query tokens of one sequence,
so it streams that sequence's K/V once for all of them. The tile list is computed on device
from query_start_loc (no host round trip) and has a static length, an upper bound on the
number of tiles any step of this shape can need; tiles past the real ones have length 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxpaged.pallas_kernels.kv_quant import QuantizedKV

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite, so fully masked rows never make NaN


def check_head_dim(head_dim: int) -> None:
    """The Pallas kernels take head dims that are powers of two from 16 to 256; a ValueError naming the fallback."""
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(
            f"the Pallas attention kernel needs head_dim a power of two from 16 to 256 (64, 128 and 256 in real models); "
            f"got head_dim={head_dim}. Use attention_backend='reference' for this model."
        )


def first_visible(pos, spec):
    """The first key position a query at `pos` (>= 0; a scalar or an int32 array) sees: its sliding window's first
    or its chunk's (chunked local attention), whichever is later; 0 (a Python int) with neither. lax.div rather
    than //: Mosaic lowers floor division through sign(), which needs a TPU to lower."""
    lowest = 0
    if spec.sliding_window is not None:
        lowest = jnp.maximum(lowest, pos - spec.sliding_window + 1)
    if spec.chunk_size is not None:
        lowest = jnp.maximum(lowest, jax.lax.div(pos, jnp.int32(spec.chunk_size)) * spec.chunk_size)
    return lowest


def is_local(spec) -> bool:
    """Whether spec limits how far back a query sees (a sliding window or a chunk)."""
    return spec.sliding_window is not None or spec.chunk_size is not None


def num_query_tiles(num_tokens: int, num_seqs: int, tokens_per_tile: int) -> int:
    """Static bound: sum over sequences of ceil(q_len / tile) <= ceil(T / tile) + S, and <= T."""
    return max(1, min(num_tokens, -(-num_tokens // tokens_per_tile) + num_seqs))


def query_tiles(query_start_loc: jax.Array, num_tokens: int, tokens_per_tile: int):
    """-> (seq [N], start [N], length [N]) int32: each tile's sequence slot, first flat row, token count."""
    num_seqs = query_start_loc.shape[0] - 1
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    per_seq = (q_lens + tokens_per_tile - 1) // tokens_per_tile
    ends = jnp.cumsum(per_seq)
    n = num_query_tiles(num_tokens, num_seqs, tokens_per_tile)
    tile = jnp.arange(n, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, tile, side="right"), num_seqs - 1).astype(jnp.int32)
    start = query_start_loc[seq] + (tile - (ends[seq] - per_seq[seq])) * tokens_per_tile
    length = jnp.where(tile < ends[-1], jnp.minimum(tokens_per_tile, query_start_loc[seq + 1] - start), 0)
    return seq, start.astype(jnp.int32), length.astype(jnp.int32)


def token_tiles(query_start_loc: jax.Array, num_tokens: int, tokens_per_tile: int, num_tiles: int):
    """query_tiles' layout read back: -> (tile [T], row [T], valid [T]): flat row t of sequence s sits in row
    (t - q_start) % tokens_per_tile of tile first_tile[s] + (t - q_start) // tokens_per_tile; valid: t is a real row."""
    rows_idx = jnp.arange(num_tokens, dtype=jnp.int32)
    tok_seq = jnp.minimum(jnp.searchsorted(query_start_loc[1:], rows_idx, side="right"), query_start_loc.shape[0] - 2)
    valid = rows_idx < query_start_loc[-1]
    per_seq = (query_start_loc[1:] - query_start_loc[:-1] + tokens_per_tile - 1) // tokens_per_tile
    first_tile = jnp.cumsum(per_seq) - per_seq
    offset = rows_idx - query_start_loc[tok_seq]
    tile_of = jnp.clip(first_tile[tok_seq] + offset // tokens_per_tile, 0, num_tiles - 1)
    return tile_of, offset % tokens_per_tile, valid


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class TileShape:
    """How a kernel cuts one step: query rows per program and KV blocks per inner iteration."""

    group: int  # query heads per KV head
    group_pad: int  # ... rounded up to a power of two
    tokens_per_tile: int  # a tile's tokens: rows_target // group_pad (at least 1)
    rows: int  # tokens_per_tile * group_pad query rows per program
    pages_per_iter: int  # KV blocks per inner iteration


def tile_shape(num_heads: int, num_kv_heads: int, block_size: int, rows_target: int, kv_tokens_per_iter: int) -> TileShape:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    group_pad = _pow2(group)
    tokens_per_tile = max(1, rows_target // group_pad)
    return TileShape(group, group_pad, tokens_per_tile, tokens_per_tile * group_pad,
                     max(1, kv_tokens_per_iter // block_size))  # fmt: skip


def kv_operands(kv_cache):
    """-> (data, scale or None, kind or None): a QuantizedKV's fp8 or int8 values as int8 (fp8 as its bits, a free
    bitcast: neither Triton below sm_89 nor older TPUs convert e4m3 natively, so the kernels decode the bits)."""
    if not isinstance(kv_cache, QuantizedKV):
        return kv_cache, None, None
    data = kv_cache.data
    if data.dtype != jnp.int8:
        data = jax.lax.bitcast_convert_type(data, jnp.int8)  # float8_e4m3fn or its uint8 bits
    return data, kv_cache.scale, kv_cache.kind


def decode_kv(data: jax.Array, kind: str, dtype) -> jax.Array:
    """Inside a kernel: a chunk of kv_operands' int8 values -> `dtype` (its scale not applied). Exact in float32,
    bfloat16 and float16 (an int8 or e4m3 value fits each). fp8 is rebuilt from its bits with integer ops: the
    exponent rebiased into a float32's (7 -> 127), subnormals (exponent 0) as mantissa * 2^-9, so no float32
    subnormal is made (flushed on some devices); e4m3fn's NaN is never stored (quantize_kv clips)."""
    if kind == "int8":
        return data.astype(jnp.float32).astype(dtype)
    bits = data.astype(jnp.int32)  # sign-extended: the low 7 bits are the magnitude's
    mag = bits & 0x7F
    normal = jax.lax.bitcast_convert_type((mag << 20) + (120 << 23), jnp.float32)
    value = jnp.where(mag < 8, (mag & 7).astype(jnp.float32) * 2.0**-9, normal)
    return jnp.where(bits < 0, -value, value).astype(dtype)

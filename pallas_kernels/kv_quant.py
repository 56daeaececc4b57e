"""The KV cache in 8 bits: int8 or fp8 (e4m3) values with one float32 scale per token and KV head.

A quantized cache is a `QuantizedKV` pytree in place of the float array: `data` has the float cache's layout
(metadata.py: [layers, 2, blocks, KV heads, block_size, head_dim]) and `scale` the same without head_dim.
A token's K (or V) vector of one head is stored as round(x / s) with s = max|x| / QMAX, chosen when the token is
written (write_kv): no calibration, and a token's scale never changes, so blocks fill one token at a time and
copy-on-write copies blocks whole. value = data * scale, in float32, in every reader (the reference, the CPU
kernel, the Pallas kernels). head_dim + 4 bytes per head and token instead of 2 * head_dim (bfloat16) or
4 * head_dim (float32).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # "auto": the model's dtype, unquantized
QMAX = {"int8": 127.0, "fp8": 448.0}  # the largest magnitude each stores (e4m3fn's finite maximum)
STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
TINY = 1e-30  # the scale of an all-zero vector: any positive value reads back 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    data: jax.Array  # [L, 2, blocks, H_kv, block_size, D], int8 or float8_e4m3fn (a platform may store fp8 as uint8 bits)
    scale: jax.Array  # [L, 2, blocks, H_kv, block_size] float32
    kind: str = dataclasses.field(default="int8", metadata={"static": True})  # "int8" or "fp8"

    @property
    def shape(self) -> tuple[int, ...]:
        """The float cache's shape: shape-reading code works on either."""
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (got {kv_cache_dtype!r})")
    return kv_cache_dtype


def quantize_kv(x: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (values [..., D] in STORAGE[kind], scales [...] float32), one scale per vector."""
    x = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1) / QMAX[kind], TINY)
    y = x / scale[..., None]
    if kind == "int8":
        return jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8), scale
    return jnp.clip(y, -QMAX[kind], QMAX[kind]).astype(jnp.float8_e4m3fn), scale


def dequantize_kv(values: jax.Array, scale: jax.Array, dtype, kind: str) -> jax.Array:
    """quantize_kv's inverse (up to rounding): [..., D] in `dtype`. Reads fp8 stored as uint8 bits too."""
    if kind == "fp8" and values.dtype == jnp.uint8:
        values = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
    return (values.astype(jnp.float32) * scale[..., None]).astype(dtype)


def empty_quantized_kv(shape: tuple[int, ...], kind: str, storage_dtype=None) -> QuantizedKV:
    """A zeroed cache of the float cache's `shape`."""
    dtype = storage_dtype or STORAGE[kind]
    return QuantizedKV(jnp.zeros(shape, dtype), jnp.zeros(shape[:-1], jnp.float32), kind)


def kv_bytes_per_token_head(head_dim: int, kv_cache_dtype: str, dtype) -> int:
    """Bytes one token's K or V of one head takes in the pool."""
    if kv_cache_dtype == "auto":
        return head_dim * jnp.dtype(dtype).itemsize
    return head_dim + 4

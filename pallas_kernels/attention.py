"""The one attention entry point models call: write this step's K/V into the blocks, then attend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.reference import reference_paged_attention

# "pallas" and "auto" arrive with the kernel; until then the reference serves every platform.
ATTENTION_BACKENDS = ("reference",)


def write_kv(kv_cache: jax.Array, layer: int, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter k, v ([T, H_kv, D]) into their slots; rows with slot -1 are dropped, not written."""
    num_blocks, block_size = kv_cache.shape[3], kv_cache.shape[4]
    block = jnp.where(slot_mapping >= 0, slot_mapping // block_size, num_blocks)  # out of range -> dropped
    offset = slot_mapping % block_size
    new = jnp.stack([k, v], axis=1).astype(kv_cache.dtype)  # [T, 2, H_kv, D]
    return kv_cache.at[layer, :, :, block, offset].set(new, mode="drop")


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: jax.Array,
    layer: int,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: str = "reference",
) -> tuple[jax.Array, jax.Array]:
    """q [T, H, D], k/v [T, H_kv, D] -> (out [T, H, D], updated kv_cache)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not available; choose from {ATTENTION_BACKENDS}")
    kv_cache = write_kv(kv_cache, layer, k, v, md.slot_mapping)
    out = reference_paged_attention(
        q, kv_cache, layer, md, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap
    )
    return out, kv_cache

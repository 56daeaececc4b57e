"""The attention entry points models call.

A step's forward pass only reads the KV cache (`paged_attention` takes this step's K/V beside it); `write_kv`
stores every layer's new K/V afterwards, in a second jitted call that donates the cache, so XLA never copies the
cache (docs/design.md). Under a mesh with a "model" axis, attention runs per device under shard_map, one slice of
KV heads each: heads never talk to each other, and the Pallas kernels cannot be partitioned by GSPMD.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxpaged.pallas_kernels.backends import AttentionBackend
from jaxpaged.pallas_kernels.kv_quant import QuantizedKV, quantize_kv
from jaxpaged.pallas_kernels.metadata import AttentionMetadata, AttentionSpec
from jaxpaged.pallas_kernels.state_cache import HybridCache, write_states

TP_AXIS = "model"  # the mesh axis tensor parallelism splits heads over


def write_kv(kv_cache, new_kv: jax.Array, slot_mapping: jax.Array, layer_groups: tuple[tuple[int, int], ...] | None = None):
    """Scatter new_kv [T, L, 2, H_kv, D] into each token's slot; rows with slot -1 are dropped. A QuantizedKV
    gets each token's 8-bit values and its scale per layer, K/V and head. With KV cache groups (layer_groups: each
    layer's (group, index)), slot_mapping is [G, T] and each group's layers go through its own slots. A hybrid model's
    HybridCache takes a StateUpdate: its attention layers' K/V so, and each row's new states into its slot."""
    if isinstance(kv_cache, HybridCache):
        return write_states(kv_cache, new_kv, lambda kv, new: write_kv(kv, new, slot_mapping, layer_groups))
    if layer_groups is not None:
        for group in range(slot_mapping.shape[0]):
            layers = sorted((index, layer) for layer, (g, index) in enumerate(layer_groups) if g == group)
            kv_cache = write_kv(kv_cache, new_kv[:, [layer for _, layer in layers]], slot_mapping[group])
        return kv_cache
    num_blocks, block_size = kv_cache.shape[2], kv_cache.shape[4]
    block = jnp.where(slot_mapping >= 0, slot_mapping // block_size, num_blocks)  # out of range -> dropped
    offset = slot_mapping % block_size
    if isinstance(kv_cache, QuantizedKV):
        data, scale = quantize_kv(new_kv, kv_cache.kind)
        if data.dtype != kv_cache.data.dtype:  # fp8 kept as its uint8 bits
            data = jax.lax.bitcast_convert_type(data, kv_cache.data.dtype)
        return QuantizedKV(kv_cache.data.at[:, :, block, :, offset].set(data, mode="drop"),
                           kv_cache.scale.at[:, :, block, :, offset].set(scale, mode="drop"), kv_cache.kind)  # fmt: skip
    if kv_cache.dtype == jnp.uint16 and new_kv.dtype != jnp.uint16:  # the bits of 16-bit floats
        new_kv = jax.lax.bitcast_convert_type(new_kv, jnp.uint16)
    return kv_cache.at[:, :, block, :, offset].set(new_kv.astype(kv_cache.dtype), mode="drop")


def copy_blocks(kv_cache, src: jax.Array, dst: jax.Array):
    """Copy whole blocks (every layer, K and V; a QuantizedKV's scales with them) src[i] -> dst[i]; pairs with
    dst out of range are dropped. (A HybridCache's states are slots, not blocks: copy_states copies those.)"""
    if isinstance(kv_cache, HybridCache):
        return HybridCache(copy_blocks(kv_cache.kv, src, dst), kv_cache.states)
    return jax.tree.map(lambda x: x.at[:, :, dst].set(x[:, :, src], mode="drop"), kv_cache)


def stack_new_kv(per_layer: list[tuple[jax.Array, jax.Array]]) -> jax.Array:
    """[(k, v) each [T, H_kv, D]] per layer -> [T, L, 2, H_kv, D], write_kv's layout."""
    return jnp.stack([jnp.stack([k, v], axis=1) for k, v in per_layer], axis=1)


def paged_attention(q, k, v, kv_cache, layer: int, attn_metadata: AttentionMetadata, spec: AttentionSpec, alibi_slopes=None,
                    sinks=None, *, backend: AttentionBackend) -> jax.Array:  # fmt: skip
    """`backend`'s attention (AttentionBackend's contract), per device under shard_map when traced under a TP mesh;
    the per-head alibi_slopes and sinks [H] split with the heads."""
    if spec.chunk_size is not None and not backend.supports_chunks:
        raise ValueError(f"the {backend.name} attention backend does not take chunked local attention (chunk_size); "
                         "a port routes such layers through one that does (ReferenceAttention)")  # fmt: skip
    layer, attn_metadata = attn_metadata.for_layer(layer)  # KV cache groups: the layer's group and index
    per_head = lambda x: jnp.zeros((q.shape[1],), jnp.float32) if x is None else x.astype(jnp.float32)  # noqa: E731
    attend = functools.partial(_attend, layer=layer, spec=spec, backend=backend, use_alibi=alibi_slopes is not None,
                               use_sinks=sinks is not None)  # fmt: skip
    n = tp_size()
    if n > 1 and kv_cache.shape[3] % n == 0:
        heads = P(None, TP_AXIS, None)
        cache = kv_cache_spec(kv_cache)
        in_specs = (heads, heads, heads, cache, P(), P(TP_AXIS), P(TP_AXIS))
        attend = jax.shard_map(attend, in_specs=in_specs, out_specs=heads, check_vma=False)
    return attend(q, k, v, kv_cache, attn_metadata, per_head(alibi_slopes), per_head(sinks))


def kv_cache_spec(kv_cache):
    """The cache's PartitionSpec (a QuantizedKV of two for an 8-bit cache): split on the KV-head axis."""
    spec = P(None, None, None, TP_AXIS, None, None)
    if isinstance(kv_cache, QuantizedKV):
        return QuantizedKV(spec, P(None, None, None, TP_AXIS, None), kv_cache.kind)
    return spec


def tp_size() -> int:
    """Devices on the "model" axis of the mesh being traced under (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TP_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[TP_AXIS])


def _attend(q, k, v, kv_cache, attn_metadata, slopes, sinks, *, layer, spec, backend, use_alibi, use_sinks):
    if not use_sinks:  # the contract's older callers (and backends) never see the argument
        return backend(q, k, v, kv_cache, layer, attn_metadata, spec, slopes if use_alibi else None)
    return backend(q, k, v, kv_cache, layer, attn_metadata, spec, slopes if use_alibi else None, sinks)

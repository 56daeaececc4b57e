"""The attention entry points models call.

A step's forward pass only reads the KV cache: `paged_attention` takes this step's K/V as
arguments next to the cache, and `write_kv` stores every layer's new K/V in one scatter
afterwards. Writing layer by layer would interleave in-place updates with reads of the same
buffer; XLA answers that with copies of the whole cache (measured: one per layer). Even one
scatter at the end of the same jit kept two full copies (the read loops hold the buffer), so
the runner writes in a second jitted call that donates the cache: no copies at all.

Tensor parallelism: when the caller traces under a mesh with a "model" axis (`jax.set_mesh`),
attention runs under `shard_map` over that axis, one slice of KV heads (and their query heads)
per device. Heads never talk to each other in attention, so this needs no communication, and
the Pallas kernels (which GSPMD cannot partition) run unchanged on each device's slice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxpaged.pallas_kernels.metadata import AttentionMetadata
from jaxpaged.pallas_kernels.reference import reference_paged_attention

from jaxpaged.platforms.cpu import attention as cpu_attention

# The Pallas kernels (gpu_attention, tpu_attention) are imported where they are chosen: importing Pallas costs
# a CPU start about 0.2 s for kernels it never runs.

# "pallas": the Triton kernel on GPU (interpreted on CPU), the Mosaic kernel on TPU.
# "native": the C++ kernel for CPUs (jaxpaged/platforms/cpu/attention.cc), built on first use.
ATTENTION_BACKENDS = ("reference", "pallas", "native")
TP_AXIS = "model"  # the mesh axis tensor parallelism splits heads over


def resolve_attention_backend(
    requested: str, head_dim: int, platform: str | None = None, batch_invariant: bool = False
) -> str:
    """auto -> the Pallas kernel on GPU/TPU when it supports the head dim, else the reference; on CPU
    the native kernel when it builds here, else the reference.

    An explicit "pallas" with a head dim the kernel cannot take, or "native" off the CPU or where it
    cannot be built, is an error, not a silent fallback. batch_invariant picks the reference's
    batch-invariant variant ("reference_invariant") on CPU; the Pallas kernel already is: a program's
    tile starts at its sequence's first token and walks keys from there.
    """
    platform = platform or jax.default_backend()
    if requested == "auto":
        if platform == "cpu":
            resolved = "native" if cpu_attention.available() else "reference"
        else:
            from jaxpaged.pallas_kernels.gpu_attention import check_head_dim

            try:
                check_head_dim(head_dim)
                resolved = "pallas"
            except ValueError:
                resolved = "reference"
    elif requested in ATTENTION_BACKENDS:
        if requested == "pallas":
            from jaxpaged.pallas_kernels.gpu_attention import check_head_dim

            check_head_dim(head_dim)
        if requested == "native" and (platform != "cpu" or not cpu_attention.available()):
            where = "it could not be built (see the warning above)" if platform == "cpu" else f"this is {platform}"
            raise ValueError(f"attention_backend='native' is the CPU kernel, and {where}")
        resolved = requested
    else:
        raise ValueError(f"attention_backend must be 'auto' or one of {ATTENTION_BACKENDS} (got {requested!r})")
    return "reference_invariant" if batch_invariant and resolved in ("reference", "native") else resolved


def kv_storage_dtype(dtype, platform: str | None = None):
    """The KV array's element type: the model's dtype, except 16-bit floats on CPU, kept as uint16 bit patterns.

    XLA:CPU cannot update a bfloat16/float16 array in place: its float normalization turns the scatter
    into a conversion of the whole cache to float32 and back (measured: 0.8 s per step for SmolLM2's
    1.5 GB cache, against 0.1 ms in float32). Integer scatters stay in place, and readers reinterpret
    only the blocks they gather (reference.cached_blocks).
    """
    platform = platform or jax.default_backend()
    if platform == "cpu" and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return jnp.uint16
    return jnp.dtype(dtype)


def write_kv(kv_cache: jax.Array, new_kv: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter new_kv [T, L, 2, H_kv, D] into each token's slot; rows with slot -1 are dropped."""
    num_blocks, block_size = kv_cache.shape[2], kv_cache.shape[4]
    block = jnp.where(slot_mapping >= 0, slot_mapping // block_size, num_blocks)  # out of range -> dropped
    offset = slot_mapping % block_size
    if kv_cache.dtype == jnp.uint16 and new_kv.dtype != jnp.uint16:  # the bits of 16-bit floats
        new_kv = jax.lax.bitcast_convert_type(new_kv, jnp.uint16)
    return kv_cache.at[:, :, block, :, offset].set(new_kv.astype(kv_cache.dtype), mode="drop")


def copy_blocks(kv_cache: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Copy whole blocks (every layer, K and V) src[i] -> dst[i]; pairs with dst out of range are dropped."""
    return kv_cache.at[:, :, dst].set(kv_cache[:, :, src], mode="drop")


def stack_new_kv(per_layer: list[tuple[jax.Array, jax.Array]]) -> jax.Array:
    """[(k, v) each [T, H_kv, D]] per layer -> [T, L, 2, H_kv, D], write_kv's layout."""
    return jnp.stack([jnp.stack([k, v], axis=1) for k, v in per_layer], axis=1)


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: jax.Array,
    layer: int,
    attn_metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    backend: str = "reference",
) -> jax.Array:
    """q [T, H, D] with this step's k/v [T, H_kv, D] over the cached context -> out [T, H, D].

    alibi_slopes: float32 [H], one per query head; adds slope * (key_pos - query_pos) to the scores
    (after scale and soft-cap, before the causal/window mask), as BLOOM, MPT and Falcon-ALiBi do.
    """
    if backend not in (*ATTENTION_BACKENDS, "reference_invariant"):
        raise ValueError(f"attention backend {backend!r} is not available; choose from {ATTENTION_BACKENDS}")
    kw = {"scale": scale, "sliding_window": sliding_window, "soft_cap": soft_cap}
    attend = functools.partial(_attend, layer=layer, backend=backend, **kw)
    slopes = jnp.zeros((q.shape[1],), jnp.float32) if alibi_slopes is None else alibi_slopes.astype(jnp.float32)
    n = tp_size()
    if n > 1 and kv_cache.shape[3] % n == 0:
        heads = P(None, TP_AXIS, None)
        cache = P(None, None, None, TP_AXIS, None, None)
        attend = jax.shard_map(
            functools.partial(attend, use_alibi=alibi_slopes is not None),
            in_specs=(heads, heads, heads, cache, P(), P(TP_AXIS)), out_specs=heads, check_vma=False,
        )
        return attend(q, k, v, kv_cache, attn_metadata, slopes)
    return attend(q, k, v, kv_cache, attn_metadata, slopes, use_alibi=alibi_slopes is not None)


def tp_size() -> int:
    """Devices on the "model" axis of the mesh being traced under (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TP_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[TP_AXIS])


def _attend(q, k, v, kv_cache, attn_metadata, slopes, *, layer, backend, use_alibi, **kw):
    kw["alibi_slopes"] = slopes if use_alibi else None
    if backend in ("reference", "reference_invariant"):
        return reference_paged_attention(q, k, v, kv_cache, layer, attn_metadata, batch_invariant=backend != "reference", **kw)
    if backend == "native":
        return cpu_attention.cpu_paged_attention(q, k, v, kv_cache, layer, attn_metadata, **kw)
    if kv_cache.dtype == jnp.uint16:  # the kernels read floats: a full copy, only when run interpreted on CPU
        kv_cache = jax.lax.bitcast_convert_type(kv_cache, q.dtype)
    platform = jax.default_backend()
    if platform == "tpu":
        from jaxpaged.pallas_kernels.tpu_attention import tpu_paged_attention

        return tpu_paged_attention(q, k, v, kv_cache, layer, attn_metadata, **kw)
    from jaxpaged.pallas_kernels.gpu_attention import gpu_paged_attention

    return gpu_paged_attention(q, k, v, kv_cache, layer, attn_metadata, interpret=platform != "gpu", **kw)

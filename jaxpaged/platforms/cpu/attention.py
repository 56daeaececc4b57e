"""The CPU attention kernel: native code (attention.cc) behind an XLA FFI custom call.

The shared library is built once per machine (native_build.py). Without a compiler, `available()` is
False and attention_backend="auto" keeps the pure-JAX reference on CPU.

The kernel attends each row over its sequence's cached positions and this step's own keys (passed
beside the cache, since the runner writes them after the step) in one online softmax.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.pallas_kernels.backends import AttentionBackend
from jaxpaged.pallas_kernels.kv_quant import QuantizedKV
from jaxpaged.pallas_kernels.metadata import AttentionMetadata, AttentionSpec
from jaxpaged.platforms.cpu import native_build
from jaxpaged.platforms.cpu.native_build import compiler  # noqa: F401 - part of this module's interface

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attention.cc")
TARGET = "jaxpaged_paged_attention_cpu"
CXXFLAGS = native_build.CXXFLAGS
STORAGE = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}
QUANTIZED_STORAGE = {"int8": 3, "fp8": 4}  # attention.cc's Storage


def build(cache_dir: str | None = None) -> Path:
    """Compile the kernel unless a build for this source, JAX and CPU is cached; the path of the library."""
    return native_build.build(SOURCE, CXXFLAGS, cache_dir)


def start_build() -> None:
    """Compile the kernel in the background (see native_build.start_build)."""
    native_build.start_build(SOURCE, CXXFLAGS)


def library_path(cache_dir: str | None = None) -> Path:
    return native_build.library_path(SOURCE, CXXFLAGS, cache_dir)


def register(target: str, flags=None, cache_dir: str | None = None) -> None:
    """Build with `flags` (default CXXFLAGS) and register the kernel as the FFI target `target`."""
    lib = ctypes.CDLL(str(native_build.build(SOURCE, flags or CXXFLAGS, cache_dir)))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.JaxpagedPagedAttention), platform="cpu")


@functools.cache
def available() -> bool:
    """Builds (once per machine) and registers the kernel; False, with a warning, where that fails."""
    try:
        register(TARGET)
        return True
    except Exception as e:  # noqa: BLE001 - any failure means: use the reference
        logger.warning("the native CPU attention kernel is unavailable, using the pure-JAX reference: %s", e)
        return False


def cpu_paged_attention(q, k, v, kv_cache, layer: int, attn_metadata: AttentionMetadata, spec: AttentionSpec,
                        alibi_slopes=None, sinks=None) -> jax.Array:  # fmt: skip
    """reference_paged_attention's result, from the kernel: q [T, H, D], this step's k/v [T, H_kv, D]."""
    if not available():
        raise RuntimeError("the native CPU attention kernel could not be built; see the warning logged above")
    scales = jnp.zeros((1,), jnp.float32)
    if isinstance(kv_cache, QuantizedKV):  # 8 bits and their scales; fp8 read as its bits
        storage, scales = QUANTIZED_STORAGE[kv_cache.kind], kv_cache.scale
        kv_cache = kv_cache.data if kv_cache.kind == "int8" else jax.lax.bitcast_convert_type(kv_cache.data, jnp.uint8)
    else:
        if kv_cache.dtype in (jnp.bfloat16, jnp.float16):  # the kernel reads 16-bit floats as their bits
            kv_cache = jax.lax.bitcast_convert_type(kv_cache, jnp.uint16)
        storage = 0 if kv_cache.dtype == jnp.float32 else STORAGE[jnp.dtype(q.dtype)]
    slopes = jnp.zeros((q.shape[1],), jnp.float32) if alibi_slopes is None else alibi_slopes.astype(jnp.float32)
    sink_logits = jnp.zeros((1,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    f32 = lambda x: x.astype(jnp.float32)
    key_ends = attn_metadata.key_ends  # an image's tokens attending to each other both ways (Gemma 3), or None
    out = call(
        f32(q), f32(k), f32(v), kv_cache, scales, attn_metadata.block_tables, attn_metadata.seq_lens, attn_metadata.query_start_loc, slopes, sink_logits,
        jnp.zeros((1,), jnp.int32) if key_ends is None else key_ends.astype(jnp.int32),
        layer=layer, storage=storage, window=spec.sliding_window or 0, chunk=spec.chunk_size or 0,
        scale=np.float32(spec.scale), soft_cap=np.float32(spec.soft_cap or 0.0), alibi=alibi_slopes is not None,
        use_sinks=sinks is not None,
        bidirectional=key_ends is not None,
    )  # fmt: skip
    return out.astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class NativeCpuAttention(AttentionBackend):
    """The C++ kernel behind the AttentionBackend interface."""

    name = "native"
    supports_chunks = True

    def __call__(self, q, k, v, kv_cache, layer, attn_metadata, spec, alibi_slopes=None, sinks=None):
        return cpu_paged_attention(q, k, v, kv_cache, layer, attn_metadata, spec, alibi_slopes, sinks)

"""One interface for every attention implementation: a platform picks one when the engine starts, and each
Attention layer calls it. Backends are frozen dataclasses: they sit in the model's graph, whose repr keys the
executable cache, so that repr must be stable across processes."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxpaged.pallas_kernels.kv_quant import QuantizedKV
from jaxpaged.pallas_kernels.metadata import AttentionMetadata, AttentionSpec
from jaxpaged.pallas_kernels.reference import reference_paged_attention
from jaxpaged.pallas_kernels.tiles import check_head_dim


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """The contract every kernel keeps: q [T, H, D] with this step's k/v [T, H_kv, D] (not yet in the cache) over the
    cached context of `layer` -> out [T, H, D], as naive_paged_attention defines it. alibi_slopes: float32 [H] or
    None; adds slope * (key_pos - query_pos) after scale and soft-cap. sinks: float32 [H] or None; each head's
    learned sink logit joins its softmax denominator (GPT-OSS)."""

    name: ClassVar[str]
    supports_chunks: ClassVar[bool] = False  # AttentionSpec.chunk_size (chunked local attention) honoured

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array, layer: int,
                 attn_metadata: AttentionMetadata, spec: AttentionSpec, alibi_slopes: jax.Array | None = None,
                 sinks: jax.Array | None = None) -> jax.Array:  # fmt: skip
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class ReferenceAttention(AttentionBackend):
    """The pure-JAX definition any device runs; batch_invariant makes a row's result independent of the step."""

    batch_invariant: bool = False
    supports_chunks: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return "reference_invariant" if self.batch_invariant else "reference"

    def __call__(self, q, k, v, kv_cache, layer, attn_metadata, spec, alibi_slopes=None, sinks=None):
        return reference_paged_attention(q, k, v, kv_cache, layer, attn_metadata, spec, alibi_slopes, sinks,
                                         batch_invariant=self.batch_invariant)  # fmt: skip


def _as_floats(kv_cache, dtype):
    """The Pallas kernels read floats or a QuantizedKV (passed as it is: they read its int8, fp8 or uint8-held fp8
    values themselves); a CPU cache holds 16-bit floats as uint16 (only when interpreted there)."""
    if isinstance(kv_cache, QuantizedKV):
        return kv_cache
    return jax.lax.bitcast_convert_type(kv_cache, dtype) if kv_cache.dtype == jnp.uint16 else kv_cache


@dataclasses.dataclass(frozen=True)
class PallasAttention(AttentionBackend):
    """A Pallas kernel; interpret=True runs it on any device (tests, CPU)."""

    name: ClassVar[str] = "pallas"
    supports_chunks: ClassVar[bool] = True
    interpret: bool = False

    def kernel(self):
        raise NotImplementedError

    def options(self) -> dict:
        """The kernel's keyword arguments beyond the contract's."""
        return {"interpret": self.interpret}

    def __call__(self, q, k, v, kv_cache, layer, attn_metadata, spec, alibi_slopes=None, sinks=None):
        cache = _as_floats(kv_cache, q.dtype)
        return self.kernel()(q, k, v, cache, layer, attn_metadata, spec, alibi_slopes, sinks, **self.options())


@dataclasses.dataclass(frozen=True)
class TritonAttention(PallasAttention):
    """The GPU kernel, in Pallas' Triton dialect. num_cores (SMs; 0 when unknown) and shared_memory (bytes per
    block; 0 for the kernel's default) describe the GPU its launches are sized for."""

    num_cores: int = 0
    shared_memory: int = 0
    launch: Any = None  # a gpu_attention.LaunchConfig for every bucket instead of launch_config's choice (a tuning sweep)

    def options(self) -> dict:
        options = {"interpret": self.interpret, "num_cores": self.num_cores}
        options |= {"launch": self.launch} if self.launch is not None else {}
        return options | ({"shared_memory": self.shared_memory} if self.shared_memory else {})

    def kernel(self):
        from jaxpaged.pallas_kernels.gpu_attention import gpu_paged_attention  # Pallas is imported only where used

        return gpu_paged_attention


@dataclasses.dataclass(frozen=True)
class MosaicAttention(PallasAttention):
    """The TPU kernel, in Pallas' Mosaic dialect."""

    def kernel(self):
        from jaxpaged.pallas_kernels.tpu_attention import tpu_paged_attention

        return tpu_paged_attention


def check_pallas_head_dim(head_dim: int) -> None:
    """A ValueError naming attention_backend when the Pallas kernels cannot take this head dim."""
    check_head_dim(head_dim)

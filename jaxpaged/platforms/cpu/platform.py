"""The CPU platform: float32 by default, the native kernels where they build, 16-bit KV stored as bits."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.models.layers import CausalLM, DenseEmbedding, DenseLinear, Embedding, Linear
from jaxpaged.models.quantization import ChannelLinear
from jaxpaged.pallas_kernels.backends import AttentionBackend, ReferenceAttention, TritonAttention, check_pallas_head_dim
from jaxpaged.platforms.cpu import attention as cpu_attention
from jaxpaged.platforms.cpu import matmul as cpu_matmul
from jaxpaged.platforms.cpu.host_malloc import tune_malloc
from jaxpaged.platforms.interface import Platform, steady_block_count

if TYPE_CHECKING:
    from jaxpaged.config import EngineConfig

logger = logging.getLogger("jaxpaged.platforms.cpu")

KV_CACHE_BYTES = 2 << 30  # the pool is sized to fit comfortably in RAM, not to fill it


@dataclasses.dataclass(frozen=True)
class TransposedHead(DenseEmbedding):
    """A tied 16-bit head reading a transposed copy of the table: XLA:CPU runs a 16-bit `x @ E.T` by converting
    E to float32 on every call, but `x @ W` with W [in, out] natively."""

    def attend(self, layer: Embedding, x: jax.Array) -> jax.Array:
        return jnp.dot(x, layer.output_kernel[...], preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class ComputedOnce:
    """Values computed once into memory: fused into their consumers, XLA:CPU recomputes RoPE's sin and cos for every
    head of q and k in every layer. A conditional's results are never fused (and on CPU cost no host round trip)."""

    def __call__(self, compute, operand: jax.Array):
        return jax.lax.cond(operand[0] >= 0, compute, compute)  # either branch gives the same; XLA cannot tell which


@dataclasses.dataclass(frozen=True)
class CpuPlatform(Platform):
    name = "cpu"
    dtype = "float32"
    max_num_seqs = 64
    max_num_batched_tokens = 256
    kv_cache_memory_fraction = None  # a fixed budget (KV_CACHE_BYTES) unless asked for a share of free RAM
    gguf_quantization = "none"  # dequantized, a GGUF runs on the packed float32 matmul: 5x faster than XLA's dequantizing dot
    background_compile = False  # compiles take seconds here; and a step's bucket then never depends on timing

    def prepare(self, config: EngineConfig) -> None:
        """Tune malloc before XLA's threads first allocate; build the native kernels while the model loads."""
        tune_malloc()
        if config.attention_backend in ("auto", "native"):
            cpu_attention.start_build()
        if config.matmul_backend in ("auto", "native") and config.dtype == "float32" and config.tensor_parallel_size == 1:
            cpu_matmul.start_build()

    def attention_backend(self, requested: str, head_dim: int, batch_invariant: bool = False) -> AttentionBackend:
        if requested == "pallas":  # the GPU kernel, interpreted: for tests
            check_pallas_head_dim(head_dim)
            return TritonAttention(interpret=True)
        if requested == "native" and not cpu_attention.available():
            raise ValueError("attention_backend='native' is the CPU kernel, and it could not be built (see the warning above)")
        if requested in ("auto", "native") and not batch_invariant and cpu_attention.available():
            return cpu_attention.NativeCpuAttention()
        return ReferenceAttention(batch_invariant)

    def expert_loop(self, moe_kernel: str):
        """moe_kernel="triton": the GPU's grouped-GEMM kernel in Pallas' interpret mode (slow; for tests)."""
        if moe_kernel == "triton":
            from jaxpaged.models.moe import GroupedGemmExperts

            return GroupedGemmExperts(interpret=True)
        return super().expert_loop(moe_kernel)

    def kv_storage_dtype(self, dtype) -> jnp.dtype:
        """16-bit floats as uint16 bits: XLA:CPU turns a 16-bit scatter into a float32 round trip of the whole
        cache, while integer scatters stay in place (readers reinterpret only the blocks they gather)."""
        if jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return jnp.dtype(jnp.uint16)
        return jnp.dtype(dtype)

    def prepare_model(self, model: nnx.Module, matmul_backend: str, *, dtype, tensor_parallel_size: int,
                      moe_kernel: str = "loop") -> str:  # fmt: skip
        if isinstance(model, CausalLM) and tensor_parallel_size == 1:  # partitioned, the conditional lost its shards
            model.shared = ComputedOnce()
        self.prepare_experts(model, moe_kernel)
        backend = cpu_matmul.resolve_matmul_backend(
            matmul_backend, platform=self.name, dtype=dtype, tensor_parallel_size=tensor_parallel_size
        )
        head = _tied_head(model)
        if backend == "native":
            logger.info("matmuls: native CPU kernel, %d weights packed into panels", pack_for_cpu_matmul(model))
        elif jnp.dtype(dtype) != jnp.float32 and head is not None and type(head.method) is DenseEmbedding:  # not quantized
            head.output_kernel = nnx.Param(jnp.asarray(head.embedding[...].T))  # the table's size again in memory
            head.method = TransposedHead()
        return backend

    def device_memory(self, device) -> tuple[int | None, bool]:
        return available_host_memory(), True  # the host's, shared by CPU devices

    def num_kv_blocks(self, config: EngineConfig, *, block_bytes: int, weight_bytes: int, table_width: int,
                      reserved_bytes: int = 0) -> int:  # fmt: skip
        budget = KV_CACHE_BYTES
        if config.kv_cache_memory_fraction is not None:
            budget = int(config.kv_cache_memory_fraction * available_host_memory())
        enough = config.max_num_seqs * table_width  # every sequence at full length
        blocks = budget // block_bytes
        if config.kv_cache_memory_fraction is not None:
            blocks = steady_block_count(blocks)
        return max(1, min(blocks, enough))


def available_host_memory(meminfo: str = "/proc/meminfo") -> int:
    """Bytes the host can give without swapping: Linux's MemAvailable, free pages plus the page cache it can drop.
    Free pages alone (sysconf's count, the fallback elsewhere) leave that cache out, and a machine that has read
    many files shows little free memory while most of it is available."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _tied_head(model: nnx.Module) -> Embedding | None:
    head = getattr(model, "embed_tokens", None)
    return head if getattr(model, "lm_head", True) is None and isinstance(head, Embedding) else None


def pack_for_cpu_matmul(model: nnx.Module) -> int:
    """Repack, in place, every float32 Linear's kernel, every 8-bit per-channel one (ChannelLinear: int8, fp8) and a
    tied head's table into cpu_matmul's panels, so each step streams every weight once; the count packed. In place,
    so the weights are never held twice."""
    count = 0
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Linear) and module.kernel[...].ndim == 2:
            method = _packed_method(module)
            if method is not None:
                module.kernel = nnx.Param(cpu_matmul.pack(module.kernel[...]))
                module.method = method
                count += 1
    head = _tied_head(model)
    if head is not None and head.embedding[...].ndim == 2 and head.embedding[...].dtype == jnp.float32:
        head.embedding = nnx.Param(cpu_matmul.pack_rows(head.embedding[...]))
        head.method = cpu_matmul.PackedEmbedding()
        count += 1
    return count


def _packed_method(linear: Linear):
    """The method a Linear's kernel takes once packed: float32 kernels PackedLinear, 8-bit per-channel ones
    PackedChannelLinear (decoded in the kernel, where XLA:CPU writes the float weight out every step); None for
    any other (16-bit, grouped, 8-bit-activation) kernel, which stays as it is."""
    dtype = linear.kernel[...].dtype
    if type(linear.method) is DenseLinear and dtype == jnp.float32:
        return cpu_matmul.PackedLinear()
    if linear.method == ChannelLinear() and dtype in cpu_matmul.SCALED_DTYPES and linear.scale[...].ndim == 1:
        return cpu_matmul.PackedChannelLinear()
    return None

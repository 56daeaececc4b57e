"""A Platform holds every decision that depends on the device kind. The engine picks one when it starts
(platforms.get); the runner, the loader and the models receive what it decided and never ask which device
they are on."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.pallas_kernels.backends import AttentionBackend, ReferenceAttention, check_pallas_head_dim

if TYPE_CHECKING:
    from jaxpaged.config import EngineConfig


@dataclasses.dataclass(frozen=True)
class Platform:
    name: ClassVar[str]
    # EngineConfig's defaults on this platform
    dtype: ClassVar[str] = "bfloat16"
    max_num_seqs: ClassVar[int] = 256
    max_num_batched_tokens: ClassVar[int] = 2048
    kv_cache_memory_fraction: ClassVar[float | None] = 0.9
    background_compile: ClassVar[bool] = True  # EngineConfig.background_compile's default
    fp8_dot_operands: ClassVar[str] = "bfloat16"  # W8A8 fp8 dots: widened to bfloat16, or "float8" (fp8 units)
    gguf_quantization: ClassVar[str] = "gguf"  # a GGUF's weights stay quantized: memory is what runs out first
    # whether a lax.cond on device data runs on the device; XLA:GPU copies the predicate to the host and waits for
    # the stream, so there the step's executables hold no cond (worker/sampler_plans.py)
    device_conditionals: ClassVar[bool] = True
    # whether the KV pool, sized from free device memory, leaves room for the largest sampler's temporaries
    reserve_step_workspace: ClassVar[bool] = False

    def prepare(self, config: EngineConfig) -> None:
        """Process-wide set-up when an engine starts here, before it loads anything."""

    def attention_backend(self, requested: str, head_dim: int, batch_invariant: bool = False) -> AttentionBackend:
        """Resolve config.attention_backend for a model with this head dim; a ValueError naming it if impossible."""
        raise NotImplementedError

    def kv_storage_dtype(self, dtype) -> jnp.dtype:
        """The KV array's element type for a model computing in `dtype`."""
        return jnp.dtype(dtype)

    def prepare_model(self, model: nnx.Module, matmul_backend: str, *, dtype, tensor_parallel_size: int,
                      moe_kernel: str = "loop") -> str:  # fmt: skip
        """Lay the loaded weights out, in place, for this device's matmuls (and its MoE layers' expert loop, for
        config.moe_kernel); the matmul path taken."""
        if matmul_backend == "native":
            raise ValueError(f"matmul_backend='native' is the packed float32 CPU matmul, and this is {self.name}")
        self.prepare_experts(model, moe_kernel)
        return "xla"

    def expert_loop(self, moe_kernel: str):
        """The ExpertLoop a MoE layer runs for config.moe_kernel; None: the layer's own (the loop over the experts in
        use, with a traced trip count)."""
        if moe_kernel == "triton":
            raise ValueError(f"moe_kernel='triton' is the GPU's grouped GEMM (Pallas Triton), and this is {self.name}")
        if not self.device_conditionals:  # a MoE's loop over the experts in use would read its count back each layer
            from jaxpaged.models.moe import StaticExpertTiles

            return StaticExpertTiles()
        return None

    def keeps_mxfp4(self, moe_kernel: str) -> bool:
        """Whether an MXFP4 checkpoint's experts (GPT-OSS) load kept 4-bit for config.moe_kernel: where the expert
        loop reads them (the grouped-GEMM kernel, moe_kernel="triton": a GPU's compiled, a CPU's interpreted); else
        they are dequantized once at load (models/mxfp4.py). The engine asks before loading (load_model's moe_kernel),
        so the loader and the model never ask which device they are on."""
        return bool(getattr(self.expert_loop(moe_kernel), "reads_mxfp4", False))

    def prepare_experts(self, model: nnx.Module, moe_kernel: str) -> None:
        loop = self.expert_loop(moe_kernel)
        if loop is not None:
            from jaxpaged.models.moe import use_expert_loop

            use_expert_loop(model, loop)

    def num_kv_blocks(self, config: EngineConfig, *, block_bytes: int, weight_bytes: int, table_width: int,
                      reserved_bytes: int = 0) -> int:  # fmt: skip
        """How many KV blocks to allocate when config.num_kv_blocks does not say (block_bytes: all devices';
        reserved_bytes: what the step's executables need besides, on one device)."""
        raise NotImplementedError

    def device_memory(self, device) -> tuple[int | None, bool]:
        """(bytes an engine may use on one device, None if unknown; whether all devices share them, as CPU ones do)."""
        stats = device.memory_stats() or {}
        return stats.get("bytes_limit"), False


def steady_block_count(blocks: int) -> int:
    """A pool size measured from free memory, rounded down to a coarse step (at most 1/64 of it): free memory moves
    by a few MB between starts, and the pool's size is part of every step's compiled shape, so an unrounded count
    would miss the executables a previous start stored (seen on an H200: 188,983 then 189,012 blocks)."""
    step = 1 << max(0, blocks.bit_length() - 7)
    return blocks // step * step


@dataclasses.dataclass(frozen=True)
class AcceleratorPlatform(Platform):
    """GPU and TPU: a Pallas kernel where it takes the head dim, and the KV pool sized from device memory."""

    def kernel(self) -> AttentionBackend:
        raise NotImplementedError

    def attention_backend(self, requested: str, head_dim: int, batch_invariant: bool = False) -> AttentionBackend:
        if requested == "native":
            raise ValueError(f"attention_backend='native' is the CPU kernel, and this is {self.name}")
        if requested == "pallas":
            check_pallas_head_dim(head_dim)
            return self.kernel()
        if requested == "auto":
            try:
                check_pallas_head_dim(head_dim)
                return self.kernel()  # batch-invariant already: a tile's keys are walked from its sequence's start
            except ValueError:
                pass
        return ReferenceAttention(batch_invariant)

    reserve_step_workspace = True

    def num_kv_blocks(self, config: EngineConfig, *, block_bytes: int, weight_bytes: int, table_width: int,
                      reserved_bytes: int = 0) -> int:  # fmt: skip
        stats = jax.devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit")
        if not limit:
            raise ValueError("cannot read this device's memory size; pass num_kv_blocks explicitly")
        n = config.devices_per_replica  # a block's bytes and the weights are spread over the TP x PP devices
        free = limit - stats.get("bytes_in_use", weight_bytes // n) - reserved_bytes
        return max(1, steady_block_count(int(config.kv_cache_memory_fraction * free) // (block_bytes // n)))

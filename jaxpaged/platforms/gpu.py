"""GPUs: the Triton paged-attention kernel, compiled, with launches sized for the GPU found."""

from __future__ import annotations

import dataclasses

import jax

from jaxpaged.pallas_kernels.backends import TritonAttention
from jaxpaged.platforms.interface import AcceleratorPlatform

# Shared memory a block may opt into, by compute capability (CUDA's programming guide, "Technical Specifications").
SHARED_MEMORY_KIB = {"7.0": 96, "7.5": 64, "8.0": 163, "8.6": 99, "8.7": 163, "8.9": 99, "9.0": 227, "10.0": 227,
                     "10.3": 227, "12.0": 99, "12.1": 99}  # fmt: skip


def _first_gpu():
    """The GPU every choice here is sized for: the first local one, None on a host without one (exporting)."""
    device = jax.devices()[0]
    return device if device.platform == "gpu" else None


def _shared_memory(device) -> int:
    """Bytes of shared memory a block may opt into on this GPU; 0 for a compute capability not in the table."""
    return SHARED_MEMORY_KIB.get(str(getattr(device, "compute_capability", "")), 0) * 1024


def _capability() -> tuple[int, ...] | None:
    """The first local GPU's compute capability, (major, minor); None without a GPU or when it cannot be read."""
    device = _first_gpu()
    if device is None:
        return None
    try:
        return tuple(int(v) for v in str(getattr(device, "compute_capability", "")).split(".")[:2])
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class GpuPlatform(AcceleratorPlatform):
    name = "gpu"
    device_conditionals = False  # a cond reads its predicate back: the forward's stalled the host 4.3 ms (H100)

    @property
    def dtype(self) -> str:
        """bfloat16 where the GPU has bfloat16 units (compute capability 8.0 and up: A100, L4, H100); float16 on older
        ones (T4, Colab's free GPU, and V100), whose tensor cores take float16 only."""
        capability = _capability()
        return "float16" if capability is not None and capability < (8, 0) else "bfloat16"

    @property
    def fp8_dot_operands(self) -> str:
        """float8 where the GPU has fp8 tensor cores (compute capability 8.9 and up), so XLA takes cuBLASLt's fp8
        GEMM: on an H100, 1.2-1.4x faster than the widened dot at 1-4k rows (docs/benchmarks.md)."""
        capability = _capability()
        return "float8" if capability is not None and capability >= (8, 9) else "bfloat16"

    def expert_loop(self, moe_kernel: str):
        """moe_kernel="triton": the grouped-GEMM kernel, compiled, sized for the first local GPU's shared memory;
        "loop": StaticExpertTiles (no cond, so no host wait)."""
        if moe_kernel != "triton":
            return super().expert_loop(moe_kernel)
        from jaxpaged.models.moe import GroupedGemmExperts

        device = _first_gpu()
        return GroupedGemmExperts(interpret=False, shared_memory=None if device is None else _shared_memory(device) or None)

    def kernel(self) -> TritonAttention:
        """Sized for the first local GPU; without one (exporting from a CPU host) the kernel's defaults hold."""
        device = _first_gpu()
        if device is None:
            return TritonAttention(interpret=False)
        return TritonAttention(interpret=False, num_cores=int(getattr(device, "core_count", 0) or 0), shared_memory=_shared_memory(device))

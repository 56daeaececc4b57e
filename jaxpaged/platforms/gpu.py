"""GPUs: the Triton paged-attention kernel, compiled, with launches sized for the GPU found."""

from __future__ import annotations

import dataclasses

import jax

from jaxpaged.pallas_kernels.backends import TritonAttention
from jaxpaged.platforms.interface import AcceleratorPlatform

# Shared memory a block may opt into, by compute capability (CUDA's programming guide, "Technical Specifications").
SHARED_MEMORY_KIB = {"7.0": 96, "7.5": 64, "8.0": 163, "8.6": 99, "8.7": 163, "8.9": 99, "9.0": 227, "10.0": 227,
                     "10.3": 227, "12.0": 99, "12.1": 99}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GpuPlatform(AcceleratorPlatform):
    name = "gpu"
    fp8_dot_operands = "float8"

    def kernel(self) -> TritonAttention:
        """Sized for the first local GPU; without one (exporting from a CPU host) the kernel's defaults hold."""
        device = jax.devices()[0]
        if device.platform != "gpu":
            return TritonAttention(interpret=False)
        kib = SHARED_MEMORY_KIB.get(str(getattr(device, "compute_capability", "")), 0)
        return TritonAttention(interpret=False, num_cores=int(getattr(device, "core_count", 0) or 0), shared_memory=kib * 1024)

"""GPUs: the Triton paged-attention kernel, compiled."""

from __future__ import annotations

import dataclasses

from jaxpaged.pallas_kernels.backends import TritonAttention
from jaxpaged.platforms.interface import AcceleratorPlatform


@dataclasses.dataclass(frozen=True)
class GpuPlatform(AcceleratorPlatform):
    name = "gpu"

    def kernel(self) -> TritonAttention:
        return TritonAttention(interpret=False)

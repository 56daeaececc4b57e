"""TPUs: the Mosaic paged-attention kernel, compiled."""

from __future__ import annotations

import dataclasses

from jaxpaged.pallas_kernels.backends import MosaicAttention
from jaxpaged.platforms.interface import AcceleratorPlatform


@dataclasses.dataclass(frozen=True)
class TpuPlatform(AcceleratorPlatform):
    name = "tpu"

    def kernel(self) -> MosaicAttention:
        return MosaicAttention(interpret=False)

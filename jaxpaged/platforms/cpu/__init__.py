"""The CPU platform and its native kernels (attention.cc, matmul.cc), compiled on first use."""

from jaxpaged.platforms.cpu.platform import CpuPlatform

__all__ = ["CpuPlatform"]

"""What depends on the device kind, chosen once when an engine starts: `get()` is the one place that asks JAX
which device this is."""

from __future__ import annotations

import jax

from jaxpaged.platforms.interface import Platform


def get(name: str | None = None) -> Platform:
    """The platform called `name` ("cpu", "gpu", "tpu"), or the one JAX runs on by default."""
    from jaxpaged.platforms.cpu import CpuPlatform
    from jaxpaged.platforms.gpu import GpuPlatform
    from jaxpaged.platforms.tpu import TpuPlatform

    name = name or jax.default_backend()
    for platform in (CpuPlatform, GpuPlatform, TpuPlatform):
        if platform.name == name:
            return platform()
    raise ValueError(f"platform must be one of cpu, gpu, tpu (got {name!r})")


__all__ = ["Platform", "get"]

"""The CPU platform's start: glibc malloc tuned for XLA:CPU's temporaries, the native kernels built beside loading."""

from __future__ import annotations

from jaxpaged.config import EngineConfig
from jaxpaged.platforms.cpu import attention as cpu_attention
from jaxpaged.platforms.cpu import matmul as cpu_matmul
from jaxpaged.platforms.cpu.host_malloc import tune_malloc


def prepare(config: EngineConfig) -> None:
    """Run when an engine starts on the CPU, before it loads weights or runs anything (so before XLA's threads
    first allocate); the native kernels' first build then runs in the background while the model loads."""
    tune_malloc()
    if config.attention_backend in ("auto", "native"):
        cpu_attention.start_build()
    if config.matmul_backend in ("auto", "native") and config.dtype == "float32" and config.tensor_parallel_size == 1:
        cpu_matmul.start_build()

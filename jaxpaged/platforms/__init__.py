"""What depends on the device kind, chosen once when an engine starts."""

from __future__ import annotations

from jaxpaged.config import EngineConfig


def prepare(config: EngineConfig) -> None:
    """Process-wide set-up for the platform the engine runs on (`import jaxpaged` itself changes nothing)."""
    if config.platform == "cpu":
        from jaxpaged.platforms import cpu

        cpu.prepare(config)

"""The GPU platform's choices that depend on the card, with the card faked: these run on any host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxpaged.platforms import gpu


@pytest.mark.parametrize("platform,capability,expected", [
    ("gpu", "9.0", "float8"),  # H100/H200: fp8 tensor cores
    ("gpu", "8.9", "float8"),  # L4, RTX 40xx (Ada)
    ("gpu", "12.0", "float8"),
    ("gpu", "8.0", "bfloat16"),  # A100: no fp8 units, widened to bfloat16
    ("gpu", "7.5", "bfloat16"),  # T4
    ("gpu", "", "bfloat16"),  # capability unknown
    ("cpu", "", "bfloat16"),  # exporting from a host without a GPU
])  # fmt: skip
def test_w8a8_fp8_dots_take_fp8_operands_only_where_the_gpu_has_fp8_units(monkeypatch, platform, capability, expected):
    device = SimpleNamespace(platform=platform, compute_capability=capability)
    monkeypatch.setattr(gpu.jax, "devices", lambda *a: [device])
    assert gpu.GpuPlatform().fp8_dot_operands == expected

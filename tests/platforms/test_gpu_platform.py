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
    monkeypatch.setattr(gpu, "_first_gpu", lambda: device if platform == "gpu" else None)
    assert gpu.GpuPlatform().fp8_dot_operands == expected


@pytest.mark.parametrize("platform,capability,expected", [
    ("gpu", "7.5", "float16"),  # T4 (Colab's free GPU): no bfloat16 units
    ("gpu", "7.0", "float16"),  # V100
    ("gpu", "8.0", "bfloat16"),  # A100
    ("gpu", "8.9", "bfloat16"),  # L4
    ("gpu", "9.0", "bfloat16"),  # H100/H200
    ("gpu", "", "bfloat16"),  # capability unknown
    ("cpu", "", "bfloat16"),  # exporting from a host without a GPU
])  # fmt: skip
def test_the_default_dtype_is_float16_where_the_gpu_has_no_bfloat16(monkeypatch, platform, capability, expected):
    device = SimpleNamespace(platform=platform, compute_capability=capability)
    monkeypatch.setattr(gpu, "_first_gpu", lambda: device if platform == "gpu" else None)
    assert gpu.GpuPlatform().dtype == expected


def test_a_pool_sized_from_free_memory_keeps_its_size_when_free_memory_moves_a_little(monkeypatch):
    """The pool's size is part of every compiled step: two starts whose free memory differs by a few MB (seen on an
    H200: 188,983 and 189,012 blocks) must size it alike, or the second misses the executables the first stored."""
    from jaxpaged.platforms.interface import steady_block_count

    config = SimpleNamespace(kv_cache_memory_fraction=0.9, devices_per_replica=1)
    block_bytes = 16 * 32 * 1024  # Llama-3.2-1B's 32.8 kB a token, 16 tokens a block
    counts = set()
    for in_use in (2_600_000_000, 2_630_000_000, 2_601_000_000):
        stats = {"bytes_limit": 105_000_000_000, "bytes_in_use": in_use}
        monkeypatch.setattr(gpu.jax, "devices", lambda *a, s=stats: [SimpleNamespace(memory_stats=lambda: s)])
        counts.add(gpu.GpuPlatform().num_kv_blocks(config, block_bytes=block_bytes, weight_bytes=0, table_width=129))
    (count,) = counts
    exact = int(0.9 * (105_000_000_000 - 2_600_000_000)) // block_bytes
    assert exact * 63 / 64 <= count <= exact
    for n in (1, 100, 127, 128, 5000, 188_983, 2**20 + 7):
        assert n * 63 / 64 <= steady_block_count(n) <= n


def test_the_pool_leaves_the_reserved_workspace_free(monkeypatch):
    """The H100's 80 GB: with the pool at 0.9 of free memory the 256-row sampler's 5.9 GB of temporaries did not
    fit; the reserved workspace comes off free memory before the fraction is taken."""
    config = SimpleNamespace(kv_cache_memory_fraction=0.9, devices_per_replica=1)
    block_bytes = 16 * 32 * 1024
    stats = {"bytes_limit": 81_000_000_000, "bytes_in_use": 2_500_000_000}
    monkeypatch.setattr(gpu.jax, "devices", lambda *a: [SimpleNamespace(memory_stats=lambda: stats)])
    platform = gpu.GpuPlatform()
    plain = platform.num_kv_blocks(config, block_bytes=block_bytes, weight_bytes=0, table_width=129)
    kept = platform.num_kv_blocks(config, block_bytes=block_bytes, weight_bytes=0, table_width=129, reserved_bytes=6_300_000_000)
    left = stats["bytes_limit"] - stats["bytes_in_use"] - kept * block_bytes
    assert kept < plain and left >= 6_300_000_000 + 0.1 * (stats["bytes_limit"] - stats["bytes_in_use"] - 6_300_000_000)
    assert gpu.GpuPlatform.reserve_step_workspace and not gpu.GpuPlatform.device_conditionals

"""EngineConfig refuses bad values before any model loads, naming the field; the pool is sized as documented."""

from __future__ import annotations

import pytest

from jaxpaged.config import EngineConfig


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_size", 0),
        ("block_size", 24),  # not a power of two
        ("max_num_seqs", -1),
        ("max_num_batched_tokens", 1.5),
        ("num_kv_blocks", 0),
        ("max_model_len", True),
        ("kv_cache_memory_fraction", 1.5),
        ("kv_cache_memory_fraction", 0.0),
        ("attention_backend", "cuda"),
        ("seed", -3),
        ("tensor_parallel_size", 0),
        ("dtype", "int8"),
    ],
)
def test_bad_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_token_budget_must_cover_every_running_sequence():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)


def test_platform_defaults():
    cpu = EngineConfig(platform="cpu")
    assert (cpu.dtype, cpu.max_num_seqs, cpu.max_num_batched_tokens, cpu.kv_cache_memory_fraction) == (
        "float32", 64, 256, None
    )
    gpu = EngineConfig(platform="gpu")
    assert (gpu.dtype, gpu.max_num_seqs, gpu.max_num_batched_tokens, gpu.kv_cache_memory_fraction) == (
        "bfloat16", 256, 2048, 0.9
    )
    assert EngineConfig(dtype="bf16").dtype == "bfloat16"

"""The compiled kernel equals the definition on a GPU or TPU: tests/attention_cases.py's ACCELERATOR_CASES (f32 and
bf16, GQA 1/4/8, windows, soft-caps, ALiBi, chunked local attention, block sizes 16-128, head dims 64/128/256), the list
scripts/check_accelerator.py checks too. Skipped elsewhere, where tests/kernels/test_pallas_attention.py runs the
kernels interpreted; what runs here on a CPU is that the list covers what it promises."""

from __future__ import annotations

import pytest
from jaxpaged import platforms

from tests.attention_cases import ACCELERATOR_CASES, SMOKE_CASES, compare_kernel

DEVICES = [pytest.param("gpu", marks=pytest.mark.gpu), pytest.param("tpu", marks=pytest.mark.tpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ACCELERATOR_CASES, ids=lambda c: c.name)
def test_compiled_kernel_equals_definition(device, case):
    backend = platforms.get().attention_backend("pallas", case.head_dim)
    assert backend.interpret is False  # compiled for this device
    result = compare_kernel(backend, case)
    assert result["passed"], result


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("case", ACCELERATOR_CASES, ids=lambda c: c.name)
def test_compiled_kernel_over_a_quantized_cache_equals_definition(device, case, kv_cache_dtype):
    """The same cases over an int8 or fp8 cache, against the definition over its dequantized values."""
    backend = platforms.get().attention_backend("pallas", case.head_dim)
    result = compare_kernel(backend, case, kv_cache_dtype)
    assert result["passed"], result


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_compare_kernel_runs_interpreted_here(kv_cache_dtype):
    """What the compiled checks run, on the CPU with the kernel interpreted: passes, and names the cache's dtype."""
    from jaxpaged.pallas_kernels import TritonAttention

    result = compare_kernel(TritonAttention(interpret=True), SMOKE_CASES[0], kv_cache_dtype)
    assert result["passed"], result
    assert result["case"].endswith("" if kv_cache_dtype == "auto" else f"-kv-{kv_cache_dtype}")


def test_accelerator_cases_cover_the_promised_features():
    cases = ACCELERATOR_CASES
    assert {c.dtype for c in cases} == {"float32", "bfloat16"}
    assert {c.num_heads // c.num_kv_heads for c in cases} >= {1, 4, 8}
    assert {c.block_size for c in cases} == {16, 32, 64, 128}
    assert {c.head_dim for c in cases} == {64, 128, 256}
    for dtype in ("float32", "bfloat16"):
        of = [c for c in cases if c.dtype == dtype]
        assert any(c.sliding_window for c in of) and any(c.soft_cap for c in of) and any(c.alibi for c in of), dtype
        assert any(c.chunk_size for c in of), dtype
        assert any(max(c.q_lens) == 1 for c in of) and any(q == n for c in of for q, n in zip(c.q_lens, c.seq_lens) if q > 1)
    assert len({c.name for c in cases + SMOKE_CASES}) == len(cases) + len(SMOKE_CASES)

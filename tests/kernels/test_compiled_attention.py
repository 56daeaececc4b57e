"""The compiled kernel equals the definition on a GPU or TPU: tests/attention_cases.py's ACCELERATOR_CASES (f32 and
bf16, GQA 1/4/8, windows, soft-caps, ALiBi, block sizes 16-128, head dims 64/128/256), the list
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


def test_accelerator_cases_cover_the_promised_features():
    cases = ACCELERATOR_CASES
    assert {c.dtype for c in cases} == {"float32", "bfloat16"}
    assert {c.num_heads // c.num_kv_heads for c in cases} >= {1, 4, 8}
    assert {c.block_size for c in cases} == {16, 32, 64, 128}
    assert {c.head_dim for c in cases} == {64, 128, 256}
    for dtype in ("float32", "bfloat16"):
        of = [c for c in cases if c.dtype == dtype]
        assert any(c.sliding_window for c in of) and any(c.soft_cap for c in of) and any(c.alibi for c in of), dtype
        assert any(max(c.q_lens) == 1 for c in of) and any(q == n for c in of for q, n in zip(c.q_lens, c.seq_lens) if q > 1)
    assert len({c.name for c in cases + SMOKE_CASES}) == len(cases) + len(SMOKE_CASES)

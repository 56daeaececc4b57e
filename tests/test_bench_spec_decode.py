"""scripts/bench_spec_decode.py's forced-copy workload: the cycles partition distinct tokens and every prompt is a
distinct lap of one, so the answer (each token's cycle successor) repeats the prompt."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_spec_decode  # noqa: E402


def test_copy_prompts_are_distinct_laps_of_disjoint_cycles():
    cycles = bench_spec_decode.copy_cycles(256, 40)
    assert len(cycles) == 6 and all(len(c) == 40 for c in cycles)
    flat = [t for c in cycles for t in c]
    assert len(set(flat)) == len(flat) and all(0 <= t < 256 for t in flat)
    successor = {c[i]: c[(i + 1) % len(c)] for c in cycles for i in range(len(c))}
    prompts = bench_spec_decode.copy_prompts(cycles, 64)
    assert len({tuple(p) for p in prompts}) == 64 and len({p[0] for p in prompts}) == 64
    for p in prompts:
        answer, tok = [], p[-1]
        for _ in range(len(p)):
            tok = successor[tok]
            answer.append(tok)
        assert answer == p

"""scripts/bench_spec_decode.py's forced-copy workload: the cycles partition distinct tokens and every prompt is a
distinct lap of one, so the answer (each token's cycle successor) repeats the prompt."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

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


def test_sides_name_one_speculative_config_per_k(tmp_path):
    specs = bench_spec_decode.spec_configs(["ngram", "draft-self", "draft-random", "draft:/some/draft"], [2, 4], "/target",
                                           300, 1024, tmp_path)  # fmt: skip
    assert list(specs) == ["ngram k=2", "ngram k=4", "draft-self k=2", "draft-self k=4", "draft-random k=2",
                           "draft-random k=4", "draft:/some/draft k=2", "draft:/some/draft k=4"]  # fmt: skip
    assert specs["ngram k=4"]["method"] == "ngram" and specs["draft-self k=2"]["model"] == "/target"
    assert specs["draft:/some/draft k=4"] == {"method": "draft_model", "model": "/some/draft", "num_speculative_tokens": 4}
    random_config = json.loads(Path(specs["draft-random k=2"]["model"]).read_text())
    assert random_config["vocab_size"] == 300 and random_config["max_position_embeddings"] >= 1024
    with pytest.raises(ValueError, match="copy workload"):
        bench_spec_decode.spec_configs(["draft-copy"], [2], "/target", 300, 1024, tmp_path)

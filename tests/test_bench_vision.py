"""scripts/bench_vision.py runs end to end on a tiny model: both sides, the encoder alone and the encoder cache's
effect, with greedy tokens equal between them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

pytest.importorskip("torch")
import bench_vision  # noqa: E402


def test_tiny_run_reports_both_sides_and_the_cache(tmp_path):
    out = tmp_path / "bench.json"
    result = bench_vision.main(["--tiny", "--num-requests", "3", "--max-tokens", "3", "--max-side", "112", "--batch-size", "2",
                                "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--json", str(out)])  # fmt: skip
    assert json.loads(out.read_text())["greedy_tokens_equal"] == "3/3" == result["greedy_tokens_equal"]
    jp = result["jaxpaged"]
    assert jp["distinct_images"]["images_encoded"] == 3 and jp["one_image_repeated"]["images_encoded"] == 1
    assert jp["encoder"]["images"] == 3 and jp["num_compiles_after_warmup"] == 0
    assert result["transformers"]["distinct_images"]["output_tokens"] == 9 and len(jp["load1"]) == 2
    held = jp["bytes_per_device"]  # one device holds the whole model here: the tower and the rest, every byte once
    assert held["vision"] > 0 and held["language"] > 0 and held["vision"] + held["language"] == held["model"]

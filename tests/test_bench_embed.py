"""scripts/bench_embed.py on a tiny Qwen3: both sides' figures land in the JSON and their embeddings agree; the
transformers side pools the last real token whichever side it pads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

torch = pytest.importorskip("torch")
import bench_embed  # noqa: E402


@pytest.mark.parametrize("side", ["right", "left"])
def test_last_token_pool_reads_each_prompts_last_token(side):
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12]]
    ids, mask = bench_embed.pad(prompts, side)
    assert ids.shape == mask.shape == (3, 4) and mask.sum().item() == 8
    pooled = bench_embed.last_token_pool(ids.unsqueeze(-1), mask)[:, 0]  # the ids stand in for hidden states
    assert pooled.tolist() == [7, 8, 12]


def test_length_batches_sort_by_length_and_keep_every_prompt():
    prompts = [[1] * n for n in (5, 2, 9, 3, 7)]
    assert bench_embed.length_batches(prompts, 2) == [[1, 3], [0, 4], [2]]


def test_tiny_run_records_the_figures_and_agreement(tmp_path):
    out = tmp_path / "embed.json"
    bench_embed.main(["--tiny", "--num-prompts", "6", "--min-len", "3", "--max-len", "64", "--batch-size", "4",
                      "--max-num-batched-tokens", "64", "--max-num-seqs", "4", "--settle-s", "0", "--no-calibrate",
                      "--json", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    tokens = report["workload"]["prompt_tokens"]
    assert report["workload"]["num_prompts"] == 6 and 6 * 3 <= tokens <= 6 * 64
    for side in ("jaxpaged", "transformers"):
        figures = report[side]
        assert figures["prompts"] == 6 and figures["prompt_tokens"] == tokens
        assert figures["seconds"] > 0 and figures["prompt_tok_s"] > 0 and figures["embeddings_per_s"] > 0
        assert set(figures["load"]["loadavg_1min"]) == {"before", "after"}
    assert report["transformers"]["padded_tokens"] >= tokens
    assert report["jaxpaged"]["compiles_during_run"] == 0 and report["jaxpaged"]["prefix_cache_hits_during_run"] == 0
    assert report["ratio"] == pytest.approx(report["jaxpaged"]["prompt_tok_s"] / report["transformers"]["prompt_tok_s"])
    assert report["agreement"]["agree"] and report["agreement"]["max_abs_diff"] < 1e-4
    assert report["model"]["num_hidden_layers"] == 2 and report["versions"]["transformers"]
    assert report["machine"]["cores"] >= 1 and len(report["loadavg_at_start"]) == 3

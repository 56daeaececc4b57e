"""scripts/bench_rl_rollout.py: the summary's ratio is vanilla's step time over jaxpaged's (medians), and a small run
(a random Tunix Llama 3) times both engines on the same work: every completion max_tokens long on each side."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_rl_rollout  # noqa: E402


def test_summary_ratio_is_vanilla_over_jaxpaged_step_time():
    row = lambda step, gen: {"generate_s": gen, "sync_s": step - gen, "step_s": step, "tok_s": 100 / gen, "tokens": 100}  # noqa: E731
    runs = {"jaxpaged": [row(1.0, 0.9), row(3.0, 2.9), row(2.0, 1.9)], "vanilla": [row(6.0, 6.0), row(8.0, 8.0)]}
    summary = bench_rl_rollout.summarize(runs)
    assert summary["sides"]["jaxpaged"]["step_s"] == pytest.approx(2.0)
    assert summary["sides"]["vanilla"]["step_s"] == pytest.approx(7.0)
    assert summary["ratio"] == pytest.approx(3.5)


def test_a_small_run_times_both_sides_on_the_same_work(tmp_path):
    pytest.importorskip("tunix", reason="google-tunix is not installed: pip install -e '.[rl]' (docs/rl.md)")
    from jaxpaged.models.builtin import builtin_gguf_path

    try:
        builtin_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(f"the benchmark uses the built-in model's tokenizer: {exc}")
    out = tmp_path / "rl.json"
    assert bench_rl_rollout.main(["--tiny", "--prompts", "2", "--generations", "2", "--max-tokens", "8", "--runs", "1",
                                  "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--json", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    sides = result["summary"]["sides"]
    assert sides["jaxpaged"]["tokens"] == sides["vanilla"]["tokens"] == 2 * 2 * 8
    assert result["summary"]["ratio"] > 0 and all(len(rows) == 1 for rows in result["runs"].values())

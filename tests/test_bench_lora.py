"""scripts/bench_lora.py's pieces: the run order shares noise between the sides, the ratio is the sides' summed
throughputs, and the adapters it writes are PEFT LoRAs of the asked rank and targets that the engine accepts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_lora  # noqa: E402


def test_run_order_alternates_so_each_side_meets_both_ends():
    assert bench_lora.run_order(1) == ["plain", "lora"]
    assert bench_lora.run_order(2) == ["plain", "lora", "lora", "plain"]
    order = bench_lora.run_order(4)
    assert order.count("plain") == order.count("lora") == 4
    assert sum(i for i, s in enumerate(order) if s == "plain") == sum(i for i, s in enumerate(order) if s == "lora")


def test_summary_ratio_is_summed_tokens_over_summed_seconds():
    runs = [{"side": "plain", "output_tokens": 100, "seconds": 1.0, "tok_s": 100.0, "cpu_s": 2.0},
            {"side": "lora", "output_tokens": 100, "seconds": 2.0, "tok_s": 50.0, "cpu_s": 2.5},
            {"side": "lora", "output_tokens": 100, "seconds": 1.0, "tok_s": 100.0, "cpu_s": 2.5},
            {"side": "plain", "output_tokens": 100, "seconds": 3.0, "tok_s": 100 / 3, "cpu_s": 2.0}]  # fmt: skip
    summary = bench_lora.summarize(runs)
    assert summary["sides"]["plain"]["tok_s"] == pytest.approx(200 / 4.0)
    assert summary["sides"]["lora"]["tok_s"] == pytest.approx(200 / 3.0)
    assert summary["ratio"] == pytest.approx((200 / 3.0) / (200 / 4.0))
    assert summary["ratio_per_pair"] == pytest.approx([0.5, 3.0])
    assert summary["cpu_ratio"] == pytest.approx(4.0 / 5.0)  # LoRA used 5 s of CPU for what plain did in 4


def test_engine_targets_default_to_the_adapters_own():
    args = bench_lora.parse_args([])
    assert args.targets == "q_proj,v_proj" and bench_lora.engine_targets(args) == "q_proj,v_proj"
    assert bench_lora.engine_targets(bench_lora.parse_args(["--lora-target-modules", "all"])) is None


def test_written_adapters_are_peft_loras_the_engine_loads(tmp_path):
    pytest.importorskip("peft")
    import transformers
    from jaxpaged.models import lora
    from jaxpaged.models.config import model_config_from_hf

    args = argparse.Namespace(seed=0, num_layers=1, vocab_size=256, targets="q_proj,v_proj", num_adapters=2, rank=16)
    base, adapters = bench_lora.write_models(tmp_path, args)
    cfg = model_config_from_hf(transformers.AutoConfig.from_pretrained(base), "LlamaForCausalLM")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (576, 1, 9, 3)
    loaded = [lora.load_adapter(f"a{i}", str(a), cfg, ("q_proj", "v_proj"), 16) for i, a in enumerate(adapters)]
    for adapter in loaded:
        assert adapter.rank == 16 and sorted(adapter.weights) == ["layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj"]
    a0, a1 = (adapter.weights["layers.0.self_attn.q_proj"][1] for adapter in loaded)
    assert abs(a0).max() > 0 and (a0 != a1).any()  # random, distinct B (PEFT would zero it by default)

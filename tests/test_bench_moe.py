"""scripts/bench_moe.py's model pair: the MoE and the dense model really have the same active parameters (counted on
the transformers models the configs describe, not by the script's own arithmetic), the router aside."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_moe  # noqa: E402


@pytest.mark.parametrize("experts,top_k", [(16, 2), (8, 2), (12, 3)])
def test_config_pair_has_equal_active_parameters(experts, top_k):
    torch = pytest.importorskip("torch")
    import transformers

    moe, dense = bench_moe.config_pair(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=experts,
                                       top_k=top_k, expert_size=24, vocab=256)  # fmt: skip
    models = {}
    for name, config in (("moe", moe), ("dense", dense)):
        config = dict(config)
        with torch.device("meta"):
            hf_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
            models[name] = transformers.AutoModelForCausalLM.from_config(hf_config)
    total = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    expert = 3 * 64 * 24  # gate, up and down of one expert
    router = sum(p.numel() for n, p in models["moe"].named_parameters() if n.endswith("mlp.gate.weight"))
    assert router == 2 * 64 * experts
    assert total["moe"] - 2 * (experts - top_k) * expert - router == total["dense"]
    counts = {"moe": bench_moe.parameter_counts(moe), "dense": bench_moe.parameter_counts(dense)}
    assert counts["moe"]["total"] == total["moe"] and counts["dense"]["total"] == total["dense"]
    assert counts["moe"]["active"] - counts["moe"]["router"] == counts["dense"]["active"] == total["dense"]
    assert dense["intermediate_size"] == top_k * moe["moe_intermediate_size"]


def test_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_moe.parse_args(["--help"])
    assert exit_.value.code == 0 and "--output-tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_moe.parse_args(["--experts", "2", "--top-k", "3"])


def test_prefill_mode_defaults_and_counts_prompt_tokens():
    """--prefill swaps the workload's defaults (explicit values still win) and times prompt tokens, not outputs."""
    import types

    decode, prefill = bench_moe.parse_args([]), bench_moe.parse_args(["--prefill", "--max-num-batched-tokens", "2048"])
    assert (decode.batch_sizes, decode.prompt_len, decode.output_tokens) == ([1, 16], 32, 256)
    assert (prefill.batch_sizes, prefill.prompt_len, prefill.output_tokens, prefill.max_num_batched_tokens) == ([8], 512, 1, 2048)
    assert bench_moe.parse_args(["--prefill", "--prompt-len", "64"]).prompt_len == 64

    class Engine:  # finishes every request in one step with one token
        def __init__(self):
            self.pending = 0

        def add_request(self, request_id, prompt, params):
            self.pending += 1

        def has_unfinished_requests(self):
            return self.pending > 0

        def step(self):
            done, self.pending = self.pending, 0
            return [types.SimpleNamespace(finished=True, outputs=[types.SimpleNamespace(token_ids=[7])])] * done

    llm = types.SimpleNamespace(engine=Engine())
    args = bench_moe.parse_args(["--prefill", "--prompt-len", "16", "--vocab", "64"])
    run = bench_moe.run_once(llm, args, 3, 1)
    assert (run["prompt_tokens"], run["output_tokens"], run["steps"]) == (48, 3, 1)
    assert run["tok_s"] == pytest.approx(48 / run["seconds"])

"""scripts/bench_hybrid.py on tiny shapes: a hybrid holds K/V only for its attention layers plus one fixed-size state
slot, a dense model K/V for every layer; the throughput run serves its requests without compiling after warm-up."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_hybrid  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=1)  # fmt: skip


def _hybrid() -> transformers.PretrainedConfig:
    return transformers.Qwen3_5TextConfig(
        **TINY, num_hidden_layers=8, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, architectures=["Qwen3_5ForCausalLM"],
    )


def _dense() -> transformers.PretrainedConfig:
    return transformers.Qwen3Config(**TINY, num_hidden_layers=8, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, architectures=["Qwen3ForCausalLM"])  # fmt: skip


def test_a_hybrid_holds_kv_for_its_attention_layers_and_one_state_slot():
    hybrid = [bench_hybrid.held_bytes(_hybrid(), c, 16, 64, 2) for c in (256, 1024)]
    dense = [bench_hybrid.held_bytes(_dense(), c, 16, 64, 2) for c in (256, 1024)]
    attention_layers = _hybrid().layer_types.count("full_attention")
    assert 0 < attention_layers < 8 and all(h["kv_layers"] == attention_layers for h in hybrid)
    assert all(d["kv_layers"] == 8 and d["state_bytes"] == 0 for d in dense)
    for h, d in zip(hybrid, dense):
        assert h["blocks"] == d["blocks"] == h["context"] // 16
        assert h["kv_bytes"] * 8 == d["kv_bytes"] * attention_layers  # the same K/V a layer, fewer layers
    assert hybrid[0]["state_bytes"] == hybrid[1]["state_bytes"] > 0  # the state does not grow with the context


def test_throughput_serves_every_request_without_compiling(tmp_path):
    _hybrid().save_pretrained(tmp_path)
    args = argparse.Namespace(num_requests=2, prompt_len=40, output_len=4, max_num_batched_tokens=16)
    result = bench_hybrid.throughput(str(tmp_path / "config.json"), args)
    assert result["compiles_after_warmup"] == 0 and len(result["first_token_s"]) == 2
    assert result["steps"] >= 40 // 16 and result["output_tok_s"] > 0

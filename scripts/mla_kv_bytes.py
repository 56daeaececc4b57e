"""KV bytes per token of MLA models (issue 48 step 2): the latent cache the engine allocates ([latent, k_pe] per token and
layer) against the same attention cached expanded (every head's K and V), for the released shapes, read from
transformers configs as the loader reads them. The latent's bytes are ModelRunner.block_bytes' formula (tests check the
engine's `get_stats()["kv_bytes_per_token"]` equals it); `--engine` also starts a tiny random DeepSeek-V3 and prints
what the engine reports.

    python scripts/mla_kv_bytes.py                 # a table: bfloat16 and fp8 latent caches, expanded bfloat16
    python scripts/mla_kv_bytes.py --engine
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax.numpy as jnp
import transformers
from jaxpaged.models.deepseek import DeepseekForCausalLM, MlaOptions
from jaxpaged.pallas_kernels.kv_quant import kv_bytes_per_token_head

SHAPES = {  # name: (architecture, config)
    "DeepSeek-V3 / R1 (671B)": ("DeepseekV3ForCausalLM", lambda: transformers.DeepseekV3Config()),
    "Kimi K2 (1T)": ("DeepseekV3ForCausalLM", lambda: transformers.DeepseekV3Config(num_attention_heads=64, n_routed_experts=384, n_group=1, topk_group=1)),
    "DeepSeek-V2 (236B)": ("DeepseekV2ForCausalLM", lambda: transformers.DeepseekV2Config(num_hidden_layers=60, num_attention_heads=128, n_routed_experts=160, num_experts_per_tok=6)),
    "DeepSeek-V2-Lite (16B)": ("DeepseekV2ForCausalLM", lambda: transformers.DeepseekV2Config(num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, num_experts_per_tok=6)),
    "Moonlight-16B-A3B": ("DeepseekV3ForCausalLM", lambda: transformers.DeepseekV3Config(num_hidden_layers=27, num_attention_heads=16, n_routed_experts=64, n_group=1, topk_group=1, num_experts_per_tok=6)),
}  # fmt: skip


def bytes_per_token(arch: str, hf_config, kv_cache_dtype: str = "auto", dtype=jnp.bfloat16) -> tuple[int, int]:
    """(the latent cache's bytes a token over every layer, as the engine sizes its pool; expanded K/V's in dtype)."""
    cfg = DeepseekForCausalLM.config_from_hf(hf_config, arch)
    mla = MlaOptions.of(cfg)
    latent = cfg.num_layers * 2 * cfg.num_kv_heads * kv_bytes_per_token_head(cfg.head_dim, kv_cache_dtype, dtype)
    expanded = cfg.num_layers * mla.expanded_width(cfg.num_heads) * jnp.dtype(dtype).itemsize
    return latent, expanded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", action="store_true", help="also start a tiny DeepSeek-V3 and print its report")
    parser.add_argument("--budget-gib", type=float, default=64.0, help="the KV budget the token counts fill (default 64 GiB)")
    args = parser.parse_args()
    budget = args.budget_gib * 2**30
    print(f"{'model':26} {'latent bf16':>12} {'latent fp8':>11} {'expanded bf16':>14} {'ratio':>7}"
          f" | tokens in {args.budget_gib:g} GiB: {'latent bf16':>11} {'latent fp8':>11} {'expanded':>9}")
    for name, (arch, make) in SHAPES.items():
        latent, expanded = bytes_per_token(arch, make())
        fp8, _ = bytes_per_token(arch, make(), "fp8")
        print(f"{name:26} {latent / 1024:9.1f} KiB {fp8 / 1024:7.1f} KiB {expanded / 1024:10.1f} KiB {expanded / latent:6.1f}x"
              f" | {'':>18}{budget // latent:>11,.0f} {budget // fp8:>11,.0f} {budget // expanded:>9,.0f}")
    if args.engine:
        import tempfile

        from jaxpaged import LLM

        config = transformers.DeepseekV3Config(
            vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24,
            qk_nope_head_dim=32, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
        )  # fmt: skip
        with tempfile.TemporaryDirectory() as folder:
            config.architectures = ["DeepseekV3ForCausalLM"]
            config.save_pretrained(folder)
            llm = LLM(str(Path(folder) / "config.json"), dtype="bfloat16", max_num_seqs=2, log_level="WARNING")
            reported = llm.get_stats()["kv_bytes_per_token"]
        latent, expanded = bytes_per_token("DeepseekV3ForCausalLM", config)
        print(f"tiny DeepSeek-V3 engine: {reported} bytes a token reported, {latent} by the formula, {expanded} expanded")


if __name__ == "__main__":
    main()

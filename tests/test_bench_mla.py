"""scripts/mla_kv_bytes.py (issue 48 step 5): the latent cache's bytes a token against MLA expanded, for the released
shapes. The expanded bytes are counted here from transformers' own config fields (every head's K and V), the latent's
are what a started engine reports, and docs/benchmarks.md's table is what the script computes."""

from __future__ import annotations

import sys
from pathlib import Path

import transformers

from tests import REPO

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import mla_kv_bytes  # noqa: E402

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24,
            qk_nope_head_dim=32, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2)  # fmt: skip


def test_latent_and_expanded_bytes_from_the_config_fields():
    for arch, make in mla_kv_bytes.SHAPES.values():
        hf = make()
        latent, expanded = mla_kv_bytes.bytes_per_token(arch, hf)
        k = hf.num_attention_heads * (hf.qk_nope_head_dim + hf.qk_rope_head_dim)
        v = hf.num_attention_heads * hf.v_head_dim
        assert expanded == hf.num_hidden_layers * (k + v) * 2  # bfloat16
        assert latent == hf.num_hidden_layers * (hf.kv_lora_rank + hf.qk_rope_head_dim) * 2
        fp8, _ = mla_kv_bytes.bytes_per_token(arch, hf, "fp8")
        assert latent // 2 < fp8 < latent  # a byte a value, plus the scales
    v3 = mla_kv_bytes.bytes_per_token("DeepseekV3ForCausalLM", transformers.DeepseekV3Config())
    assert v3 == (61 * 576 * 2, 61 * 128 * (192 + 128) * 2)


def test_the_engine_reports_the_latent_bytes(tmp_path):
    """A tiny DeepSeek-V3 from a bare config.json (random weights), as `--engine` starts it: get_stats() reports
    the formula's bytes a token, in bfloat16 and float32."""
    from jaxpaged import LLM

    config = transformers.DeepseekV3Config(**TINY)
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(tmp_path)
    for dtype, size in (("bfloat16", 2), ("float32", 4)):
        llm = LLM(str(tmp_path / "config.json"), dtype=dtype, max_num_seqs=2, num_kv_blocks=16, log_level="WARNING")
        reported = llm.get_stats()["kv_bytes_per_token"]
        del llm
        assert reported == 2 * (32 + 16) * size
    assert mla_kv_bytes.bytes_per_token("DeepseekV3ForCausalLM", config)[0] == 2 * (32 + 16) * 2


def _docs_rows() -> dict[str, list[str]]:
    text = (REPO / "docs" / "benchmarks.md").read_text()
    section = text.split("## MLA's latent cache against MLA expanded", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| ")]
    return {r[0]: r[1:] for r in rows[2:]}  # after the header and its rule


def test_the_docs_table_is_what_the_script_computes():
    rows = _docs_rows()
    budget = 64 * 2**30
    names = {"DeepSeek-V3 / R1 (61 layers, 128 heads)": ["DeepSeek-V3 / R1 (671B)"], "Kimi K2 (64 heads)": ["Kimi K2 (1T)"],
             "DeepSeek-V2 (60 layers)": ["DeepSeek-V2 (236B)"],
             "DeepSeek-V2-Lite, Moonlight-16B-A3B (27 layers, 16 heads)": ["DeepSeek-V2-Lite (16B)", "Moonlight-16B-A3B"]}  # fmt: skip
    assert set(rows) == set(names)
    for row, shapes in names.items():
        for shape in shapes:
            arch, make = mla_kv_bytes.SHAPES[shape]
            latent, expanded = mla_kv_bytes.bytes_per_token(arch, make())
            fp8, _ = mla_kv_bytes.bytes_per_token(arch, make(), "fp8")
            want = [f"{latent / 1024:.1f} KiB", f"{fp8 / 1024:.1f} KiB", f"{expanded / 1024:,.0f} KiB" if expanded % 1024 == 0
                    else f"{expanded / 1024:,.1f} KiB", f"{expanded / latent:.1f}x",
                    f"{budget // latent:,}", f"{budget // fp8:,}", f"{budget // expanded:,}"]  # fmt: skip
            assert rows[row] == want, (row, shape)

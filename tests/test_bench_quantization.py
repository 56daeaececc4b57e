"""scripts/bench_quantization.py end to end on a tiny random Llama: every scheme asked for is one row with its weight
bytes, KV tokens and quality against the reference, and the JSON is written after each scheme."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_quantization  # noqa: E402


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    config = json.loads((SCRIPTS / "data" / "llama_random_config.json").read_text())
    config.update(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)  # fmt: skip
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_schemes_side_by_side(tiny_config, tmp_path, capsys):
    out = tmp_path / "q.json"
    argv = ["--model", str(tiny_config), "--reference", "bfloat16", "--dtype", "bfloat16", "--schemes", "int8,kv-int8,kv-fp8",
            "--num-requests", "4", "--min-len", "8", "--max-len", "16", "--agree-prompts", "2", "--agree-tokens", "8",
            "--window-tokens", "64", "--max-num-batched-tokens", "32", "--max-num-seqs", "4", "--settle-s", "0", "--json", str(out)]  # fmt: skip
    assert bench_quantization.main(argv) == 0
    rows = {r["scheme"]: r for r in json.loads(out.read_text())["schemes"]}
    assert list(rows) == ["bfloat16", "int8", "kv-int8", "kv-fp8"]  # the reference first
    ref = rows["bfloat16"]
    assert rows["int8"]["weight_bytes"] < ref["weight_bytes"] and rows["int8"]["kv_tokens"] == ref["kv_tokens"]
    head_dim = 32  # 128 / 4 heads: 8-bit K/V take head_dim + 4 bytes against bfloat16's 2 x head_dim
    for kv in ("kv-int8", "kv-fp8"):
        assert rows[kv]["weight_bytes"] == ref["weight_bytes"]
        assert rows[kv]["kv_tokens"] / ref["kv_tokens"] == pytest.approx(2 * head_dim / (head_dim + 4), rel=0.01)
    for name, row in rows.items():
        assert row["tok_s"] > 0 and row["perplexity"] > 1
        if name != "bfloat16":
            assert 0 < row["mean_abs_logprob_diff"] < 0.5 and 0 <= row["agreement"]["identical_share"] <= 1
    assert "kv-fp8" in capsys.readouterr().out.splitlines()[-1]  # the table after the last scheme


def test_matmuls_time_the_native_8bit_methods_on_cpu():
    """--matmuls on the CPU: XLA's methods and, where the native matmul builds, its float32, int8 and fp8 panels."""
    import jax

    from jaxpaged.platforms.cpu import matmul as cpu_matmul

    results = bench_quantization.time_matmuls(64, 40, rows=(1, 13), iters=2)
    methods = {r["method"] for r in results if "ms" in r}
    assert {"float32", "int8 weight-only", "fp8 weight-only"} <= methods
    dots = {r["method"]: r["dots"] for r in results if r["rows"] == 13}
    assert dots["int8 dot (W8A8)"] == ["s8 x s8"] and dots["int8 weight-only"] == ["f32 x f32"]  # XLA:CPU widens it
    native = {"native float32", "native int8", "native fp8"}
    if jax.default_backend() == "cpu" and cpu_matmul.available():
        assert native <= methods
        assert dots["native int8"] == ["f32 x s8 (jaxpaged_packed_matmul_cpu_scaled)"]
    else:
        assert not native & methods


def test_dot_operand_types_reads_a_gpu_gemm_and_a_fused_dot():
    """The HLO forms the check meets: a cuBLASLt fp8 GEMM (a tuple result, operands printed with their shapes) and a
    dot inside a fusion (operands by name, their types where they are defined)."""
    hlo = """
  %p.1 = f8e4m3fn[16,64]{1,0} parameter(0)
  %cublas-gemm.1 = (bf16[16,32]{1,0}, s8[4194304]{0}) custom-call(f8e4m3fn[16,64]{1,0} %p.1, f8e4m3fn[64,32]{0,1} %p.2, f32[] %c.1, f32[] %c.2), custom_call_target="__cublas$lt$matmul$f8", backend_config={}
  %param_0.3 = s8[4,64]{1,0} parameter(0)
  %param_1.4 = s8[64,32]{1,0} parameter(1)
  ROOT %dot.0 = s32[4,32]{1,0} dot(%param_0.3, %param_1.4), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %other = f32[4]{0} custom-call(f32[4]{0} %x), custom_call_target="SomethingElse"
"""
    assert bench_quantization.dot_operand_types(hlo) == ["f8e4m3fn x f8e4m3fn (__cublas$lt$matmul$f8)", "s8 x s8"]


def test_random_weights_are_written_once_as_the_folder_every_scheme_loads(tiny_config, tmp_path):
    """A config.json is exported to an HF folder of the random weights loading it makes: the same floats, so an
    engine on the folder gives the config's engine's greedy tokens, and the shape is read from its config.json."""
    from jaxpaged import LLM, SamplingParams

    folder, gguf = bench_quantization.sources(str(tiny_config), tmp_path)
    assert gguf is None and (Path(folder) / "model.safetensors").exists()
    assert bench_quantization.model_shape(folder, {}).num_layers == 2
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": [11, 12, 13, 14, 15]}]
    tokens = [list(LLM(model=m, max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=16).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
              for m in (str(tiny_config), folder)]  # fmt: skip
    assert tokens[0] == tokens[1]

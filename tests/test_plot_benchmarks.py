"""scripts/plot_benchmarks.py and jaxpaged/plots.py on small hand-made reports in the benchmark scripts' format."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from jaxpaged.plots import BenchmarkDataError, load_report, output_speed_points, plot_output_speed, serving_points

REPO = Path(__file__).resolve().parent.parent
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

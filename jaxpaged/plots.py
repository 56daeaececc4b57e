"""Benchmark figures from the JSON of scripts/bench_throughput.py and scripts/bench_serving.py.

Plain functions (report in, PNG out), so scripts/plot_benchmarks.py and the quickstart notebook draw
the same figures. matplotlib is imported inside them: it is a dev extra, not a dependency of the engine.
Figures render with the Agg backend on a bare `Figure`, so a notebook's pyplot state is left alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

LABELS = {
    "jaxpaged": "jaxpaged",
    "hf-single": "transformers, one request at a time",
    "hf-batch": "transformers, static batches",
    "transformers": "transformers server (generate behind a lock)",
}
COLORS = {"jaxpaged": "tab:blue", "hf-single": "tab:red", "hf-batch": "tab:orange", "transformers": "tab:red"}


class BenchmarkDataError(ValueError):
    """A report that is not JSON or lacks what a figure needs; the message names the file and the field."""


def load_report(path: str | Path) -> dict:
    """Read one benchmark JSON; remembers its path (as `_source`) for error messages."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except OSError as exc:
        raise BenchmarkDataError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise BenchmarkDataError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("results"), dict):
        raise BenchmarkDataError(f"{path}: not a benchmark report (a JSON object with a 'results' object expected)")
    return report | {"_source": str(path)}


def _field(report: dict, obj, *keys):
    """obj[k1][k2]...; a clear BenchmarkDataError when a key is missing or a value has the wrong type."""
    for key in keys:
        if not isinstance(obj, dict) or key not in obj:
            where = report.get("_source", "benchmark report")
            raise BenchmarkDataError(f"{where}: missing field {'.'.join(map(str, keys))!r}")
        obj = obj[key]
    return obj


def _number(report: dict, obj, *keys) -> float:
    value = _field(report, obj, *keys)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        where = report.get("_source", "benchmark report")
        raise BenchmarkDataError(f"{where}: field {'.'.join(map(str, keys))!r} must be a number (got {value!r})")
    return float(value)


def output_speed_points(report: dict) -> dict[str, list[tuple[int, float]]]:
    """{system: [(output length, output tok/s)]} from a bench_throughput.py --output-lens report."""
    sweep = report.get("output_len_sweep")
    if not isinstance(sweep, list) or not sweep:
        where = report.get("_source", "benchmark report")
        raise BenchmarkDataError(
            f"{where}: no 'output_len_sweep' list; run scripts/bench_throughput.py with --output-lens 32,64,128"
        )
    points: dict[str, list[tuple[int, float]]] = {}
    for entry in sweep:
        length = int(_number(report, entry, "output_len"))
        results = _field(report, entry, "results")
        for system in results:
            points.setdefault(system, []).append((length, _number(report, results, system, "tok_s")))
    return {system: sorted(p) for system, p in points.items()}


def serving_points(reports: dict | Iterable[dict]) -> tuple[str, dict[str, list[dict]]]:
    """(load axis, {system: points}) from one or more bench_serving.py reports, sorted by load.

    The axis is "request_rate" when every point was a Poisson run, else "concurrency". Each point has
    x, output_throughput (tok/s) and ttft_p50 / ttft_p99 (seconds). A sweep's `sweep` holds every point;
    a single run's `results` is its one point.
    """
    reports = [reports] if isinstance(reports, dict) else list(reports)
    if not reports:
        raise BenchmarkDataError("no bench_serving.py report given")
    raw: dict[str, list[tuple[dict, dict]]] = {}
    for report in reports:
        runs = report.get("sweep") or {name: [s] for name, s in _field(report, report, "results").items()}
        args = report.get("args") or {}
        for system, summaries in runs.items():
            for s in summaries:
                load = {
                    "concurrency": s.get("concurrency", args.get("concurrency")),
                    "request_rate": s.get("request_rate", args.get("request_rate")),
                }
                raw.setdefault(system, []).append((report, s | load))
    axis = "request_rate" if all(s["request_rate"] for pts in raw.values() for _, s in pts) else "concurrency"
    points = {}
    for system, pts in raw.items():
        points[system] = sorted(
            (
                {
                    "x": _number(report, s, axis),
                    "output_throughput": _number(report, s, "output_throughput"),
                    "ttft_p50": _number(report, s, "ttft_ms", "p50") / 1000.0,
                    "ttft_p99": _number(report, s, "ttft_ms", "p99") / 1000.0,
                }
                for report, s in pts
            ),
            key=lambda p: p["x"],
        )
    return axis, points


def footer(report: dict) -> str:
    """Where the numbers came from, in one line: software versions, CPU count or device, date."""
    info = report.get("machine") or report.get("versions") or {}
    parts = [
        f"{name} {info[key]}"
        for name, key in (("JAX", "jax"), ("torch", "torch"), ("transformers", "transformers"))
        if key in info
    ]
    device = info.get("torch_device") or (f"{info['cpu_count']} CPUs" if "cpu_count" in info else None)
    device = device or (f"{info['cpus']} CPUs" if "cpus" in info else None)
    date = str(info.get("date") or report.get("date") or "")[:10]
    return ", ".join(p for p in [*parts, device, date] if p)


def _axes(title: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.4), dpi=120)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig, ax, path: str | Path, note: str) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))  # room for the note under the x label
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="0.4", ha="left", va="bottom")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig).print_png(str(path))
    return path


def _log2_ticks(ax, xs) -> None:
    """Doubling loads or lengths, evenly spaced, labelled where measured."""
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(xs)))
    ax.get_xaxis().set_major_formatter("{x:.0f}")
    ax.get_xaxis().set_minor_formatter(NullFormatter())


def _load_label(axis: str) -> str:
    return "request rate (requests/s)" if axis == "request_rate" else "concurrent clients"


def plot_output_speed(report: dict, path: str | Path) -> Path:
    """Output tok/s against output length, jaxpaged against transformers (bench_throughput.py --output-lens)."""
    points = output_speed_points(report)
    fig, ax = _axes("Output speed against output length")
    workload = report.get("workload") or {}
    batch = workload.get("hf_batch_size")
    for system, pts in points.items():
        label = LABELS.get(system, system) + (f" of {batch}" if system == "hf-batch" and batch else "")
        ax.plot([n for n, _ in pts], [v for _, v in pts], marker="o", label=label, color=COLORS.get(system))
    _log2_ticks(ax, [n for pts in points.values() for n, _ in pts])
    ax.set_xlabel("output tokens per request")
    ax.set_ylabel("output tokens/s (all requests)")
    ax.set_ylim(bottom=0)
    model = Path(str(workload.get("model_path", ""))).name
    n = workload.get("num_requests")
    note = ", ".join(p for p in [model, f"{n} requests" if n else "", footer(report)] if p)
    return _save(fig, ax, path, note)


def plot_throughput_vs_concurrency(reports: dict | Iterable[dict], path: str | Path) -> Path:
    """Server output tok/s against load (bench_serving.py --concurrency 1,4,16,64, or several files)."""
    reports = [reports] if isinstance(reports, dict) else list(reports)
    axis, points = serving_points(reports)
    fig, ax = _axes("Serving throughput against load")
    for system, pts in points.items():
        ax.plot([p["x"] for p in pts], [p["output_throughput"] for p in pts], marker="o",
                label=LABELS.get(system, system), color=COLORS.get(system))  # fmt: skip
    if axis == "concurrency":
        _log2_ticks(ax, [p["x"] for pts in points.values() for p in pts])
    ax.set_xlabel(_load_label(axis))
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    return _save(fig, ax, path, footer(reports[0]))


def plot_ttft(reports: dict | Iterable[dict], path: str | Path) -> Path:
    """Median (solid) and p99 (dashed) time to first token against load, per server."""
    reports = [reports] if isinstance(reports, dict) else list(reports)
    axis, points = serving_points(reports)
    fig, ax = _axes("Time to first token against load")
    for system, pts in points.items():
        x, color, label = [p["x"] for p in pts], COLORS.get(system), LABELS.get(system, system)
        (line,) = ax.plot(x, [p["ttft_p50"] for p in pts], marker="o", color=color, label=f"{label}, median")
        ax.plot(x, [p["ttft_p99"] for p in pts], marker="^", ls="--", color=line.get_color(), label=f"{label}, p99")
    if axis == "concurrency":
        _log2_ticks(ax, [p["x"] for pts in points.values() for p in pts])
    values = [v for pts in points.values() for p in pts for v in (p["ttft_p50"], p["ttft_p99"]) if v > 0]
    if values and max(values) / min(values) > 50:  # a queueing baseline dwarfs everything else
        ax.set_yscale("log")
    ax.set_xlabel(_load_label(axis))
    ax.set_ylabel("TTFT (s)")
    return _save(fig, ax, path, footer(reports[0]))

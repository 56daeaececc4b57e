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
    "vllm": "vLLM",
    "hf-single": "transformers, one request at a time",
    "hf-batch": "transformers, static batches",
    "transformers": "transformers server (generate behind a lock)",
}
SERVING_LABELS = LABELS | {"jaxpaged": "jaxpaged server", "vllm": "vLLM server (vllm serve)"}
COLORS = {"jaxpaged": "tab:blue", "vllm": "tab:green", "hf-single": "tab:red", "hf-batch": "tab:orange", "transformers": "tab:red"}
ORDER = ["jaxpaged", "vllm", "hf-batch", "hf-single", "transformers"]  # legends, bars and notes in this order
BUSY_LOAD_PER_CORE = 0.5  # scripts/machine_load.py's rule, for reports written before it recorded a verdict


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


def _info(report: dict) -> dict:
    return report.get("machine") or report.get("versions") or {}


def machine_line(report: dict) -> str:
    """Date and machine: '2026-11-24, AMD EPYC, 2 cores' (or the GPU's name where torch saw one)."""
    info = _info(report)
    n = info.get("cpu_count") or info.get("cpus")
    cpu = ", ".join(p for p in [info.get("cpu_model") or "", f"{n} cores" if n else ""] if p)
    date = str(info.get("date") or report.get("date") or "")[:10]
    return ", ".join(p for p in [date, info.get("torch_device") or "", cpu] if p)


def versions_line(report: dict) -> str:
    """Software versions: JAX, torch and transformers of this venv; vLLM with its own venv's torch and transformers."""
    info = _info(report)
    parts = [f"{name} {info[key]}" for name, key in (("JAX", "jax"), ("torch", "torch"), ("transformers", "transformers")) if key in info]
    if "vllm" in info:
        own = [f"{name} {info[key]}" for name, key in (("torch", "vllm_torch"), ("transformers", "vllm_transformers")) if key in info]
        parts.append(f"vLLM {info['vllm']}" + (f" ({', '.join(own)})" if own else ""))
    return ", ".join(parts)


def footer(report: dict) -> str:
    """Where the numbers came from, in one line: date, machine, software versions."""
    return "; ".join(p for p in [machine_line(report), versions_line(report)] if p)


def busy_sides(report: dict) -> dict[str, str]:
    """{system: why} for each side of a report that ran on a busy machine.

    Reports from scripts/machine_load.py carry a verdict per side (`load`); older ones only load averages,
    judged here by the same rule (1-min load before above 0.5 per core: the run's first point only, since
    later points start on the previous point's own load).
    """
    if isinstance(report.get("load"), dict) and report["load"]:
        return {name: rec.get("busy_reason") or "busy" for name, rec in report["load"].items() if isinstance(rec, dict) and rec.get("busy")}
    info = _info(report)
    limit = BUSY_LOAD_PER_CORE * (info.get("cpu_count") or info.get("cpus") or 2)
    firsts = {"all systems": report.get("loadavg_1min")}
    for name, runs in (report.get("sweep") or {}).items():
        firsts[name] = runs[0].get("loadavg_1min") if runs and isinstance(runs[0], dict) else None
    if not report.get("sweep"):
        firsts |= {name: s.get("loadavg_1min") for name, s in report.get("results", {}).items() if isinstance(s, dict)}
    return {name: f"1-min load {load['before']:.2f} before it (> {limit:.1f})" for name, load in firsts.items()
            if isinstance(load, dict) and isinstance(load.get("before"), (int, float)) and load["before"] > limit}  # fmt: skip


def busy_note(reports: Iterable[dict]) -> str:
    """The red line a figure carries when any of its sides ran on a busy machine ('' when all were quiet)."""
    names = _ordered({n for r in reports for n in busy_sides(r)})
    names = [{"vllm": "vLLM"}.get(n, n) for n in names]
    return f"BUSY MACHINE during: {', '.join(names)} (see the JSON's load records)" if names else ""


def _axes(title: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.8), dpi=120)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig, ax, path: str | Path, note: str | list[str], warning: str = "") -> Path:
    """Legend, then the provenance lines (grey) and any busy-machine warning (red) under the axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    lines = [note] if isinstance(note, str) else list(note)
    lines = [line for line in lines if line]
    ax.legend(fontsize=8)
    rows = len(lines) + bool(warning)
    fig.tight_layout(rect=(0, 0.03 * rows + 0.01 if rows else 0, 1, 1))  # room for the notes under the x label
    for i, line in enumerate(reversed(lines)):
        fig.text(0.01, 0.01 + 0.03 * i, line, fontsize=7, color="0.4", ha="left", va="bottom")
    if warning:
        fig.text(0.01, 0.01 + 0.03 * len(lines), warning, fontsize=7.5, color="red", weight="bold", ha="left", va="bottom")
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


def _ordered(systems: Iterable[str]) -> list[str]:
    systems = list(systems)
    return sorted(systems, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), systems.index(n)))


def throughput_workload_line(report: dict, with_dtype: bool = True) -> str:
    """'smollm2-hf, float32, 64 requests, prompts 16-256 and outputs 16-256 tokens, greedy, EOS ignored'."""
    w = report.get("workload") or {}
    ins, outs, n = w.get("input_len_range"), w.get("output_len_range"), w.get("num_requests")
    lens = [f"prompts {ins[0]}-{ins[1]}" if ins else ""]
    if outs and not w.get("output_lens"):  # a sweep's output lengths are the x axis
        lens.append(f"outputs {outs[0]}-{outs[1]}")
    lens = " and ".join(p for p in lens if p)
    parts = [Path(str(w.get("model_path", ""))).name, w.get("dtype") if with_dtype else "", f"{n} requests" if n else "",
             f"{lens} tokens" if lens else ""]  # fmt: skip
    return ", ".join(p for p in parts if p) + ", greedy, EOS ignored"


def serving_workload_line(report: dict) -> str:
    """'float32, 64 streaming completions of 48-80 random words, max_tokens 32, greedy, EOS ignored'."""
    a = report.get("args") or {}
    words, out = a.get("input_len"), a.get("output_len")
    parts = [a.get("dtype") or "", f"{a['num_prompts']} streaming requests" if a.get("num_prompts") else "",
             f"prompts of {words[0]}-{words[1]} random words" if words else "",
             (f"max_tokens {out[0]}" if out[0] == out[1] else f"max_tokens {out[0]}-{out[1]}") if out else ""]  # fmt: skip
    return ", ".join(p for p in parts if p)


def throughput_bars(reports: Iterable[dict]) -> list[tuple[str, dict[str, float]]]:
    """[(group label, {system: output tok/s})], one group per bench_throughput.py report (labelled by its dtype)."""
    groups = []
    for report in reports:
        results = _field(report, report, "results")
        if not results:
            raise BenchmarkDataError(f"{report.get('_source', 'benchmark report')}: no systems in 'results'")
        w = report.get("workload") or {}
        label = str(w.get("dtype") or Path(report.get("_source", "run")).stem)
        groups.append((label, {system: _number(report, results, system, "tok_s") for system in _ordered(results)}))
    if not groups:
        raise BenchmarkDataError("no bench_throughput.py report given")
    return groups


def _group_label(label: str, values: dict[str, float]) -> str:
    """'float32' over 'jaxpaged / vLLM 1.07x': the ratio that matters most, under its bars."""
    if values.get("jaxpaged") and values.get("vllm"):
        return f"{label}\njaxpaged / vLLM {values['jaxpaged'] / values['vllm']:.2f}x"
    return label


def plot_throughput(reports: dict | Iterable[dict], path: str | Path) -> Path:
    """Output tok/s per system, one group of bars per report (float32 and bfloat16 runs side by side)."""
    reports = [reports] if isinstance(reports, dict) else list(reports)
    groups = throughput_bars(reports)
    systems = _ordered({s for _, values in groups for s in values})
    fig, ax = _axes("Offline throughput, same workload and weights")
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        xs = [g + (i - (len(systems) - 1) / 2) * width for g, (_, values) in enumerate(groups) if system in values]
        ys = [values[system] for _, values in groups if system in values]
        label = LABELS.get(system, system)
        bars = ax.bar(xs, ys, width=width * 0.95, label=label, color=COLORS.get(system))
        ax.bar_label(bars, labels=[f"{y:.0f}" if y >= 10 else f"{y:.1f}" for y in ys], fontsize=7, padding=1)
    ax.set_xticks(range(len(groups)), [_group_label(label, values) for label, values in groups])
    ax.set_ylabel("output tokens/s (all requests)")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.08)  # room for the value labels
    ax.grid(True, axis="y", alpha=0.3)
    ax.grid(False, axis="x")
    # the dtype is under each group of bars
    lines = [throughput_workload_line(reports[0], with_dtype=False), machine_line(reports[0]), versions_line(reports[0])]
    return _save(fig, ax, path, lines, busy_note(reports))


def plot_output_speed(report: dict, path: str | Path) -> Path:
    """Output tok/s against output length, per system (bench_throughput.py --output-lens)."""
    points = output_speed_points(report)
    fig, ax = _axes("Output speed against output length")
    workload = report.get("workload") or {}
    batch = workload.get("hf_batch_size")
    for system in _ordered(points):
        pts = points[system]
        label = LABELS.get(system, system) + (f" of {batch}" if system == "hf-batch" and batch else "")
        ax.plot([n for n, _ in pts], [v for _, v in pts], marker="o", label=label, color=COLORS.get(system))
    _log2_ticks(ax, [n for pts in points.values() for n, _ in pts])
    ax.set_xlabel("output tokens per request")
    ax.set_ylabel("output tokens/s (all requests)")
    ax.set_ylim(bottom=0)
    lines = [throughput_workload_line(report), machine_line(report), versions_line(report)]
    return _save(fig, ax, path, lines, busy_note([report]))


def _serving_notes(reports: list[dict]) -> tuple[list[str], str]:
    return [serving_workload_line(reports[0]), machine_line(reports[0]), versions_line(reports[0])], busy_note(reports)


def plot_throughput_vs_concurrency(reports: dict | Iterable[dict], path: str | Path) -> Path:
    """Server output tok/s against load (bench_serving.py --concurrency 1,4,16,64, or several files)."""
    reports = [reports] if isinstance(reports, dict) else list(reports)
    axis, points = serving_points(reports)
    fig, ax = _axes("Serving throughput against load")
    for system in _ordered(points):
        pts = points[system]
        ax.plot([p["x"] for p in pts], [p["output_throughput"] for p in pts], marker="o",
                label=SERVING_LABELS.get(system, system), color=COLORS.get(system))  # fmt: skip
    if axis == "concurrency":
        _log2_ticks(ax, [p["x"] for pts in points.values() for p in pts])
    ax.set_xlabel(_load_label(axis))
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    return _save(fig, ax, path, *_serving_notes(reports))


def plot_ttft(reports: dict | Iterable[dict], path: str | Path) -> Path:
    """Median (solid) and p99 (dashed) time to first token against load, per server."""
    reports = [reports] if isinstance(reports, dict) else list(reports)
    axis, points = serving_points(reports)
    fig, ax = _axes("Time to first token against load")
    for system in _ordered(points):
        pts = points[system]
        x, color, label = [p["x"] for p in pts], COLORS.get(system), SERVING_LABELS.get(system, system)
        (line,) = ax.plot(x, [p["ttft_p50"] for p in pts], marker="o", color=color, label=f"{label}, median")
        ax.plot(x, [p["ttft_p99"] for p in pts], marker="^", ls="--", color=line.get_color(), label=f"{label}, p99")
    if axis == "concurrency":
        _log2_ticks(ax, [p["x"] for pts in points.values() for p in pts])
    values = [v for pts in points.values() for p in pts for v in (p["ttft_p50"], p["ttft_p99"]) if v > 0]
    if values and max(values) / min(values) > 50:  # a queueing baseline dwarfs everything else
        ax.set_yscale("log")
    ax.set_xlabel(_load_label(axis))
    ax.set_ylabel("TTFT (s)")
    return _save(fig, ax, path, *_serving_notes(reports))

"""Where a traced stretch of engine steps spent the device's time, read from jax.profiler's Perfetto trace.

    python scripts/trace_summary.py TRACE_DIR [--steps N]

Each kernel on a device stream is put under the executable (XLA module) it ran in, and a forward step's kernels
by name into attention, matmuls and the rest: per step, attention / matmul / forward (other) / kv_write / sampler /
copy / other, the busy fraction of the traced span (the union of kernel intervals) and the idle time between
kernels. On a CPU backend (tests) there are no device streams: the XLA client's compute threads stand in, so the
figures are a shape check only.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

# executable (module) name fragments -> class; the forward's kernels are split further by KERNEL_CLASSES
MODULE_CLASSES = (("sampler", ("sample",)), ("kv_write", ("write_kv",)), ("copy", ("copy_blocks",)), ("forward", ("forward",)))
KERNEL_CLASSES = (
    ("attention", ("attention", "ragged_paged")),
    ("matmul", ("gemm", "cublas", "cutlass", "xmma", "nvjet", "matmul", "dot")),
    ("kv_write", ("scatter", "dynamic_update_slice", "dynamic-update-slice")),
    ("copy", ("memcpy", "memset")),
)


def find_trace(root: str | Path) -> Path:
    """The newest perfetto_trace.json.gz under root (jax.profiler writes plugins/profile/<time>/)."""
    found = sorted(Path(root).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {root}")
    return found[-1]


def _classify(name: str, table) -> str | None:
    low = name.lower()
    for label, fragments in table:
        if any(f in low for f in fragments):
            return label
    return None


def tracks(events: list[dict]) -> tuple[list[dict], list[dict], bool]:
    """(kernel events, module events, on a real device) from the trace's complete ('X') events."""
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if devices:
        kernels = [e for e in spans if e["pid"] in devices and "stream" in threads.get((e["pid"], e.get("tid")), "").lower()]
        modules = [e for e in spans if e["pid"] in devices and threads.get((e["pid"], e.get("tid"))) == "XLA Modules"]
        return kernels, modules, True
    compute = {key for key, name in threads.items() if name.startswith(("tf_XLAEigen", "tf_XLAPjRtCpuClient"))}
    return [e for e in spans if (e["pid"], e.get("tid")) in compute], [], False


def summarize(path: str | Path, steps: int) -> dict:
    with gzip.open(path, "rt") as fh:
        data = json.load(fh)
    events = data["traceEvents"] if isinstance(data, dict) else data
    kernels, modules, on_device = tracks(events)
    if not kernels:
        raise ValueError(f"no kernel events in {path}")
    modules = sorted(modules, key=lambda e: e["ts"])
    starts = [m["ts"] for m in modules]

    def module_of(kernel: dict) -> str | None:
        import bisect

        i = bisect.bisect_right(starts, kernel["ts"]) - 1
        if i >= 0 and kernel["ts"] <= modules[i]["ts"] + modules[i]["dur"]:
            return modules[i]["name"]
        return None

    per_class: dict[str, float] = collections.defaultdict(float)
    per_kernel: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for k in kernels:
        module = module_of(k)
        owner = _classify(module, MODULE_CLASSES) if module else None
        label = _classify(k["name"], KERNEL_CLASSES) if owner in (None, "forward") else owner
        label = label or ("forward_other" if owner == "forward" else "other")
        per_class[label] += k["dur"]
        per_kernel[k["name"]][0] += 1
        per_kernel[k["name"]][1] += k["dur"]
    intervals = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    busy, end = 0.0, intervals[0][0]
    gaps = []
    for a, b in intervals:
        if a > end:
            gaps.append(a - end)
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    span = end - intervals[0][0]
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:15]
    host = host_events(events)
    module_time = collections.defaultdict(float)
    for m in modules:
        module_time[m["name"].split("(")[0]] += m["dur"]
    return {
        "on_device": on_device, "kernels": len(kernels), "span_ms": span / 1e3, "busy_ms": busy / 1e3,
        "busy_fraction": busy / span if span else 0.0, "idle_ms_per_step": (span - busy) / 1e3 / steps,
        "largest_gaps_ms": [g / 1e3 for g in sorted(gaps, reverse=True)[:10]],
        "per_step_ms": {k: v / 1e3 / steps for k, v in sorted(per_class.items(), key=lambda kv: -kv[1])},
        "modules_ms_per_step": {k: v / 1e3 / steps for k, v in sorted(module_time.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "count": c, "ms_per_step": t / 1e3 / steps} for n, (c, t) in top],
        # the host's main thread: where dispatch spends its time (JAX and the PJRT client name their steps)
        "host_ms_per_step": {n[:120]: t / 1e3 / steps for n, t in host},
    }  # fmt: skip


def host_events(events: list[dict], top: int = 30) -> list[tuple[str, float]]:
    """(name, inclusive microseconds) of the main Python thread's traced events, largest first."""
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    host = {key for key in threads if processes.get(key[0], "").startswith("/host")}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and (e["pid"], e.get("tid")) in host]
    dispatching = collections.Counter((e["pid"], e.get("tid")) for e in spans if "Execute" in e["name"])
    if not dispatching:
        return []
    main = dispatching.most_common(1)[0][0]  # the thread that launched the executables
    totals: dict[str, float] = collections.defaultdict(float)
    for e in spans:
        if (e["pid"], e.get("tid")) == main:
            totals[e["name"]] += e["dur"]
    return sorted(totals.items(), key=lambda kv: -kv[1])[:top]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace_dir")
    p.add_argument("--steps", type=int, default=1, help="steps the trace holds (figures are per step)")
    args = p.parse_args(argv)
    print(json.dumps(summarize(find_trace(args.trace_dir), args.steps), indent=2))


if __name__ == "__main__":
    main()

"""Draw the benchmark figures (PNG) from the JSON that the benchmark scripts write.

    # offline throughput per system, one group of bars per run (e.g. float32 and bfloat16)
    python scripts/bench_throughput.py --model FOLDER --vllm-python VLLM_PY --dtype float32 --json f32.json
    python scripts/bench_throughput.py --model FOLDER --vllm-python VLLM_PY --dtype bfloat16 --json bf16.json
    # output speed against output length (a run with --output-lens)
    python scripts/bench_throughput.py --num-requests 16 --output-lens 16,32,64,128 --json lens.json
    # throughput and TTFT against concurrency (one sweep file, or several single runs)
    python scripts/bench_serving.py --compare --num-prompts 32 --concurrency 1,4,16,32 --json sv.json
    python scripts/plot_benchmarks.py --throughput f32.json bf16.json lens.json --serving sv.json --out-dir docs/img --tag cpu

Writes throughput[_TAG].png (from the --throughput runs without --output-lens), output_speed[_TAG].png
(from the first with), throughput_vs_concurrency[_TAG].png and ttft_vs_load[_TAG].png, for the inputs
given. Every figure carries its date, machine and versions, and a red line when a side ran on a busy
machine. The drawing lives in scripts/plots.py, which the quickstart notebook imports too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as a file: import this checkout's packages, not whatever copy is installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--throughput",
        metavar="JSON",
        nargs="+",
        default=[],
        help="bench_throughput.py report(s): plain runs draw throughput.png (one group of bars each), "
        "an --output-lens run draws output_speed.png",
    )
    p.add_argument(
        "--serving",
        metavar="JSON",
        nargs="+",
        default=[],
        help="bench_serving.py report(s), a --concurrency sweep or single runs at different loads: "
        "throughput_vs_concurrency.png and ttft_vs_load.png",
    )
    p.add_argument("--out-dir", default="docs/img", help="where the PNGs go (default: docs/img)")
    p.add_argument("--tag", default="", help="suffix for the file names, e.g. cpu_2026-11-22")
    args = p.parse_args(argv)
    if not args.throughput and not args.serving:
        p.error("give --throughput and/or --serving")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from plots import (
        BenchmarkDataError,
        load_report,
        plot_output_speed,
        plot_throughput,
        plot_throughput_vs_concurrency,
        plot_ttft,
    )

    out, suffix = Path(args.out_dir), f"_{args.tag}" if args.tag else ""
    try:
        written = []
        runs = [load_report(path) for path in args.throughput]
        plain, sweeps = [r for r in runs if "output_len_sweep" not in r], [r for r in runs if "output_len_sweep" in r]
        if plain:
            written.append(plot_throughput(plain, out / f"throughput{suffix}.png"))
        if sweeps:
            written.append(plot_output_speed(sweeps[0], out / f"output_speed{suffix}.png"))
        if args.serving:
            reports = [load_report(path) for path in args.serving]
            written.append(plot_throughput_vs_concurrency(reports, out / f"throughput_vs_concurrency{suffix}.png"))
            written.append(plot_ttft(reports, out / f"ttft_vs_load{suffix}.png"))
    except BenchmarkDataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How fast jaxpaged reads an HF folder's safetensors weights onto the device, against copying the same bytes from the
file into one reused host buffer (the page cache's rate: the floor any reader pays), in one run.

    python scripts/bench_weights.py /path/to/hf_folder --dtype bfloat16 --runs 3

Each run is a new process (nothing cached in-process but the files in the page cache, which a first untimed read
warms); transformers' config import is paid before the timer, so the figure is the weights' own read (issue 33
goal 6: at least 1.5 GB/s). The load average is recorded around each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import json, os, sys, time
import jax
from flax import nnx
from transformers import AutoConfig
AutoConfig.from_pretrained(sys.argv[1])
from jaxpaged.models.loader import load_model
t = time.perf_counter(); c = time.process_time()
loaded = load_model(sys.argv[1], dtype=sys.argv[2], use_cache=False)
jax.block_until_ready(jax.tree_util.tree_leaves(nnx.state(loaded.model)))
print("RESULT " + json.dumps({"load_s": time.perf_counter() - t, "weights_s": loaded.weights_seconds,
                              "cpu_s": time.process_time() - c, "backend": jax.default_backend()}))
"""


def page_cache_rate(files: list[Path], chunk: int = 64 << 20) -> float:
    """Bytes per second copying the files through one reused buffer."""
    buf = bytearray(chunk)
    total, t = 0, time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total / (time.perf_counter() - t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="an HF folder with *.safetensors weights")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", metavar="PATH", help="write the runs here")
    args = p.parse_args(argv)
    files = sorted(Path(args.folder).glob("*.safetensors"))
    if not files:
        p.error(f"no *.safetensors in {args.folder}")
    size = sum(f.stat().st_size for f in files)
    page_cache_rate(files)  # warm the page cache
    runs = []
    for _ in range(args.runs):
        floor = page_cache_rate(files)
        load_before = os.getloadavg()[0]
        out = subprocess.run([sys.executable, "-c", CHILD, args.folder, args.dtype], capture_output=True, text=True, check=True)
        result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
        result |= {"page_cache_gbs": floor / 1e9, "weights_gbs": size / result["weights_s"] / 1e9,
                   "load1_before": load_before, "load1_after": os.getloadavg()[0]}  # fmt: skip
        result["of_page_cache"] = result["weights_gbs"] / result["page_cache_gbs"]
        runs.append(result)
        print(f"weights {result['weights_s']:.2f} s = {result['weights_gbs']:.2f} GB/s "
              f"({result['of_page_cache']:.0%} of the page cache's {result['page_cache_gbs']:.1f} GB/s); "
              f"load {result['load_s']:.2f} s, CPU {result['cpu_s']:.1f} s on {result['backend']}; "
              f"load average {load_before:.2f} -> {result['load1_after']:.2f}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"folder": args.folder, "bytes": size, "dtype": args.dtype, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

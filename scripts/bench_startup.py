"""Start-up time of the README's first command, cold (empty jaxpaged cache) and warm, phase by phase.

Each run is a new process: `python -m jaxpaged.generate --chat PROMPT --verbose`, timed from launch to the
first byte of the answer on stdout (first token) and to exit (total). The phases come from the line the CLI
logs at its first output (`startup {...}`): import (launch to the engine's start), load (weights, config,
tokenizer; a cold run converts the GGUF and builds the native kernels here), pack, KV cache allocation, and
compile (the step buckets this prompt used, compiled or loaded from the executable cache); "other" is the
rest of the way to the first token (chat template, prefill). Every run records the load average around it and
the CPU that other processes and other guests took meanwhile (scripts/machine_load.py), and is flagged busy by
that module's rule; the load before a warm run is the previous run's own, so it is recorded, not judged.

    python scripts/bench_startup.py --warm-runs 3 --json startup.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine_load  # noqa: E402

PHASES = ("import", "load", "pack", "kv_cache", "compile", "other")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default="What is the capital of France?", help="the --chat prompt (the README's)")
    p.add_argument("--warm-runs", type=int, default=3, help="runs after the cold one, on its cache (default 3)")
    p.add_argument("--cache-dir", default=None, help="jaxpaged cache root to use; default: a new empty one (a cold first run)")
    p.add_argument("--python", default=sys.executable, help="the interpreter to run the CLI with (default: this one)")
    p.add_argument("--extra-args", default="", help="more arguments for the CLI, e.g. '--precompile'")
    p.add_argument("--settle-s", type=float, default=240, help="wait up to this long for the load to drop before the first run (default 240)")
    p.add_argument("--json", metavar="PATH", help="write every run and the machine's details here")
    args = p.parse_args(argv)
    if args.warm_runs < 0:
        p.error("--warm-runs must be >= 0")
    return args


def phases(launched: float, first_byte: float | None, startup: dict | None) -> dict[str, float]:
    """Seconds per phase from the CLI's startup line; "other" is what is left before the first byte."""
    if startup is None or first_byte is None:
        return {}
    out = {
        "import": startup["engine_start"] - launched,
        "load": startup["load_s"],
        "pack": startup.get("pack_s", 0.0),
        "kv_cache": startup["kv_cache_s"],
        "compile": startup["compile_s"] + startup.get("warmup_s", 0.0),
    }
    out["other"] = max(0.0, first_byte - launched - sum(out.values()))
    return out


def startup_line(stderr: str) -> dict | None:
    for line in stderr.splitlines():
        if "jaxpaged.generate: startup {" in line:
            return json.loads(line[line.index("{") :])
    return None


def run_once(args, cache_dir: str, label: str) -> dict:
    cmd = [args.python, "-m", "jaxpaged.generate", "--chat", args.prompt, "--verbose", *args.extra_args.split()]
    env = dict(os.environ, JAXPAGED_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    first_byte: list[float] = []
    answer = bytearray()
    with machine_load.SideWatch(label, judge_before=label in ("cold", "warm1")) as watch:
        launched = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

        def read_stdout():
            while chunk := proc.stdout.read1(4096):
                if not first_byte:
                    first_byte.append(time.time())
                answer.extend(chunk)

        reader = threading.Thread(target=read_stdout)
        reader.start()
        stderr = proc.stderr.read().decode(errors="replace")
        proc.wait()
        reader.join()
        total = time.time() - launched
    if proc.returncode != 0:
        raise RuntimeError(f"{label} run failed ({proc.returncode}):\n{stderr[-3000:]}")
    first = first_byte[0] if first_byte else None
    return {
        "run": label,
        "first_token_s": first - launched if first else None,
        "total_s": total,
        "phases_s": phases(launched, first, startup_line(stderr)),
        "answer": answer.decode(errors="replace").strip(),
        "load": watch.record,
    }


def print_run(r: dict) -> None:
    ph = "  ".join(f"{name} {r['phases_s'].get(name, float('nan')):.2f}" for name in PHASES)
    load = r["load"]["loadavg_1min"]
    busy = f"  BUSY: {r['load']['busy_reason']}" if r["load"]["busy"] else ""
    print(f"{r['run']:>6}: first token {r['first_token_s']:.2f}s, total {r['total_s']:.2f}s | {ph} | "
          f"load {load['before']:.2f} -> {load['after']:.2f}{busy}")


def machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "cpu": machine_load.cpu_model()}
    versions = subprocess.run(
        [sys.executable, "-c", "import jax, transformers; print(jax.__version__, transformers.__version__)"],
        capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    if len(versions) == 2:
        info["jax"], info["transformers"] = versions
    return info


def main(argv=None) -> int:
    args = parse_args(argv)
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="jaxpaged-startup-")
    cold = args.cache_dir is None
    labels = (["cold"] if cold else []) + [f"warm{j + 1}" for j in range(args.warm_runs + (0 if cold else 1))]
    machine_load.settle(args.settle_s, machine_load.cores())
    runs = []
    for label in labels:
        runs.append(run_once(args, cache_dir, label))
        print_run(runs[-1])
    warm = [r["first_token_s"] for r in runs if r["run"].startswith("warm")]
    if warm:
        print(f"warm first token: best {min(warm):.2f}s, median {sorted(warm)[len(warm) // 2]:.2f}s; answer: {runs[-1]['answer']!r}")
    for line in machine_load.busy_lines({r["run"]: r["load"] for r in runs}):
        print(line)
    if args.json:
        report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": f"python -m jaxpaged.generate --chat {args.prompt!r}", "machine": machine(), "runs": runs}
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

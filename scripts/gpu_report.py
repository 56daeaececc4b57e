"""One bounded GPU report (issue 33): throughput on nano-vllm's workload against the memory floor, start-up cold
and warm, a device profile of 256-row decode steps with the host's own time per step, and the decode kernel's
bandwidth, in at most --budget-s seconds, start-up included.

    python scripts/gpu_report.py --budget-s 420                  # on the GPU machine: writes gpu_report.json + .md
    python scripts/gpu_report.py --budget-s 240 --with-hf        # add transformers' continuous batching (~150 s)
    python scripts/gpu_report.py --tiny --budget-s 200           # every stage on a tiny model (a CPU, the tests)
    python scripts/gpu_report.py --budget-s 300 --stages moe_gpt_oss,mla   # issue 48's new families (no weights stage)

The workload (issue 33; scripts/workload.py's nano_vllm_requests): 256 requests whose prompt and output lengths are
drawn uniformly from 100-1024 by Python's random.Random(0) (per request: prompt length, its ids with
randrange(10, vocab - 10), output length: 139,291 output tokens for Llama-3.2-1B's vocabulary), greedy, EOS ignored,
on random bfloat16 weights of Llama-3.2-1B's shape written once by transformers' save_pretrained, so every engine
reads the same bytes.

Stages run as child processes (each with the device to itself), in order of value: weights, cold (start-up with an
empty executable cache, first token, the workload, the profile), probe (scripts/dispatch_probe.py: the decode step
dispatched as the engine does, forward alone, write alone, and fused; which call makes the host wait), attention
(bench_attention.py's goal cases; attention_sweep: the decode kernel's launch tuned on them and this workload's step), gemm (each decode matmul's weight bandwidth, JAX's GEMM and torch's; gemm_cublas: XLA's Triton GEMMs off), moe
(a MoE of Qwen3-30B-A3B's layer shape beside the dense model of its active parameters; moe_kernel: the same with the
grouped-GEMM kernel, moe_kernel="triton"; moe_gpt_oss: the moe stage at GPT-OSS-20B's layer shape beside its dense
model; moe_gpt_oss_mxfp4: moe_gpt_oss from an MXFP4 checkpoint, its experts kept 4-bit for the grouped-GEMM kernel,
with the weight bytes that saves), mla (a DeepSeek-V2-Lite-shaped model decoding with the MLA GPU kernel against the pure-JAX MLA path),
warm (start-up again, executables stored), hf_cb (transformers' continuous batching on the same workload, with
--with-hf), and issue 44's step 5: spec (a draft model at batch 1 and 64), lora (four adapters at batch 64), fp16
(the workload on the float16 path of a GPU older than compute capability 8.0, forced). `STAGE@VARIANT` runs a stage
with a variant's XLA flags (VARIANT_FLAGS: cublas, nocmdbuf), so one report holds an A/B. A stage that would not fit in what is left of the budget is dropped and named; a child writes its
results as it goes, and the report is rewritten after every stage, so a run cut short keeps what it measured.

This file holds the parent and most stages; gpu_report_gemm.py and gpu_report_mla.py hold the gemm and mla stages,
gpu_report_summary.py the report's JSON and Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

import provenance  # noqa: E402 - this folder's modules, above
from gpu_report_gemm import stage_gemm  # noqa: E402
from gpu_report_mla import stage_mla  # noqa: E402, F401 - a stage: run_child finds stage_<name> here by name
from gpu_report_summary import write_report  # noqa: E402
from workload import Stopwatch, nano_vllm_requests  # noqa: E402

MODEL_CONFIG = REPO / "scripts" / "configs" / "llama-3.2-1b.json"
TINY_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 4096, "tie_word_embeddings": True}  # fmt: skip
# stage -> (seconds it needs at least to be worth starting, seconds it may take at most)
STAGES = {"weights": (20, 120), "cold": (60, 300), "cold_fused": (60, 150), "cold_fused_proj": (60, 150), "probe": (40, 150), "gemm": (20, 60), "gemm_cublas": (20, 60), "moe": (60, 180), "moe_kernel": (60, 180), "moe_gpt_oss": (60, 150), "moe_gpt_oss_mxfp4": (60, 170), "mla": (60, 140), "attention": (30, 120), "attention_sweep": (40, 150),
          "warm": (30, 90), "hf_cb": (120, 300), "spec": (150, 300), "lora": (120, 240), "fp16": (60, 150)}  # fmt: skip
RESERVE_S = 10  # kept back for writing the report
# "stage@variant" runs the stage with these XLA flags added (an A/B in one report; the executable cache keys on them)
VARIANT_FLAGS = {"cublas": "--xla_gpu_enable_triton_gemm=false",  # every dot to cuBLAS(Lt), none to XLA's Triton GEMMs
                 "nocmdbuf": "--xla_gpu_enable_command_buffer=",  # no CUDA graphs: each kernel launched by itself
                 "cublas_nocmdbuf": "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_command_buffer="}  # fmt: skip


def with_flags(env: dict, flags: str) -> dict:
    return {**env, "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} {flags}".strip()}


def stage_env(stage: str, env: dict) -> dict:
    """A child's environment: the variant's XLA flags, and gemm_cublas's (the gemm stage with cuBLAS)."""
    _, _, variant = stage.partition("@")
    if variant:
        env = with_flags(env, VARIANT_FLAGS[variant])
    return with_flags(env, VARIANT_FLAGS["cublas"]) if stage.startswith("gemm_cublas") else env


class Partial:
    """A child's results, rewritten to its JSON file after every entry: a child killed at its limit keeps them."""

    def __init__(self, path: Path):
        self.path, self.data = path, {}

    def __setitem__(self, key, value) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=2, default=str))


# -- stages (each in its own process) ---------------------------------------------------------------------------


def stage_weights(args, out: Partial) -> None:
    """Random bfloat16 weights of the model's shape, written by transformers' save_pretrained (safetensors)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(args.config)
    clock = Stopwatch()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    drawn = clock.seconds
    model.save_pretrained(args.model_dir)
    size = sum(f.stat().st_size for f in Path(args.model_dir).glob("*.safetensors"))
    out["weights"] = {"drawn_s": drawn, "saved_s": clock.seconds - drawn, "bytes": size, "on": device}
    out["imports"] = import_seconds(args.model_dir)


IMPORT_PROBE = """
import json, sys, time
seconds, t = {}, time.perf_counter()
def mark(name):
    global t
    seconds[name], t = time.perf_counter() - t, time.perf_counter()
import jax; mark("import_jax")
jax.devices(); mark("backend")
import jaxpaged; mark("import_jaxpaged")
import torch; mark("import_torch")
from transformers import AutoConfig; AutoConfig.from_pretrained(sys.argv[1]); mark("transformers_config")
print(json.dumps(seconds))
"""


def import_seconds(model_dir: str) -> dict:
    """A fresh process's first imports, one after another (torch before transformers, which imports it): what a
    start-up pays before it reads a weight (issue 44 step 4: the H200's load spent 10 of 13 s outside the weights)."""
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE, model_dir], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _engine_kwargs(args) -> dict:
    return {"dtype": args.dtype, "max_model_len": args.hi * 2 + 16, "log_level": "INFO", **json.loads(args.engine_args)}


def _startup(args, out: Partial, key: str, process: Stopwatch):
    """LLM start-up timed by phase, then one request's first token (`process`: started with the child process)."""
    clock = Stopwatch()
    from jaxpaged import LLM, SamplingParams

    imported = clock.seconds
    llm = LLM(args.model_dir, **_engine_kwargs(args))
    ready = clock.seconds
    engine = llm.engine
    with Stopwatch() as first_token:
        llm.generate([{"prompt_token_ids": list(range(10, 10 + args.lo))}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    first = first_token.seconds
    # background_compile (the GPU default): ready with the largest bucket; the workload is timed with every bucket
    all_compiled = engine.runner.finish_background_compiles()
    weights = sum(f.stat().st_size for f in Path(args.model_dir).glob("*.safetensors"))
    phases = dict(engine.startup_seconds)
    out[key] = {
        "import_s": imported, "phases_s": phases, "ready_s": ready, "first_token_s": first,
        "all_buckets_compiled_after_warmup_began_s": all_compiled,  # None: every bucket compiled before ready
        "process_to_first_token_s": process.seconds, "weights_bytes": weights,
        # the weights' own read (file to device); "load" adds imports, the config and the tokenizer
        "weights_read_gbs": weights / phases["weights"] / 1e9 if phases.get("weights") else None,
        "load_gbs": weights / phases["load"] / 1e9 if phases.get("load") else None,
        "executables_loaded": engine.runner.executables.num_loaded, "executables_compiled": engine.runner.executables.num_compiled,
        "buckets": engine.runner.buckets, "num_kv_blocks": engine.runner.num_blocks, "memory_plan": engine.runner.memory_plan(),
    }  # fmt: skip
    return llm


def stage_cold(args, out: Partial) -> None:
    process = Stopwatch()
    import jax

    from bench_attention import copy_bandwidth, matmul_rate

    cpu = jax.default_backend() == "cpu"
    out["device"] = {"kind": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__}
    llm = _startup(args, out, "cold_start", process)
    requests = run_workload(llm, args, out)
    profile_decode(llm, args, out)
    # the ceilings last: measured first, their arrays' memory would count against the KV pool's
    bandwidth = copy_bandwidth(args.dtype, nbytes=(64 << 20) if cpu else (2 << 30))
    flops = matmul_rate(args.dtype, n=1024 if cpu else 8192)
    out["rates"] = {"copy_gbs": bandwidth / 1e9, "matmul_tflops": flops / 1e12}
    add_roofline(llm, args, out, requests, bandwidth, flops)


def stage_cold_fused(args, out: Partial) -> None:
    """cold again with fused_kv_write: the forward and the KV write as one executable (its own "step" executables,
    compiled here: the stored ones are the separate forward's and write's)."""
    args.engine_args = json.dumps({**json.loads(args.engine_args), "fused_kv_write": True})
    stage_cold(args, out)


def stage_cold_fused_proj(args, out: Partial) -> None:
    """cold again with fuse_projections: each layer's q/k/v and gate/up weights fused once at load, so XLA runs one
    dot on a contiguous weight for each instead of concatenating the weights every step (issue 44); beside `cold`,
    the A/B of it (its graph differs, so it compiles its own executables)."""
    args.engine_args = json.dumps({**json.loads(args.engine_args), "fuse_projections": True})
    stage_cold(args, out)


def stage_warm(args, out: Partial) -> None:
    _startup(args, out, "warm_start", Stopwatch())


def add_roofline(llm, args, out: Partial, requests, bandwidth: float, flops: float) -> None:
    """The workload's memory floor (bench_throughput's model): tok/s at the measured ceilings, and the fraction met."""
    import transformers
    from roofline import model_cost, roofline

    hf_config = transformers.AutoConfig.from_pretrained(args.model_dir)
    roof = roofline([requests], model_cost(hf_config, args.dtype), llm.engine.config.max_num_seqs, bandwidth, flops)
    workload = out.data["workload"]
    out["workload"] = {**workload, "roofline_tok_s": roof["tok_s"], "of_roofline": workload["tok_s"] / roof["tok_s"],
                       "roofline": roof}  # fmt: skip


def run_workload(llm, args, out: Partial) -> list:
    """The workload through LLM.generate, the host's phases and device calls timed; returns the requests."""
    from profile_step import PhaseTimer, device_calls, instrumented

    from jaxpaged import SamplingParams

    engine = llm.engine
    requests = nano_vllm_requests(engine.loaded.config.vocab_size, args.num_requests, args.lo, args.hi)
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in requests]
    steps, timer, calls = [0], PhaseTimer(), PhaseTimer(())
    step = engine.step

    def counted():
        steps[0] += 1
        return step()

    engine.step = counted
    with Stopwatch() as run, instrumented(engine, timer), device_calls(engine, calls):
        outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = run.seconds
    del engine.step
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    n = max(steps[0], 1)
    out["workload"] = {
        "requests": len(requests), "output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
        "steps": steps[0], "ms_per_step": 1e3 * seconds / n,
        "host_ms_per_step": {k: 1e3 * v / n for k, v in timer.totals.items()},
        "host_cpu_ms_per_step": {k: 1e3 * v / n for k, v in timer.cpu.items() if k != "wait"},
        "calls_ms_per_step": {k: 1e3 * v / n for k, v in calls.totals.items()},
        "calls_cpu_ms_per_step": {k: 1e3 * v / n for k, v in calls.cpu.items()},
        "compiles_after_warmup": engine.num_compiles_after_warmup, "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
    }  # fmt: skip
    return requests


def profile_decode(llm, args, out: Partial) -> None:
    """`rows` sequences decoding together: host phases over a few steps, then a jax.profiler trace of a few more,
    read back per kernel class (trace_summary)."""
    import jax
    from profile_step import PhaseTimer, device_calls, instrumented

    from jaxpaged import RequestOutputKind, SamplingParams

    engine, rows = llm.engine, min(args.profile_rows, llm.engine.config.max_num_seqs)
    vocab = engine.loaded.config.vocab_size
    requests = nano_vllm_requests(vocab, rows, args.lo, args.hi, seed=1)
    # final outputs only, as LLM.generate asks (the workload's path)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.hi, output_kind=RequestOutputKind.FINAL_ONLY)
    for i, (ids, _) in enumerate(requests):
        engine.add_request(f"profile{i}", {"prompt_token_ids": ids}, params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    timer, calls = PhaseTimer(), PhaseTimer(())
    with Stopwatch() as clock, instrumented(engine, timer), device_calls(engine, calls):
        for _ in range(args.profile_steps):
            engine.step()
    wall = clock.seconds / args.profile_steps
    host = {k: 1e3 * v / args.profile_steps for k, v in timer.totals.items()}
    cpu = {k: 1e3 * v / args.profile_steps for k, v in timer.cpu.items() if k != "wait"}
    result = {"rows": rows, "steps": args.profile_steps, "ms_per_step": 1e3 * wall, "host_ms_per_step": host,
              "host_cpu_ms_per_step": cpu, "host_cpu_ms_total": sum(cpu.values()),
              "calls_ms_per_step": {k: 1e3 * v / args.profile_steps for k, v in calls.totals.items()},
              "calls_cpu_ms_per_step": {k: 1e3 * v / args.profile_steps for k, v in calls.cpu.items()}}  # fmt: skip
    out["decode_profile"] = result
    trace_dir = Path(args.work) / "trace"
    jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
    with Stopwatch() as clock:
        for _ in range(args.profile_steps):
            engine.step()
        jax.block_until_ready(engine.runner.kv_cache)
    traced = clock.seconds
    jax.profiler.stop_trace()
    result["traced_ms_per_step"] = 1e3 * traced / args.profile_steps
    try:
        import trace_summary

        result["trace"] = trace_summary.summarize(trace_summary.find_trace(trace_dir), steps=args.profile_steps)
    except Exception as exc:  # noqa: BLE001 - the host figures above stand without it
        result["trace_error"] = f"{type(exc).__name__}: {exc}"
    out["decode_profile"] = result
    for i in range(rows):
        engine.abort_request(f"profile{i}")
    while engine.has_unfinished_requests():
        engine.step()


def stage_probe(args, out: Partial) -> None:
    """The decode step dispatched four ways (scripts/dispatch_probe.py): which call makes the host wait."""
    import dispatch_probe

    ctx = (args.lo + args.hi) // 2
    llm = dispatch_probe.make_llm(args.model_dir, args.profile_rows, ctx, args.dtype)
    out["probe"] = dispatch_probe.probe(llm.engine.runner, args.profile_rows, ctx, max(args.profile_steps, 5))


def stage_moe(args, out: Partial, moe_kernel: str = "loop", family: str = "qwen3_moe", mxfp4: bool = False) -> None:
    """Issue 44 step 5: a MoE with Qwen3-30B-A3B's layer shape (hidden 2048, 32 heads over 4 KV heads of 128, 128
    experts of 768, top 8, its 151,936-token vocabulary), 6 of its 48 layers, random bf16 weights, beside the dense
    model of equal active parameters (scripts/bench_moe.py), batch 1 and 64; every engine with `moe_kernel` (the
    moe_kernel stage: "triton", the grouped-GEMM kernel; a no-op for the dense model). family "gpt_oss": the
    moe_gpt_oss stage's shape (stage_moe_gpt_oss). mxfp4 (gpt_oss only): the MoE side from an MXFP4 checkpoint
    (bench_moe --mxfp4; the moe_gpt_oss_mxfp4 stage)."""
    import bench_moe

    tiny = args.tiny
    key = "moe_gpt_oss" if family == "gpt_oss" else "moe" if moe_kernel == "loop" else "moe_kernel"
    key += "_mxfp4" if mxfp4 else ""
    path = Path(args.work) / f"{key}_bench.json"  # not {key}.json: that is the parent's result file for the stage
    argv = ["--family", family, "--moe-kernel", moe_kernel, "--dtype", "float32" if tiny else args.dtype, "--rounds", "1",
            "--settle-s", "0", "--json", str(path)] + ["--mxfp4"] * mxfp4  # fmt: skip
    if family == "gpt_oss":  # GPT-OSS-20B's layer shape (its 24 layers cut to 4, sliding 128 / full alternating)
        argv += (["--hidden", "2880", "--layers", "4", "--heads", "64", "--kv-heads", "8", "--head-dim", "64",
                  "--experts", "32", "--top-k", "4", "--expert-size", "2880", "--vocab", "201088", "--sliding-window", "128",
                  "--batch-sizes", "1,64", "--prompt-len", "128", "--output-tokens", "128", "--num-kv-blocks", "8192"]
                 if not tiny else
                 ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--experts", "4",
                  "--top-k", "2", "--expert-size", "32", "--vocab", "512", "--sliding-window", "8", "--batch-sizes", "2",
                  "--prompt-len", "12", "--output-tokens", "8", "--num-kv-blocks", "256"])  # fmt: skip
    elif not tiny:
        argv += ["--hidden", "2048", "--layers", "6", "--heads", "32", "--kv-heads", "4", "--head-dim", "128",
                 "--experts", "128", "--top-k", "8", "--expert-size", "768", "--vocab", "151936",
                 "--batch-sizes", "1,64", "--prompt-len", "128", "--output-tokens", "128", "--num-kv-blocks", "8192"]  # fmt: skip
    else:
        argv += ["--hidden", "64", "--layers", "2", "--experts", "4", "--expert-size", "32", "--vocab", "512",
                 "--batch-sizes", "2", "--prompt-len", "8", "--output-tokens", "8", "--num-kv-blocks", "256"]  # fmt: skip
    # each timed run into the report as it ends (bench_moe writes its JSON at the end only): a stage cut short keeps them
    runs = []

    def ran(run: dict) -> None:
        runs.append({k: run[k] for k in ("side", "batch", "tok_s", "step_ms")})
        out["runs"] = runs

    bench_moe.main(argv, on_run=ran)
    report = json.loads(path.read_text())
    out[key] = {k: report[k] for k in ("parameters", "summary", "compiles_after_warmup", "device", "moe_kernel")} | {
        "family": family, "config": report["configs"]["moe"]} | {
        k: report[k] for k in ("mxfp4", "weight_bytes", "memory_plan") if k in report}


def stage_moe_kernel(args, out: Partial) -> None:
    """The moe stage with moe_kernel="triton": the MoE layers' experts as two grouped-GEMM launches a layer
    (pallas_kernels/moe_gemm.py) instead of StaticExpertTiles' loop; `--stages moe,moe_kernel` is the A/B. On a CPU
    (--tiny) the kernel runs interpreted."""
    stage_moe(args, out, moe_kernel="triton")


def stage_moe_gpt_oss(args, out: Partial) -> None:
    """Issue 48 step 5: the moe stage for GPT-OSS (scripts/bench_moe.py --family gpt_oss): GPT-OSS-20B's layer shape
    (hidden 2880, 64 heads of 64 over 8 KV heads, 32 experts of 2880 features, top 4, sinks, YaRN, its 201,088-token
    vocabulary, layers alternating sliding 128 / full), 4 of its 24 layers, random bf16 weights, beside the dense Qwen2
    of equal active parameters and the same attention shape, batch 1 and 64; the expert loop (moe_kernel "loop")."""
    stage_moe(args, out, family="gpt_oss")


def stage_moe_gpt_oss_mxfp4(args, out: Partial) -> None:
    """Issue 48: moe_gpt_oss with the MoE side loaded from an MXFP4 checkpoint (bench_moe --mxfp4: random 4-bit
    experts, bfloat16 elsewhere) and its experts kept 4-bit for the grouped-GEMM kernel (moe_kernel "triton", which
    decodes them in its inner loop); the weight bytes of both sides recorded, so the report shows the 4-bit saving.
    `--stages moe_gpt_oss,moe_gpt_oss_mxfp4` puts it beside the expert loop on float weights."""
    stage_moe(args, out, moe_kernel="triton", family="gpt_oss", mxfp4=True)


stage_gemm_cublas = stage_gemm  # the same, run with XLA's Triton GEMMs off (cuBLAS for every dot): see stage_env()


def stage_spec(args, out: Partial) -> None:
    """Issue 44 step 5: speculative decoding with a draft model (scripts/bench_spec_decode.py's copy workload: a
    random Llama of SmolLM2-135M's shape that copies its prompts, drafted for by its own 2-layer cut) at batch 1 and
    64 (forced on there), against the same engine without it."""
    import bench_spec_decode

    rows = []
    for batch in (1, 64):
        path = Path(args.work) / f"spec_{batch}.json"
        argv = ["--workload", "copy", "--sides", "draft-copy", "--ks", "4", "--batch", str(batch), "--repeats", "1",
                "--num-requests", str(batch if batch > 1 else 4), "--output-len", "16" if args.tiny else "128",
                "--words", "8" if args.tiny else "40", "--json", str(path)]  # fmt: skip
        if batch > 1:
            argv += ["--disable-by-batch-size", str(batch + 1)]
        bench_spec_decode.main(argv)
        report = json.loads(path.read_text())
        for side, s in report["sides"].items():
            rows.append({"batch": batch, "side": side, "tok_s": s["tok_s"],
                         "speedup": report["speedup"].get(side), "device": report["machine"].get("jax_device_kind")})  # fmt: skip
        out["spec"] = rows


def stage_lora(args, out: Partial) -> None:
    """Issue 44 step 5: LoRA's cost at batch 64 with four rank-16 adapters mixed in every step (scripts/bench_lora.py:
    a random base of SmolLM2-135M's shape, bfloat16), against the same engine without LoRA."""
    import bench_lora

    path = Path(args.work) / "lora.json"
    argv = ["--dtype", "float32" if args.tiny else "bfloat16", "--num-requests", "64", "--num-adapters", "4",
            "--repeats", "1", "--settle-s", "0", "--output-len", "16" if args.tiny else "128", "--json", str(path)]  # fmt: skip
    if args.tiny:
        argv += ["--num-layers", "2", "--vocab-size", "512"]
    bench_lora.main(argv)
    report = json.loads(path.read_text())
    out["lora"] = [{"side": side, "tok_s": s["tok_s"]} for side, s in report["sides"].items()] + [
        {"side": "lora / plain", "ratio": report["ratio"], "device": report["machine"]["jax_device_kind"]}]


def stage_fp16(args, out: Partial) -> None:
    """Issue 44 step 5: the workload in float16 on the path a GPU before compute capability 8.0 takes (T4, V100:
    float16 as the engine's dtype, and the attention kernel sized for a T4's 64 KiB of shared memory), forced on
    this GPU; the cold stage's start-up and workload otherwise."""
    import jax

    if jax.default_backend() == "gpu":
        from jaxpaged.platforms import gpu

        real = str(jax.devices()[0].compute_capability)
        gpu._capability = lambda: (7, 5)
        gpu.SHARED_MEMORY_KIB = {**gpu.SHARED_MEMORY_KIB, real: gpu.SHARED_MEMORY_KIB["7.5"]}
        out["forced"] = {"capability": "7.5", "real_capability": real, "shared_memory_kib": gpu.SHARED_MEMORY_KIB["7.5"]}
    args.dtype = "float16"
    stage_cold(args, out)


def stage_attention(args, out: Partial) -> None:
    import bench_attention

    report = bench_attention.main(["--quick", "--json", str(Path(args.work) / "attention.json")])
    out["attention"] = {"env": report["env"], "goals": report["goals"], "rows": report["rows"]}


def stage_attention_sweep(args, out: Partial) -> None:
    """The decode kernel's launch tuned (bench_attention.py --sweep) on the goals' cases and this workload's decode
    step: each case's default launch, its best and every launch tried, kept as each case ends."""
    import bench_attention

    rows = []

    def keep(row):
        rows.append(row)
        out["attention_sweep"] = {"rows": rows}

    limit = STAGES["attention_sweep"][1]
    report = bench_attention.main(["--sweep", "--deadline-s", str(limit - 30), "--json", str(Path(args.work) / "attention_sweep.json")], on_case=keep)
    out["attention_sweep"] = {"env": report["env"], "rows": rows}


def stage_hf_cb(args, out: Partial) -> None:
    """transformers' continuous batching (paged attention, its own scheduler) on the same workload and weights."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16, attn_implementation="paged|sdpa")
    model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    requests = nano_vllm_requests(model.config.vocab_size, args.num_requests, args.lo, args.hi)
    config = transformers.GenerationConfig(max_new_tokens=args.hi, do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = finished = 0
    with_warmup = Stopwatch()
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        started = Stopwatch()
        for i, (ids, n) in enumerate(requests):
            manager.add_request(ids, request_id=f"r{i}", max_new_tokens=n)
        while finished < len(requests):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    break
                continue
            if result.is_finished():
                finished += 1
                tokens += len(result.generated_tokens)
    seconds = started.seconds
    out["hf_cb"] = {"requests": finished, "output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
                    "with_warmup_s": with_warmup.seconds, "transformers": transformers.__version__}  # fmt: skip


# -- the parent: budget, children, report -----------------------------------------------------------------------

def run_child(args) -> int:
    out = Partial(Path(args.result))
    try:
        globals()[f"stage_{args.stage}"](args, out)
    except Exception as exc:  # noqa: BLE001 - recorded; the parent goes on with the next stage
        import traceback

        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-4000:]
        traceback.print_exc()
        return 1
    return 0


def environment() -> dict:
    """The report's `env` (its keys as docs/data's reports hold them), from scripts/provenance.py's probes."""
    import platform

    env = {"date": provenance.today(), "python": platform.python_version(), "host_cpus": os.cpu_count()}
    env |= provenance.versions(("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "transformers", "torch"))
    env["nvidia_smi"] = provenance.nvidia_smi_text()
    env["load_avg"] = os.getloadavg()
    # what decides how a GPU executable's dispatch may wait on the host (allocator, client, in-flight limit)
    env["runtime_env"] = provenance.runtime_env()
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=420.0, help="the whole run, start-up included (default 420)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "docs" / "data"), help="folder for the report")
    p.add_argument("--name", default=None, help="file name stem (default gpu_report_<device>_<date>)")
    p.add_argument("--work", default="/tmp/jaxpaged-gpu-report", help="weights, executables and traces go here")
    p.add_argument("--config", default=str(MODEL_CONFIG), help="the model's config.json (default Llama-3.2-1B's)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama and a small workload (CPU, tests)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--lo", type=int, default=100, help="shortest prompt and output (default 100)")
    p.add_argument("--hi", type=int, default=1024, help="longest prompt and output (default 1024)")
    p.add_argument("--profile-rows", type=int, default=256)
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--stages", default="weights,cold,probe,gemm,attention,warm", help="comma-separated, run in this order")
    p.add_argument("--with-hf", action="store_true", help="add hf_cb: transformers' continuous batching")
    p.add_argument("--engine-args", default="{}", metavar="JSON", help="more LLM arguments for every jaxpaged stage, e.g. "
                   "'{\"fused_kv_write\": true}' (default: the engine's defaults)")
    p.add_argument("--stage", help=argparse.SUPPRESS)  # a child: run this stage only
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stage:
        return run_child(args)

    start = time.monotonic()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        config = work / "tiny-config.json"
        config.write_text(json.dumps(TINY_CONFIG))
        args.config, args.num_requests, args.lo, args.hi = str(config), min(args.num_requests, 16), 8, 48
        args.profile_rows, args.profile_steps = min(args.profile_rows, 16), min(args.profile_steps, 4)
    model_dir = work / ("tiny" if args.tiny else "model")
    stages = [s for s in args.stages.split(",") if s] + (["hf_cb"] if args.with_hf else [])
    unknown = [s for s in stages if s.partition("@")[0] not in STAGES or s.partition("@")[2] not in ("", *VARIANT_FLAGS)]
    if unknown:
        p.error(f"unknown stages {unknown}; known: {', '.join(STAGES)}, each optionally @{'/@'.join(VARIANT_FLAGS)}")
    report = {"budget_s": args.budget_s, "env": environment(), "stages": {}, "dropped": [],
              "workload": {"num_requests": args.num_requests, "lo": args.lo, "hi": args.hi, "config": args.config,
                           "dtype": args.dtype, "engine_args": json.loads(args.engine_args)}}  # fmt: skip
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"gpu_report_{'tiny' if args.tiny else 'run'}_{report['env']['date']}"
    env = dict(os.environ, JAXPAGED_CACHE_DIR=str(work / "cache"), PYTHONUNBUFFERED="1")
    if "weights" in stages or "cold" in stages:  # a cold start: no stored executables
        subprocess.run(["rm", "-rf", str(work / "cache")], check=False)
    for stage in stages:
        left = args.budget_s - (time.monotonic() - start) - RESERVE_S
        least, most = STAGES[stage.partition("@")[0]]
        if stage == "weights" and (model_dir / "config.json").exists():
            report["stages"][stage] = {"skipped": f"{model_dir} exists"}
            continue
        if left < least:
            report["dropped"].append(f"{stage} (needs {least} s, {left:.0f} s left)")
            write_report(report, out_dir, stem)
            continue
        result = work / f"{stage}.json"
        result.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--stage", stage.partition("@")[0], "--result", str(result), "--model-dir", str(model_dir),
               "--work", str(work), "--config", args.config, "--dtype", args.dtype, "--num-requests", str(args.num_requests),
               "--lo", str(args.lo), "--hi", str(args.hi), "--profile-rows", str(args.profile_rows),
               "--profile-steps", str(args.profile_steps), "--engine-args", args.engine_args] + ["--tiny"] * args.tiny  # fmt: skip
        print(f"== {stage} (at most {min(most, left):.0f} s)", flush=True)
        t0 = time.monotonic()
        load_before = os.getloadavg()
        try:
            rc = subprocess.run(cmd, env=stage_env(stage, env), timeout=min(most, left)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        data = json.loads(result.read_text()) if result.exists() else {}
        report["stages"][stage] = {**data, "rc": rc, "seconds": time.monotonic() - t0, "load_before": load_before,
                                   "load_after": os.getloadavg()}  # fmt: skip
        write_report(report, out_dir, stem)
    report["seconds"] = time.monotonic() - start
    write_report(report, out_dir, stem)
    print((out_dir / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

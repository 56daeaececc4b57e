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
from workload import Stopwatch, nano_vllm_requests, random_prompts  # noqa: E402

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


def decode_gemms(config: dict) -> dict:
    """The matmuls of one decode layer and the head, (K, N) each: what reads the weights at 256 rows."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config.get("head_dim") or d // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    return {"q": (d, q), "k": (d, kv), "qkv_fused": (d, q + 2 * kv), "o": (q, d), "gate": (d, f),
            "gate_up_fused": (d, 2 * f), "down": (f, d), "lm_head": (d, v)}  # fmt: skip


def stage_gemm(args, out: Partial) -> None:
    """Each decode matmul at --profile-rows rows in bf16 (x @ W, W [K, N] as the engine keeps it, and W [N, K] as
    torch keeps it): the weight bytes read per second against a plain copy's, JAX's GEMM then torch's (cuBLAS).
    Weights rotate over copies larger than the L2, so each call reads from memory."""
    import jax
    import jax.numpy as jnp

    from bench_attention import copy_bandwidth

    config = json.loads(Path(args.config).read_text())
    m, dtype = args.profile_rows, jnp.bfloat16
    copy = copy_bandwidth(args.dtype, nbytes=(64 << 20) if jax.default_backend() == "cpu" else (2 << 30))
    rows = {}
    x = jax.random.normal(jax.random.key(0), (m, config["hidden_size"]), jnp.float32).astype(dtype)
    for name, (k, n) in decode_gemms(config).items():
        copies = max(2, -(-(256 << 20) // (k * n * 2))) if jax.default_backend() != "cpu" else 2
        ws = [jax.random.normal(jax.random.key(i), (k, n), jnp.float32).astype(dtype) for i in range(copies)]
        xk = jax.random.normal(jax.random.key(7), (m, k), jnp.float32).astype(dtype)
        row = {"k": k, "n": n, "weight_bytes": k * n * 2}
        for layout, fn, weights in (
            ("kn", jax.jit(lambda a, w: jnp.dot(a, w, preferred_element_type=jnp.float32).astype(dtype)), ws),
            ("nk", jax.jit(lambda a, w: jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())),
                                                            preferred_element_type=jnp.float32).astype(dtype)),
             [w.T.copy() for w in ws]),
        ):  # fmt: skip
            for w in weights:
                fn(xk, w).block_until_ready()
            reps = 20
            with Stopwatch() as clock:
                for i in range(reps * len(weights)):
                    y = fn(xk, weights[i % len(weights)])
                y.block_until_ready()
            seconds = clock.seconds / (reps * len(weights))
            row[f"jax_{layout}_us"] = 1e6 * seconds
            row[f"jax_{layout}_of_copy"] = k * n * 2 / seconds / copy
        del ws, weights
        rows[name] = row
        out["gemm"] = {"rows": m, "copy_gbs": copy / 1e9, "shapes": rows, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    del x
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    # torch's device-to-device copy (cudaMemcpy) beside JAX's: on an H100 the JAX copy read 2.5 TB/s where torch's
    # had read 3.0 (KINDS.md), so the floor's ceiling is the larger of the two
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    out["gemm"] = {**out.data["gemm"], "torch_copy_gbs": 2 * src.nbytes * 10 / (start.elapsed_time(end) / 1e3) / 1e9}
    del src, dst
    for name, (k, n) in decode_gemms(config).items():
        copies = max(2, -(-(256 << 20) // (k * n * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        xk = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for w in ws:
            torch.nn.functional.linear(xk, w)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 20
        start.record()
        for i in range(reps * copies):
            torch.nn.functional.linear(xk, ws[i % copies])
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / (reps * copies)
        rows[name]["torch_us"] = 1e6 * seconds
        rows[name]["torch_of_copy"] = k * n * 2 / seconds / copy
        del ws
        out["gemm"] = {**out.data["gemm"], "shapes": rows, "torch": torch.__version__}


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


# DeepSeek-V2-Lite's released config.json (deepseek-ai/DeepSeek-V2-Lite: MLA with kv_lora_rank 512 + qk_rope_head_dim
# 64, 16 heads, no q low-rank path; 64 routed experts of 1408, top 6, two shared; the first layer dense), its 27 layers
# cut to 4: a bare config.json, so the engine draws random weights
MLA_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
    "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 4,
    "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400,
}  # fmt: skip
# --tiny: scripts/mla_kv_bytes.py's tiny DeepSeek-V3 (transformers.DeepseekV3Config's other defaults)
MLA_TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16,
            "v_head_dim": 24, "qk_nope_head_dim": 32, "n_routed_experts": 8, "n_group": 4, "topk_group": 2,
            "num_experts_per_tok": 2}  # fmt: skip
# (side, attention_backend): the platform's default (on a GPU the MLA Triton kernel, pallas_kernels/mla_gpu.py), then
# the pure-JAX MLA path (ReferenceAttention: MlaAttention runs pallas_kernels/mla.py's absorbed form in JAX)
MLA_SIDES = (("kernel", "auto"), ("reference", "reference"))


def _mla_run(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> dict:
    """Greedy requests through the engine step by step, timed in two windows: the prompts' steps (until every request
    is past its prompt), then the decode steps with the whole batch decoding, until the first request has its
    max_tokens; the others are then aborted, so the batch never drains through smaller step shapes (each a compile
    with precompile off). Each request's tokens (an aborted one's as far as it got), and the compiles during the run."""
    from jaxpaged import RequestOutputKind, SamplingParams
    from jaxpaged.utils import compile_monitor

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    sched, tokens, compiles = engine.scheduler, {}, compile_monitor.compile_count()
    steps, clock, prefill, decode = 0, Stopwatch(), None, None  # (seconds, steps, tokens) at each window's end
    past_prompts = False

    def sampled() -> int:  # tokens sampled so far (not those still in flight on the device)
        return sum(len(t) for t in tokens.values()) + sum(r.num_sampled_tokens for r in sched.running)

    while engine.has_unfinished_requests():
        finished = [o for o in engine.step() if o.finished]
        steps += 1
        tokens |= {o.request_id: list(o.outputs[0].token_ids) for o in finished}
        if prefill is None and past_prompts:  # a step later: with async scheduling the last prompt step is queued, not run
            prefill = (clock.seconds, steps, sampled())
        past_prompts = not sched.waiting and all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in sched.running)
        if finished and decode is None:
            decode = (clock.seconds, steps, sampled())
            for rid in ids:
                if rid not in tokens:
                    aborted = engine.abort_request_with_output(rid)
                    tokens[rid] = [t for t in aborted.outputs[0].token_ids if t >= 0] if aborted else []  # no placeholders
    seconds = clock.seconds
    prefill = prefill or (seconds, steps, 0)
    decode = decode or (seconds, steps, sum(len(t) for t in tokens.values()))
    window_s, window_steps, window_tokens = decode[0] - prefill[0], decode[1] - prefill[1], decode[2] - prefill[2]
    if window_steps <= 0:  # a request done before every prompt was: no step had the whole batch decoding
        window_s = window_steps = window_tokens = 0
    return {"batch": len(prompts), "output_tokens": sum(len(t) for t in tokens.values()), "seconds": seconds, "steps": steps,
            "tok_s": sum(len(t) for t in tokens.values()) / seconds, "prefill_s": prefill[0], "prefill_steps": prefill[1],
            "decode_tokens": window_tokens, "decode_steps": window_steps, "decode_s": window_s,
            "decode_tok_s": window_tokens / window_s if window_s > 0 and window_tokens else None,
            "decode_step_ms": 1e3 * window_s / window_steps if window_steps else None,
            "compiles": compile_monitor.compile_count() - compiles, "tokens": [tokens[i] for i in ids]}  # fmt: skip


def first_divergence(a: list[list[int]], b: list[list[int]]) -> dict:
    """Two sides' greedy tokens, request by request, over the tokens both have (an aborted request's may stop a step
    apart): how many requests agree, and the earliest token that differs."""
    first, identical = None, 0
    for i, (x, y) in enumerate(zip(a, b)):
        at = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), None)
        identical += at is None
        if at is not None and (first is None or at < first["token"]):
            first = {"request": i, "token": at}
    return {"equal": first is None and len(a) == len(b), "identical_requests": identical, "requests": len(a),
            "compared_tokens": sum(min(len(x), len(y)) for x, y in zip(a, b)), "first_divergence": first}  # fmt: skip


def stage_mla(args, out: Partial) -> None:
    """Issue 48 step 5: multi-head latent attention on this device. A DeepSeek-V2-Lite-shaped random model (MLA_CONFIG:
    its released shape, 4 layers, the first dense) in bfloat16 decodes at batch 1 and 64 (prompts of 1000 random
    tokens, up to 128 greedy tokens, EOS ignored, prefix caching off) with the platform's default attention (on a GPU
    the MLA Triton kernel) and then with attention_backend "reference" (the pure-JAX MLA path): tok/s and step ms of
    the decode steps with the whole batch decoding (after every prompt, until the first request has its 128 tokens:
    the rest are aborted there, _mla_run), the whole run's tok/s, the engine's kv_bytes_per_token beside the same
    attention's expanded K/V (scripts/mla_kv_bytes.py), and whether the two sides' greedy tokens are equal (else the
    first that differs: bfloat16 sums in another order may). Each batch runs once untimed first (its step shapes
    compiled on first use: precompile off), and again if its timed run still compiled. --tiny: a tiny DeepSeek-V3,
    float32, on the CPU (both sides the pure-JAX path there, unless the CPU platform picks otherwise)."""
    import gc

    import jax
    import jax.numpy as jnp
    import mla_kv_bytes
    import numpy as np
    import transformers

    from jaxpaged import LLM

    tiny = args.tiny
    folder = Path(args.work) / ("mla-tiny" if tiny else "mla-v2-lite")
    folder.mkdir(parents=True, exist_ok=True)
    if tiny:
        config = transformers.DeepseekV3Config(**MLA_TINY)
        config.architectures = ["DeepseekV3ForCausalLM"]
        config.save_pretrained(folder)
    else:
        (folder / "config.json").write_text(json.dumps(MLA_CONFIG, indent=1))
    hf = transformers.AutoConfig.from_pretrained(folder)
    dtype = "float32" if tiny else args.dtype
    # --tiny: two prompts over the CPU's 256-token step budget, so the second's prompt ends a step later (the abort)
    batches, prompt_len, output_tokens = ((1, 2), 160, 8) if tiny else ((1, 64), 1000, 128)
    latent, expanded = mla_kv_bytes.bytes_per_token(hf.architectures[0], hf, dtype=jnp.dtype(dtype))
    rng = np.random.default_rng(0)  # one generator for every batch: each batch's prompts follow the one before's
    prompts = {b: random_prompts(b, prompt_len, 10, hf.vocab_size - 10, seed=rng) for b in batches}
    result = {"model": "DeepSeek-V3 (tiny)" if tiny else "DeepSeek-V2-Lite shape, 4 layers", "config": json.loads((folder / "config.json").read_text()),
              "dtype": dtype, "prompt_len": prompt_len, "output_tokens": output_tokens, "device": jax.devices()[0].device_kind,
              "formula_bytes_per_token": latent, "expanded_bytes_per_token": expanded, "sides": {}, "summary": []}  # fmt: skip
    out["mla"] = result
    tokens = {}
    for side, backend in MLA_SIDES:
        start = Stopwatch()
        llm = LLM(str(folder / "config.json"), dtype=dtype, attention_backend=backend, max_num_seqs=max(batches),
                  max_model_len=prompt_len + output_tokens + 16, num_kv_blocks=256 if tiny else 8192,
                  enable_prefix_caching=False, precompile=False, log_level="WARNING")  # fmt: skip
        engine = llm.engine
        chosen = engine.loaded.model.layers[0].self_attn.backend
        # MlaAttention runs the cached context in a kernel for these two backends (Mosaic's where it takes the cache)
        path = {"TritonAttention": "the MLA Triton kernel", "MosaicAttention": "the MLA Mosaic kernel"}.get(type(chosen).__name__, "pure JAX")
        entry = {"attention_backend": backend, "attention": f"{type(chosen).__name__}: {path}",
                 "kv_bytes_per_token": llm.get_stats()["kv_bytes_per_token"], "start_s": start.seconds, "runs": []}  # fmt: skip
        result["sides"][side] = entry
        out["mla"] = result
        for batch in batches:
            batch_clock = Stopwatch()
            # untimed: long enough that the whole batch decodes together, so the timed run's step shapes are met
            prompt_steps = -(-batch * prompt_len // engine.config.max_num_batched_tokens)
            _mla_run(engine, prompts[batch], min(output_tokens, prompt_steps + 8), f"w{batch}-")
            run = _mla_run(engine, prompts[batch], output_tokens, f"t{batch}-")
            if run["compiles"]:
                run = {**_mla_run(engine, prompts[batch], output_tokens, f"r{batch}-"), "retimed_after_compiles": run["compiles"]}
            run["warmup_and_runs_s"] = batch_clock.seconds
            tokens[side, batch] = run.pop("tokens")
            entry["runs"].append(run)
            entry["compiles_after_warmup"] = engine.num_compiles_after_warmup
            if side != MLA_SIDES[0][0] and (MLA_SIDES[0][0], batch) in tokens:
                mine, theirs = run, next(r for r in result["sides"][MLA_SIDES[0][0]]["runs"] if r["batch"] == batch)
                figures = lambda r: {k: r[k] for k in ("decode_tok_s", "decode_step_ms", "tok_s", "compiles")}
                ratio = theirs["decode_tok_s"] / mine["decode_tok_s"] if theirs["decode_tok_s"] and mine["decode_tok_s"] else None
                result["summary"].append({"batch": batch, "kernel": figures(theirs), "reference": figures(mine),
                                          "kernel_over_reference_decode_tok_s": ratio,
                                          "tokens": first_divergence(tokens[MLA_SIDES[0][0], batch], tokens[side, batch])})  # fmt: skip
            out["mla"] = result
        del llm, engine
        gc.collect()


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


def write_report(report: dict, out_dir: Path, stem: str) -> None:
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2, default=str))
    (out_dir / f"{stem}.md").write_text(summary_table(report))


def _f(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _workload_lines(stage: dict, hf: dict | None, prefix: str) -> list[str]:
    """A cold stage's ceilings, workload against the floor and transformers, and traced decode step."""
    if not stage.get("workload") and not stage.get("rates"):
        return []
    lines = []
    rates = stage.get("rates", {})
    lines.append(prefix + f"copy {_f(rates.get('copy_gbs'))} GB/s, matmul {_f(rates.get('matmul_tflops'))} TFLOP/s")
    w = stage.get("workload")
    if w:
        floor = (f"{100 * w['of_roofline']:.1f}% of the floor ({w['roofline_tok_s']:.0f} tok/s)" if "of_roofline" in w
                 else "floor not measured")  # fmt: skip
        lines.append(prefix + f"workload: {w['requests']} requests, {w['output_tokens']} output tokens in {w['seconds']:.1f} s = "
                     f"**{w['tok_s']:.0f} tok/s**, {floor}; {w['steps']} steps, {w['ms_per_step']:.2f} ms a step; "
                     f"compiles after warm-up {w['compiles_after_warmup']}")
        lines.append(prefix + "host ms a step (wall): " + ", ".join(f"{k} {v:.2f}" for k, v in w["host_ms_per_step"].items()))
        lines.append(prefix + "device calls, host ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in w["calls_ms_per_step"].items()))
    if hf and w:
        lines.append(prefix + f"transformers continuous batching: {hf['tok_s']:.0f} tok/s; jaxpaged is {w['tok_s'] / hf['tok_s']:.1f}x")
    prof = stage.get("decode_profile")
    if prof:
        lines.append(prefix + f"decode at {prof['rows']} rows: {prof['ms_per_step']:.2f} ms a step, host CPU "
                     f"{prof['host_cpu_ms_total']:.2f} ms (" + ", ".join(f"{k} {v:.2f}" for k, v in prof['host_cpu_ms_per_step'].items()) + ")")
        trace = prof.get("trace")
        if trace:
            lines.append(prefix + "device per step (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in trace["per_step_ms"].items())
                         + f"; busy {100 * trace['busy_fraction']:.1f}% of the span, idle gaps {trace['idle_ms_per_step']:.3f} ms a step")
        elif prof.get("trace_error"):
            lines.append(prefix + f"trace: {prof['trace_error']}")
    return lines


def _mla_lines(mla: dict | None) -> list[str]:
    """The mla stage: each side's attention and KV bytes a token, then per batch the kernel's decode against the
    pure-JAX path's and whether their greedy tokens agree (a side's runs alone while the other has not run)."""
    if not mla:
        return []
    lines, compared = [], {row["batch"] for row in mla["summary"]}
    for side, s in mla["sides"].items():
        kv = s["kv_bytes_per_token"]
        lines.append(f"MLA {side} side ({s['attention']}, {mla['model']}, {mla['dtype']}): KV {kv} bytes a token "
                     f"(formula {mla['formula_bytes_per_token']}), expanded K/V would be {mla['expanded_bytes_per_token']} "
                     f"(x{mla['expanded_bytes_per_token'] / kv:.1f}); compiles after warm-up {s.get('compiles_after_warmup')}")
        for r in s["runs"]:
            if r["batch"] not in compared:
                lines.append(f"MLA {side} at batch {r['batch']}: decode {_f(r['decode_tok_s'], '{:.0f}')} tok/s, step "
                             f"{_f(r['decode_step_ms'], '{:.2f}')} ms; the whole run {r['tok_s']:.0f} tok/s")
    for row in mla["summary"]:
        k, r, t = row["kernel"], row["reference"], row["tokens"]
        first = t["first_divergence"]
        agree = ("greedy tokens equal" if t["equal"] else f"greedy tokens {t['identical_requests']} of {t['requests']} requests "
                 f"equal, the first difference at request {first['request']}, token {first['token']}" if first else "greedy tokens differ")
        lines.append(f"MLA at batch {row['batch']} ({mla['prompt_len']}-token prompts, up to {mla['output_tokens']} out): kernel decode "
                     f"{_f(k['decode_tok_s'], '{:.0f}')} tok/s, step {_f(k['decode_step_ms'], '{:.2f}')} ms, against the "
                     f"pure-JAX path's {_f(r['decode_tok_s'], '{:.0f}')} tok/s, {_f(r['decode_step_ms'], '{:.2f}')} ms "
                     f"(x{_f(row['kernel_over_reference_decode_tok_s'], '{:.2f}')}); whole runs {k['tok_s']:.0f} / {r['tok_s']:.0f} tok/s; "
                     f"{agree}")  # fmt: skip
    return lines


def _mxfp4_kept(moe: dict) -> bool:
    """Whether a moe stage's MoE engine kept its MXFP4 experts 4-bit (its memory plan says so)."""
    return "MXFP4 experts kept 4-bit" in ((moe.get("memory_plan") or {}).get("moe") or "")


def _mxfp4_line(name: str, moe: dict) -> str:
    """How a moe stage from an MXFP4 checkpoint held its experts, and the weight bytes of both sides."""
    how = "experts kept 4-bit (the grouped GEMM decodes them)" if _mxfp4_kept(moe) else f"experts dequantized once at load ({moe.get('moe_kernel', 'loop')})"
    weights = moe.get("weight_bytes") or {}
    dense = weights.get("dense")
    sizes = "" if weights.get("moe") is None else (
        f"; weights {weights['moe'] / 1e6:.1f} MB against the dense model's {_f(None if dense is None else dense / 1e6)} MB")
    return f"{name}: MXFP4 checkpoint, {how}{sizes}"


def summary_table(report: dict) -> str:
    """The short table the run prints last: what each goal of issue 33 asks, and what was measured."""
    st = report["stages"]
    env = report["env"]
    cold, warm = st.get("cold", {}), st.get("warm", {})
    device = cold.get("device", {})
    lines = [f"# gpu_report: {device.get('kind', '?')}, {env.get('date')}, jax {env.get('jax')}, "
             f"transformers {env.get('transformers')}, torch {env.get('torch')}", ""]  # fmt: skip
    for name in [n for n in st if n.startswith(("cold", "fp16"))]:
        lines += _workload_lines(st[name], st.get("hf_cb", {}).get("hf_cb"), "" if name == "cold" else f"{name}: ")
    for key, label in (("cold_start", "cold start"), ("warm_start", "warm start")):
        s = cold.get(key) or warm.get(key)
        if s:
            ph = s["phases_s"]
            later = s.get("all_buckets_compiled_after_warmup_began_s")
            lines.append(f"{label}: ready {s['ready_s']:.1f} s (backend {_f(ph.get('backend'))}, load {_f(ph.get('load'))} of which weights {_f(ph.get('weights'))}, config {_f(ph.get('config'))}, "
                         f"tokenizer {_f(ph.get('tokenizer'))}, "
                         f"warm-up {_f(ph.get('warmup'))}; "
                         f"weights {_f(s.get('weights_read_gbs'), '{:.2f}')} GB/s), first token {s['first_token_s']:.2f} s, "
                         f"{s['executables_loaded']} executables loaded, {s['executables_compiled']} compiled"
                         + (f"; the other buckets compiled {later:.1f} s after warm-up began" if later else ""))
    for name in [n for n in st if n.startswith("probe")]:
        probe = st[name].get("probe")
        if probe:
            import dispatch_probe

            lines.append(("" if name == "probe" else f"{name}: ") + dispatch_probe.table(probe))
    for name in ("spec", "lora"):
        for row in st.get(name, {}).get(name, []):
            lines.append(f"{name}: " + ", ".join(f"{k} {_f(v, '{:.3g}') if isinstance(v, float) else v}" for k, v in row.items()))
    for name in ("gemm", "gemm_cublas"):
        gemm = st.get(name, {}).get("gemm")
        if not gemm:
            continue
        if gemm.get("torch_copy_gbs"):
            lines.append(f"{name}: device copy, JAX {gemm['copy_gbs']:.0f} GB/s, torch {gemm['torch_copy_gbs']:.0f} GB/s")
        lines.append(f"{name}: decode matmuls at {gemm['rows']} rows, weight bytes per second over the copy's "
                     f"({gemm['copy_gbs']:.0f} GB/s), jax [K,N] / jax [N,K] / torch: " + ", ".join(
                     f"{k} {_f(r.get('jax_kn_of_copy'), '{:.0%}')}/{_f(r.get('jax_nk_of_copy'), '{:.0%}')}/"
                     f"{_f(r.get('torch_of_copy'), '{:.0%}')}" for k, r in gemm["shapes"].items()))
    for name in ("moe", "moe_kernel", "moe_gpt_oss", "moe_gpt_oss_mxfp4"):
        moe = st.get(name, {}).get(name)
        label = "GPT-OSS MoE" if moe and moe.get("family") == "gpt_oss" else "MoE"
        kernel = moe.get("moe_kernel", "loop") if moe else ""
        if moe and moe.get("mxfp4"):
            kernel += ", MXFP4 experts " + ("4-bit" if _mxfp4_kept(moe) else "dequantized")
        if not moe:  # cut short: the runs it finished
            for run in st.get(name, {}).get("runs", ()):
                lines.append(f"{name} (stopped before its summary): {run['side']} at batch {run['batch']} {run['tok_s']:.0f} tok/s, "
                             f"step {run['step_ms']:.1f} ms")  # fmt: skip
        for row in moe["summary"] if moe else ():
            lines.append(f"{label} ({kernel}) at batch {row['batch']}: {row['moe']['tok_s']:.0f} tok/s against the dense model's "
                         f"{row['dense']['tok_s']:.0f} (x{row['moe_over_dense_tok_s']:.2f}); step {row['moe']['step_ms']:.1f} ms; "
                         f"compiles after warm-up {moe['compiles_after_warmup']}")
        if moe and moe.get("mxfp4"):
            lines.append(_mxfp4_line(name, moe))
    lines += _mla_lines(st.get("mla", {}).get("mla"))
    att = st.get("attention", {}).get("attention")
    if att:
        for g in att["goals"]:
            lines.append(f"attention {g.get('name', '')}: {_f(g.get('of_copy_bw'), '{:.1%}')} of copy bandwidth "
                         f"(goal {g.get('min_of_copy_bw', 0):.0%}), passed {g.get('passed')}")
    if st.get("attention_sweep", {}).get("attention_sweep"):
        import bench_attention

        lines += [bench_attention.sweep_line(row) for row in st["attention_sweep"]["attention_sweep"]["rows"]]
    for name, stage in st.items():
        if stage.get("error") or stage.get("rc") not in (0, None):
            lines.append(f"stage {name}: rc {stage.get('rc')} {stage.get('error', '')}")
    if report["dropped"]:
        lines.append("dropped: " + "; ".join(report["dropped"]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""One command checks an accelerator: is the compiled Pallas kernel right, is the engine right with it, how fast
are they, and are the goals met. Run it on a machine with a GPU or TPU:

    python scripts/check_accelerator.py            # everything, with the full benchmarks (tens of minutes)
    python scripts/check_accelerator.py --quick    # the same checks, shorter benchmarks

Why: the project's development machines have no GPU, so the kernel is tested there only in interpret mode and
lowered (exported) for cuda/tpu; this script is the whole list of what a session with an accelerator should run,
and its one JSON is the record.

How, stage by stage (each runs even when an earlier one failed; a stage's error is recorded and the next goes on):

1. kernel cases: the platform's kernel (jaxpaged.platforms.get().attention_backend("pallas", head_dim), compiled,
   not interpret) against the definition (naive_paged_attention) on tests/attention_cases.py's ACCELERATOR_CASES:
   float32 and bfloat16, GQA 1/4/8, sliding windows, soft-caps, ALiBi, block sizes 16-128, head dims 64/128/256.
   kv_cache_cases: the same cases over an int8 and an fp8 KV cache (a QuantizedKV), against the definition over
   its dequantized values.
2. launches: the kernel compiled for every block size (8-128) and head dim (16-256), 16- and 32-bit, decode and
   prefill buckets: each launch the kernel picks must fit the device's shared memory and registers.
3. engine parity: the engine (float32, attention_backend="pallas") on a random tiny Llama against transformers'
   greedy generate: every prompt's tokens must be equal.
4. bench_attention: scripts/bench_attention.py --json (the kernel's K/V bandwidth against the measured copy
   bandwidth; with --quick its short grid, which still holds the goals' cases).
5. bench_throughput: scripts/bench_throughput.py --json on Llama-3.2-1B's shape (scripts/configs/llama-3.2-1b.json,
   random weights, bf16, 256 requests of 100-1024 prompt and output tokens, transformers one request at a time on
   the first 16 and in static batches; --quick: 64 requests of 100-512, the first 4, no static batches; on a TPU
   without transformers, which would run on the host's CPU).

The benchmarks run as subprocesses (their own memory; their output is echoed). The goals (issue 20, step 8):
decode at batch 64, context 2k reads >= 70% of the copy bandwidth; one request at context 32k >= 50%;
end-to-end output tokens/s >= 24x transformers' generate one request at a time and >= 50% of the roofline
bench_throughput prints. A missed goal is reported, not a failure; the exit status is 1 when a correctness stage
(1-3) fails or errs, else 0.

Everything goes into one JSON, docs/data/check_accelerator_<device-kind>_<date>.json (--out DIR, --json PATH):
device, JAX/jaxlib/plugin versions, driver and CUDA version where nvidia-smi says, every case's max error and
verdict, the parity result, both benchmarks' JSON, the goals, and the machine's load around each stage.

On a CPU it says there is no accelerator and exits 0. --interpret-on-cpu (for tests) runs stages 1 and 2 there
instead, with the kernel in interpret mode on two small cases and a short parity run; add --skip-bench to leave
out the benchmarks, or --stages to pick stages.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform as host_platform
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))
sys.path.insert(0, str(REPO))  # this checkout's jaxpaged and tests/, not an installed copy

import machine_load  # noqa: E402
import provenance  # noqa: E402
from workload import Stopwatch  # noqa: E402

_SET_PREALLOCATE = False  # main() stops this process taking most of the device's memory (the benchmarks need it)

STAGES = ("kernel_cases", "kv_cache_cases", "launches", "parity", "bench_attention", "bench_throughput")
THROUGHPUT_MODEL = "scripts/configs/llama-3.2-1b.json"
THROUGHPUT_ARGS = {  # the workload, and a short one
    "full": ["--num-requests", "256", "--min-len", "100", "--max-len", "1024", "--hf-single-limit", "16"],
    "quick": ["--num-requests", "64", "--min-len", "100", "--max-len", "512", "--hf-single-limit", "4", "--skip-hf-batch"],
}
THROUGHPUT_GOALS = {"vs_transformers_generate": 24.0, "of_roofline": 0.50}
# The parity model: a random GQA Llama with the kernels' smallest real head dim (64), 2 layers, 256 positions.
PARITY_CONFIG = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                     max_position_embeddings=256)  # fmt: skip
PARITY_PROMPTS = {  # (prompt lengths, max new tokens); 100 and 130 exceed the step budget: chunked prefill
    "full": ([1, 5, 17, 40, 100, 130, 7, 63], [32, 24, 16, 32, 24, 16, 32, 24]),
    "tiny": ([3, 17, 40], [6, 4, 8]),
}


def shard_arg(value: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in value.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N such as 0/4, got {value!r}") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"K/N needs 0 <= K < N, got {value!r}")
    return k, n


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shorter benchmarks (bench_attention --quick, a 64-request throughput run)")
    p.add_argument("--skip-bench", action="store_true", help="only the correctness stages (kernel cases, engine parity)")
    p.add_argument("--stages", default=",".join(STAGES), type=lambda v: [x for x in v.split(",") if x],
                   help=f"the stages to run, comma-separated (default: all: {','.join(STAGES)})")
    p.add_argument("--out", default=str(REPO / "docs" / "data"), metavar="DIR", help="folder for the JSON (default docs/data)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the JSON here instead (overrides --out)")
    p.add_argument("--bench-timeout", type=float, default=3600.0, metavar="S", help="seconds each benchmark may run (default 3600)")
    p.add_argument("--shard", default=(0, 1), type=shard_arg, metavar="K/N",
                   help="run only every N-th kernel case from the K-th (0-based), to split them over N processes")
    p.add_argument("--interpret-on-cpu", action="store_true", help=argparse.SUPPRESS)  # tests: stages 1-2 interpreted, tiny
    return p.parse_args(argv)


# -- environment ----------------------------------------------------------------------------------------------


def environment(platform_name: str) -> dict:
    import jax

    device = jax.devices()[0]
    try:
        platform_version = device.client.platform_version
    except Exception:  # noqa: BLE001 - only a description
        platform_version = None
    packages = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt", "libtpu", "torch", "transformers")
    return {
        "platform": platform_name, "backend": jax.default_backend(), "device_kind": device.device_kind,
        "num_devices": jax.device_count(), "platform_version": platform_version,
        "versions": provenance.versions(packages) | {"python": host_platform.python_version()},
        "nvidia_smi": provenance.nvidia_smi() if platform_name == "gpu" else None, "host": host_platform.platform(),
        "cpu_model": machine_load.cpu_model(), "cpu_cores": machine_load.cores(),
    }  # fmt: skip


def slug(text: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


# -- stages ---------------------------------------------------------------------------------------------------


def kernel_stage(cases, *, interpret: bool, kv_cache_dtypes=("auto",), shard=(0, 1)) -> dict:
    """Each case (under each KV cache dtype) on the platform's Pallas kernel against the definition; a case that
    raises fails alone. shard (k, n): every n-th of those from the k-th, so n processes share the compiles."""
    from jaxpaged import platforms

    from tests.attention_cases import compare_kernel

    platform = platforms.get()
    results = []
    k, n = shard
    for kc, kv_cache_dtype in [(kc, kind) for kind in kv_cache_dtypes for kc in cases][k::n]:
        clock = Stopwatch()
        try:
            backend = platform.attention_backend("pallas", kc.head_dim)
            if getattr(backend, "interpret", None) is not interpret:
                raise RuntimeError(f"expected the kernel {'interpreted' if interpret else 'compiled'}, got {backend!r}")
            result = compare_kernel(backend, kc, kv_cache_dtype) | {"backend": repr(backend)}
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - recorded as this case's failure
            result = {"case": kc.name, "passed": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        result |= {"dtype": kc.dtype, "kv_cache_dtype": kv_cache_dtype, "seconds": clock.seconds}
        results.append(result)
        verdict = "ok  " if result["passed"] else "FAIL"
        detail = f"max error {result['max_abs_error']:.2e} (atol {result['atol']:.0e})" if "max_abs_error" in result else result.get("error", "")
        print(f"  {verdict} {result['case']:48} {detail}", flush=True)
    passed = sum(r["passed"] for r in results)
    return {"status": "ok" if passed == len(results) else "failed", "passed": passed, "total": len(results), "cases": results}


def launch_stage(head_dims=(16, 32, 64, 128, 256), block_sizes=(8, 16, 32, 64, 128)) -> dict:
    """Compile the platform's kernel for every block size (8-128) and head dim (16-256), 16- and 32-bit, in a
    decode and a prefill bucket: the launch each picks must fit the device (shared memory, registers)."""
    import jax
    import jax.numpy as jnp

    from jaxpaged import platforms
    from jaxpaged.pallas_kernels import AttentionMetadata, AttentionSpec

    platform = platforms.get()
    sd = jax.ShapeDtypeStruct
    results = []
    for head_dim in head_dims:
        backend = platform.attention_backend("pallas", head_dim)
        for block_size in block_sizes:
            for dtype in (jnp.bfloat16, jnp.float32):
                for tokens, seqs in ((8, 8), (512, 16)):
                    name = f"d{head_dim}_b{block_size}_{jnp.dtype(dtype).name}_{'decode' if tokens <= seqs else 'prefill'}"
                    width = 4096 // block_size
                    md = AttentionMetadata(sd((tokens,), jnp.int32), sd((seqs, width), jnp.int32), sd((seqs,), jnp.int32),
                                           sd((seqs + 1,), jnp.int32))  # fmt: skip
                    args = (sd((tokens, 32, head_dim), dtype), sd((tokens, 8, head_dim), dtype), sd((tokens, 8, head_dim), dtype),
                            sd((2, 2, seqs * width, 8, block_size, head_dim), dtype), sd((), jnp.int32), md)  # fmt: skip
                    fn = jax.jit(lambda q, k, v, c, layer, md: backend(q, k, v, c, layer, md, AttentionSpec(head_dim**-0.5)))
                    try:
                        fn.lower(*args).compile()
                        results.append({"launch": name, "passed": True})
                    except Exception as e:  # noqa: BLE001 - recorded as this launch's failure
                        results.append({"launch": name, "passed": False, "error": f"{type(e).__name__}: {str(e)[:500]}"})
                        print(f"  FAIL {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    passed = sum(r["passed"] for r in results)
    print(f"  {passed}/{len(results)} launches compiled", flush=True)
    return {"status": "ok" if passed == len(results) else "failed", "passed": passed, "total": len(results), "launches": results}


def parity_stage(size: str, *, interpret: bool) -> dict:
    """The engine with the Pallas kernel against transformers' greedy generate, float32, one random tiny Llama."""
    from jaxpaged import LLM, SamplingParams

    from tests.hf_reference import hf_greedy, random_hf_model, random_prompts, save_hf_model, tiny_llama_config

    config = tiny_llama_config(**PARITY_CONFIG)
    hf = random_hf_model(config)
    lengths, max_tokens = PARITY_PROMPTS[size]
    prompts = random_prompts(config.vocab_size, lengths, seed=3)
    engine_args = dict(dtype="float32", attention_backend="pallas", max_num_seqs=8, max_num_batched_tokens=64, block_size=16,
                       max_model_len=256, num_kv_blocks=160, precompile=not interpret, log_level="WARNING")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="check_accelerator-") as folder:
        save_hf_model(hf, Path(folder))
        llm = LLM(folder, **engine_args)
        attention = _engine_attention(llm)
        if attention is not None and getattr(attention, "interpret", None) is not interpret:
            raise RuntimeError(f"expected the engine's kernel {'interpreted' if interpret else 'compiled'}, got {attention!r}")
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        stats = dict(llm.get_stats())
        del llm
    rows = []
    for prompt, m, ours in zip(prompts, max_tokens, got):
        want = hf_greedy(hf, prompt, m)
        mismatch = next((i for i, (a, b) in enumerate(zip(ours, want)) if a != b), None if len(ours) == len(want) else min(len(ours), len(want)))
        rows.append({"prompt_len": len(prompt), "max_tokens": m, "equal": ours == want, "first_mismatch": mismatch,
                     **({} if ours == want else {"jaxpaged": ours, "transformers": want})})  # fmt: skip
        print(f"  {'ok  ' if ours == want else 'FAIL'} prompt of {len(prompt):3} tokens, {m} greedy tokens"
              + ("" if ours == want else f": first difference at token {mismatch}"), flush=True)  # fmt: skip
    equal = sum(r["equal"] for r in rows)
    hf_config = {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                 "num_attention_heads", "num_key_value_heads", "head_dim")}  # fmt: skip
    return {"status": "ok" if equal == len(rows) else "failed", "equal": equal, "total": len(rows), "backend": repr(attention),
            "model": hf_config, "engine_args": engine_args, "prompts": rows, "num_compiles_after_warmup": stats.get("num_compiles_after_warmup")}  # fmt: skip


def _engine_attention(llm):
    """The attention backend the engine's model layers call (the engine tests read it from the same place)."""
    try:
        return llm.engine.loaded.model.layers[0].self_attn.backend
    except AttributeError:
        return None


def _pump(stream, echo, tail: collections.deque) -> None:
    for line in stream:
        echo.write(line)
        echo.flush()
        tail.append(line)


def bench_stage(script: str, args: list[str], timeout: float) -> dict:
    """scripts/<script> ARGS --json TMP in a subprocess, its output echoed; its JSON embedded as `report`."""
    env = dict(os.environ)
    if _SET_PREALLOCATE:
        env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)  # the benchmark runs as it would on its own
    with tempfile.TemporaryDirectory(prefix="check_accelerator-") as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, str(SCRIPTS / script), *args, "--json", str(out)]
        print(f"$ {shlex.join(cmd)}", flush=True)
        tails = {"stdout": collections.deque(maxlen=60), "stderr": collections.deque(maxlen=60)}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        pumps = [threading.Thread(target=_pump, args=(proc.stdout, sys.stdout, tails["stdout"]), daemon=True),
                 threading.Thread(target=_pump, args=(proc.stderr, sys.stderr, tails["stderr"]), daemon=True)]  # fmt: skip
        for t in pumps:
            t.start()
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            returncode = proc.wait()
            error = f"timed out after {timeout:.0f}s"
        else:
            error = None if returncode == 0 else f"exited with status {returncode}"
        for t in pumps:
            t.join(timeout=10)
        result = {"command": shlex.join(cmd[1:]), "returncode": returncode, "stdout_tail": "".join(tails["stdout"])[-4000:]}
        if error is None and out.exists():
            return result | {"status": "ok", "report": json.loads(out.read_text())}
        return result | {"status": "error", "error": error or "wrote no JSON", "stderr_tail": "".join(tails["stderr"])[-4000:]}


def run_stage(report: dict, name: str, fn) -> dict:
    """fn() as one stage: timed, the machine watched, any exception recorded as the stage's error."""
    print(f"== {name}", flush=True)
    clock = Stopwatch()
    with machine_load.SideWatch(name) as watch:
        try:
            result = fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - the next stage still runs (pytest's importorskip raises a BaseException)
            traceback.print_exc()
            result = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    result["seconds"] = clock.seconds
    report["stages"][name] = result
    report["machine_load"]["stages"][name] = watch.record
    return result


# -- goals and summary ----------------------------------------------------------------------------------------


def goals(report: dict, quick: bool) -> list[dict]:
    """The issue's four goals, each with its measured value and passed True/False (None: not measured)."""
    from bench_attention import GOALS  # the sibling script's goals: their cases and thresholds

    out = []
    attention = report["stages"].get("bench_attention", {}).get("report") or {}
    measured = {g["name"]: g for g in attention.get("goals", [])}
    for goal in GOALS:
        g = measured.get(goal["name"], {})
        what = f"decode, batch {goal['batch']}, context {goal['context']}: K/V read >= {goal['min_of_copy_bw']:.0%} of copy bandwidth"
        out.append({"name": f"attention_{goal['name']}", "what": what, "value": g.get("of_copy_bw"),
                    "target": goal["min_of_copy_bw"], "passed": g.get("passed")})  # fmt: skip
    throughput = report["stages"].get("bench_throughput", {}).get("report") or {}
    ratio = (throughput.get("ratios") or {}).get("jaxpaged/hf-single")
    achieved = (throughput.get("roofline") or {}).get("achieved")
    note = "quick workload, not the goal's: not judged" if quick else None
    for name, what, value, target in (
        ("throughput_vs_transformers_generate", "Llama-3.2-1B bf16 offline: >= 24x transformers' generate one at a time", ratio,
         THROUGHPUT_GOALS["vs_transformers_generate"]),
        ("throughput_of_roofline", "Llama-3.2-1B bf16 offline: >= 50% of the roofline", achieved, THROUGHPUT_GOALS["of_roofline"]),
    ):  # fmt: skip
        passed = None if value is None or quick else bool(value >= target)
        out.append({"name": name, "what": what, "value": value, "target": target, "passed": passed} | ({"note": note} if note else {}))
    return out


def stage_line(name: str, stage: dict | None) -> str:
    if stage is None:
        return f"{name:18} skipped"
    status, seconds = stage["status"], stage.get("seconds", 0.0)
    if status == "error":
        return f"{name:18} ERROR ({seconds:.0f}s): {stage['error'][:200]}"
    if name in ("kernel_cases", "kv_cache_cases"):
        errors = {}
        for c in stage["cases"]:
            if "max_abs_error" in c:
                errors[c["dtype"]] = max(errors.get(c["dtype"], 0.0), c["max_abs_error"])
        worst = ", ".join(f"{d} {e:.1e}" for d, e in errors.items())
        return f"{name:18} {stage['passed']}/{stage['total']} cases within tolerance (largest error: {worst}) ({seconds:.0f}s)"
    if name == "launches":
        return f"{name:18} {stage['passed']}/{stage['total']} launches compiled ({seconds:.0f}s)"
    if name == "parity":
        return f"{name:18} {stage['equal']}/{stage['total']} prompts' greedy tokens equal to transformers' ({seconds:.0f}s)"
    return f"{name:18} ok ({seconds:.0f}s)"


def goal_line(g: dict) -> str:
    value = g["value"]
    shown = "not measured" if value is None else (f"{value:.1%}" if g["target"] < 1 else f"{value:.1f}x")
    verdict = {True: "PASS", False: "MISSED", None: "-"}[g["passed"]]
    return f"  {verdict:6} {g['what']}: {shown}" + (f" ({g['note']})" if g.get("note") else "")


def main(argv=None) -> int:
    global _SET_PREALLOCATE
    args = parse_args(argv)
    if "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ:  # read when JAX first opens the device, below
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        _SET_PREALLOCATE = True
    import jax

    from jaxpaged import platforms

    platform = platforms.get()
    if platform.name == "cpu" and not args.interpret_on_cpu:
        print(f"no accelerator: JAX's default backend is {jax.default_backend()} ({jax.devices()[0].device_kind}); "
              f"nothing to check. Run this on a machine with a GPU or TPU.")  # fmt: skip
        return 0
    interpret = platform.name == "cpu"
    env = environment(platform.name)
    print(f"check_accelerator: {env['device_kind']} ({platform.name}{', kernel interpreted' if interpret else ''}), "
          f"jax {env['versions'].get('jax')}, jaxlib {env['versions'].get('jaxlib')}", flush=True)  # fmt: skip
    today = provenance.today()
    report = {
        "tool": "scripts/check_accelerator.py", "argv": sys.argv[1:] if argv is None else list(argv), "date": today,
        "started": provenance.utc_now(), "quick": args.quick,
        "interpret": interpret, "environment": env, "stages": {},
        "machine_load": {"cpu_model": env["cpu_model"], "cores": env["cpu_cores"], "stages": {}},
    }  # fmt: skip

    from tests.attention_cases import ACCELERATOR_CASES, SMOKE_CASES

    cases = SMOKE_CASES if interpret else ACCELERATOR_CASES
    wanted = set(args.stages)
    if args.skip_bench:
        wanted -= {"bench_attention", "bench_throughput"}
    if "kernel_cases" in wanted:
        run_stage(report, "kernel_cases", lambda: kernel_stage(cases, interpret=interpret, shard=args.shard))
    if "kv_cache_cases" in wanted:
        run_stage(report, "kv_cache_cases", lambda: kernel_stage(cases, interpret=interpret, kv_cache_dtypes=("int8", "fp8"), shard=args.shard))
    if not interpret and "launches" in wanted:
        run_stage(report, "launches", launch_stage)
    if "parity" in wanted:
        run_stage(report, "parity", lambda: parity_stage("tiny" if interpret else "full", interpret=interpret))
    if "bench_attention" in wanted:
        run_stage(report, "bench_attention", lambda: bench_stage("bench_attention.py", ["--quick"] if args.quick else [], args.bench_timeout))
    if "bench_throughput" in wanted:
        throughput_args = ["--model", THROUGHPUT_MODEL, "--dtype", "bfloat16", "--settle-s", "0"]
        throughput_args += THROUGHPUT_ARGS["quick" if args.quick else "full"]
        if platform.name == "tpu":  # torch has no TPU here: transformers would run on the host's CPU, no comparison
            throughput_args += ["--skip-hf-single", "--skip-hf-batch"]
        run_stage(report, "bench_throughput", lambda: bench_stage("bench_throughput.py", throughput_args, args.bench_timeout))
    report["goals"] = goals(report, args.quick)
    correct = all(report["stages"][name]["status"] == "ok" for name in ("kernel_cases", "kv_cache_cases", "launches", "parity")
                  if name in report["stages"])  # fmt: skip
    report["correct"] = correct
    report["finished"] = provenance.utc_now()

    device = slug(env["device_kind"]) + ("-interpret" if interpret else "")
    path = Path(args.json) if args.json else Path(args.out) / f"check_accelerator_{device}_{today}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")

    print(f"\n== summary: {env['device_kind']} ({platform.name})")
    for name in STAGES:
        print(stage_line(name, report["stages"].get(name)))
        if name in ("kernel_cases", "kv_cache_cases") and name in report["stages"]:
            for c in report["stages"][name].get("cases", []):
                if not c["passed"]:
                    print(f"    FAIL {c['case']}: " + (c.get("error") or f"error {c['max_abs_error']:.2e} > {c['atol']:.0e}, "
                                                        f"padding zero {c['padding_zero']}, shape/dtype {c['shape_and_dtype']}"))  # fmt: skip
    print("goals:")
    for g in report["goals"]:
        print(goal_line(g))
    for line in machine_load.busy_lines(report["machine_load"]["stages"]):
        print(line)
    print(f"correctness: {'PASS' if correct else 'FAIL'}; wrote {path}")
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())

"""Paged attention speed: the kernel (Pallas on GPU/TPU, native on CPU) against the pure-JAX reference,
and against the memory system.

Decode is memory-bound: each step must read every cached K/V byte of the batch once, so the
figure that matters is K/V bytes read per second next to the device's measured copy bandwidth
(an elementwise pass over a large array, counting bytes read + written). Prefill is timed too.

    python scripts/bench_attention.py                 # full grid on GPU/TPU
    python scripts/bench_attention.py --quick          # a few cases (the default on CPU; on GPU/TPU with the goals' cases)
    python scripts/bench_attention.py --json out.json

Every row gives each backend's K/V bytes per second as a fraction of the copy bandwidth ("of bw"). The kernel's
goals (GOALS, issue 20) are two decode cases in bf16, 32 query heads over 8 KV heads of head_dim 128: batch 64 at
context 2,048 reading >= 70% of the copy bandwidth, and one request at context 32,768 reading >= 50% of it (on an
H100, which copies ~3.0 TB/s). Both are printed as PASS/FAIL lines and written to the JSON's `goals`; a goal whose
case did not run (a CPU's --quick grid, another dtype) is "not measured".

On CPU the default pair is the native C++ kernel and the reference; asked for "pallas" there, the
Pallas kernel runs in interpret mode, whose times say nothing about kernel speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import provenance  # noqa: E402 - sibling scripts' modules (this folder is on sys.path when run as a file)
from jaxpaged import platforms  # noqa: E402
from jaxpaged.pallas_kernels import AttentionMetadata, AttentionSpec, kv_cache_shape, paged_attention  # noqa: E402
from jaxpaged.pallas_kernels.backends import TritonAttention  # noqa: E402
from workload import median_seconds  # noqa: E402

TARGET = {"batch": 64, "context": 2048, "head_dim": 128, "kv_heads": 8, "dtype": "bfloat16"}
LONG = {"batch": 1, "context": 32768, "head_dim": 128, "kv_heads": 8, "dtype": "bfloat16"}  # one request, long context
GOALS = [  # decode K/V bytes read per second, as a fraction of the measured copy bandwidth
    {"name": "decode_batch64_ctx2k", **TARGET, "min_of_copy_bw": 0.70},
    {"name": "decode_batch1_ctx32k", **LONG, "min_of_copy_bw": 0.50},
]


def copy_bandwidth(dtype, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Bytes moved per second by a plain device-to-device copy of a large random array (one read and one write of
    each byte): the memory floor's ceiling. An elementwise `x + 1` read 2.3-2.7 TB/s on the H200 whose copy moved
    4.27, so it flattered the floor's fraction (issue 44)."""
    n = nbytes // jnp.dtype(dtype).itemsize
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32).astype(dtype)
    copy = jax.jit(lambda a: a.copy())  # an undonated parameter returned: XLA copies it into the output buffer
    seconds = median_seconds(copy, x, iters=iters)
    return 2 * n * jnp.dtype(dtype).itemsize / seconds


def matmul_rate(dtype, n: int = 8192, iters: int = 10) -> float:
    """FLOP/s of one n x n x n matmul in `dtype` on random data, float32 at the engine's precision (HIGHEST): a
    measured peak (zeros or ones run faster than real data on these GPUs)."""
    dtype = jnp.dtype(dtype)
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    precision = "highest" if dtype == jnp.float32 else None
    matmul = jax.jit(lambda x: jnp.dot(x, x, precision=precision, preferred_element_type=jnp.float32))
    seconds = median_seconds(matmul, a, iters=iters)
    return 2 * n**3 / seconds


def make_step(rng, *, q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype):
    """A step's tensors: each sequence's last q_lens[i] of seq_lens[i] positions are new; the rest is cached."""
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks, width = sum(blocks), max(blocks)
    ids = rng.permutation(num_blocks).astype(np.int32)
    tables = np.zeros((len(seq_lens), width), np.int32)
    start = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = ids[start : start + nb]
        start += nb
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens = int(query_start_loc[-1])
    attn_metadata = AttentionMetadata(
        jnp.full((tokens,), -1, jnp.int32), jnp.asarray(tables), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(query_start_loc)
    )
    key = jax.random.key(0)
    kq, kk, kv, kc = jax.random.split(key, 4)
    q = jax.random.normal(kq, (tokens, heads, head_dim), dtype)
    k = jax.random.normal(kk, (tokens, kv_heads, head_dim), dtype)
    v = jax.random.normal(kv, (tokens, kv_heads, head_dim), dtype)
    cache = jax.random.normal(kc, kv_cache_shape(1, kv_heads, num_blocks, block_size, head_dim), dtype)
    cached_tokens = sum(n - ql for n, ql in zip(seq_lens, q_lens))
    kv_bytes = 2 * cached_tokens * kv_heads * head_dim * jnp.dtype(dtype).itemsize
    return (q, k, v, cache, attn_metadata), kv_bytes


def attention_call(backend, head_dim: int):
    """paged_attention on one backend, jitted: fn(q, k, v, cache, metadata), as every timed case calls it."""
    return jax.jit(lambda q, k, v, c, m: paged_attention(q, k, v, c, 0, m, AttentionSpec(head_dim**-0.5), backend=backend))


def kv_rate(fn, args, kv_bytes: int, *, iters: int, bandwidth: float) -> dict:
    """fn(*args)'s median time (ms) and the step's cached K/V bytes read per second: GB/s, and the fraction of the
    copy bandwidth that decode, being memory-bound, is judged by."""
    seconds = median_seconds(fn, *args, iters=iters)
    return {"ms": seconds * 1e3, "kv_gbps": kv_bytes / seconds / 1e9, "of_copy_bw": kv_bytes / seconds / bandwidth}


def run_case(kind, *, batch, context, q_len, heads, kv_heads, head_dim, block_size, dtype, backends, iters, bandwidth):
    rng = np.random.default_rng(0)
    args, kv_bytes = make_step(
        rng, q_lens=[q_len] * batch, seq_lens=[context] * batch, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype,
    )  # fmt: skip
    row = {"kind": kind, "batch": batch, "context": context, "q_len": q_len, "heads": heads, "kv_heads": kv_heads,
           "head_dim": head_dim, "block_size": block_size, "dtype": jnp.dtype(dtype).name, "kv_bytes": kv_bytes}  # fmt: skip
    for backend in backends:
        fn = attention_call(platforms.get().attention_backend(backend, head_dim), head_dim)
        row |= {f"{backend}_{k}": v for k, v in kv_rate(fn, args, kv_bytes, iters=iters, bandwidth=bandwidth).items()}
    kernel = next((b for b in backends if b != "reference"), None)
    if kernel and "reference" in backends:
        row["speedup"] = row["reference_ms"] / row[f"{kernel}_ms"]
    return row


# The report workload's decode step (gpu_report.py: Llama-3.2-1B's attention, 256 rows at about its mean context)
WORKLOAD_STEP = {"name": "decode_batch256_ctx562_llama1b", "batch": 256, "context": 562, "heads": 32, "kv_heads": 8,
                 "head_dim": 64, "dtype": "bfloat16"}  # fmt: skip
SWEEP_CHUNKS, SWEEP_WARPS, SWEEP_STAGES, SWEEP_SPLITS = (32, 64, 128, 256), (4, 8), (2, 3, 4), (1, 2, 4, 8, 16)


def sweep_cases(tiny: bool) -> list[dict]:
    if tiny:  # interpreted on a CPU: the sweep's plumbing, not its times
        return [{"name": "tiny", "batch": 2, "context": 40, "heads": 4, "kv_heads": 2, "head_dim": 64, "dtype": "float32"}]
    return [WORKLOAD_STEP] + [{k: g[k] for k in ("name", "batch", "context", "kv_heads", "head_dim", "dtype")} | {"heads": 32}
                              for g in GOALS]  # fmt: skip


def sweep(backend, cases: list[dict], *, block_size: int, iters: int, bandwidth: float, tiny: bool = False,
          deadline: float = float("inf"), on_case=None) -> list[dict]:  # fmt: skip
    """The GPU decode kernel's launch (keys a chunk, warps, pipeline stages, then KV splits) tuned per case: each
    launch that fits the device's shared memory is timed, first at the default's splits, then the best one's splits
    varied; a launch whose output differs from the default's is marked and never best. Per case: the default
    launch_config's figure, the best, and every launch tried (failed ones with their error), so DECODE_CONFIGS can be
    set from a GPU's data. Past `deadline` (time.perf_counter()) no new launch is tried; on_case(row) as each ends."""
    from jaxpaged.pallas_kernels.gpu_attention import DEFAULT_SHARED_MEMORY, SHARED_MEMORY_MARGIN, launch_config, shared_memory_estimate

    memory = backend.shared_memory or DEFAULT_SHARED_MEMORY
    out = []
    for case in cases:
        dtype = jnp.dtype(case["dtype"])
        args, kv_bytes = make_step(np.random.default_rng(0), q_lens=[1] * case["batch"], seq_lens=[case["context"]] * case["batch"],
                                   heads=case["heads"], kv_heads=case["kv_heads"], head_dim=case["head_dim"],
                                   block_size=block_size, dtype=dtype)  # fmt: skip
        tried: dict = {}
        tolerance = 1e-4 if dtype == jnp.float32 else 2e-2
        expected = []  # the default launch's output

        def measure(launch):
            if launch in tried or (tried and time.perf_counter() > deadline):
                return
            fn = attention_call(dataclasses.replace(backend, launch=launch), case["head_dim"])
            try:
                got = np.asarray(fn(*args).astype(jnp.float32))
                rate = kv_rate(fn, args, kv_bytes, iters=iters, bandwidth=bandwidth)
            except Exception as exc:  # noqa: BLE001 - a launch Triton cannot build (registers, resources): recorded, skipped
                tried[launch] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                return
            expected.append(got) if not expected else None
            error = float(np.abs(got - expected[0]).max())
            tried[launch] = rate | {"max_error_vs_default": error, "agrees": error <= tolerance}

        default = launch_config(case["batch"], case["batch"], case["head_dim"], dtype.itemsize, shared_memory=memory,
                                num_cores=backend.num_cores, num_kv_heads=case["kv_heads"])  # fmt: skip
        measure(default)
        grid = [(16, 32, 4, 2)] if tiny else [(16, c, w, st) for c in SWEEP_CHUNKS for w in SWEEP_WARPS for st in SWEEP_STAGES]
        for rows, chunk, warps, stages in grid:
            if shared_memory_estimate(rows, chunk, case["head_dim"], dtype.itemsize, stages) <= memory * SHARED_MEMORY_MARGIN:
                measure(dataclasses.replace(default, rows=rows, kv_chunk=chunk, num_warps=warps, num_stages=stages))
        timed = lambda: [(launch, r) for launch, r in tried.items() if r.get("agrees")]  # noqa: E731
        fastest = lambda: min(timed(), key=lambda item: item[1]["ms"], default=(None, None))  # noqa: E731
        for splits in ((1, 2) if tiny else SWEEP_SPLITS) if fastest()[0] else ():
            measure(dataclasses.replace(fastest()[0], num_splits=splits))
        best, result = fastest()
        row = {**case, "kv_bytes": kv_bytes, "default": {"launch": dataclasses.asdict(default), **tried.get(default, {})},
               "best": {"launch": dataclasses.asdict(best), **result} if best else None,
               "tried": [{"launch": dataclasses.asdict(launch), **r} for launch, r in tried.items()]}  # fmt: skip
        out.append(row)
        print(sweep_line(row), flush=True)
        if on_case is not None:
            on_case(row)
    return out


def sweep_line(row: dict) -> str:
    """'decode_batch64_ctx2k: default (16, 128, 4, 3, 8) 0.321 ms 61% of copy bw; best (16, 64, 8, 3, 16) 0.250 ms 78%'."""
    def cell(entry):
        launch = tuple(entry["launch"].values())
        return f"{launch} {entry['ms']:.3f} ms {entry['of_copy_bw']:.0%}" if "ms" in entry else f"{launch} failed"

    failed = sum("error" in t for t in row["tried"])
    best = cell(row["best"]) if row["best"] else "none agreed with the default"
    return (f"sweep {row['name']}: default {cell(row['default'])} of copy bw; best {best} "
            f"(launch: rows, kv_chunk, warps, stages, splits; {len(row['tried'])} tried, {failed} failed)")


def main(argv=None, on_case=None) -> dict:
    """on_case(row): each --sweep case's result as it ends."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few small cases, plus the goals' two cases on GPU/TPU (the default on CPU)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on GPU/TPU) or float32 (default on CPU)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=None, help="timed repetitions per case (median reported)")
    p.add_argument("--backends", default=None, help="comma-separated: pallas, native, reference (default: the platform's kernel and the reference)")
    p.add_argument("--json", default=None, help="write the rows and environment here")
    p.add_argument("--sweep", action="store_true", help="tune the GPU decode kernel's launch on the goals' cases and the "
                   "report workload's decode step instead of the grid (on a CPU: one tiny case, interpreted)")
    p.add_argument("--deadline-s", type=float, default=None, help="--sweep tries no new launch after this many seconds")
    args = p.parse_args(argv)
    started = time.perf_counter()

    platform = platforms.get().name
    quick = args.quick or platform == "cpu"
    dtype = jnp.dtype(args.dtype or ("float32" if platform == "cpu" else "bfloat16"))
    iters = args.iters or (3 if platform == "cpu" else 20)
    backends = (args.backends or ("native,reference" if platform == "cpu" else "pallas,reference")).split(",")
    bandwidth = copy_bandwidth(dtype, nbytes=(256 << 20) if platform == "cpu" else (2 << 30))
    device = jax.devices()[0].device_kind
    print(f"device: {device} ({platform}), jax {jax.__version__}, copy bandwidth {bandwidth / 1e9:.1f} GB/s, {dtype.name}")
    if platform == "cpu" and "pallas" in backends:
        print("note: on CPU the kernel runs in interpret mode; its times are not kernel speed")

    if args.sweep:
        backend = platforms.get().attention_backend("pallas", 64)
        if not isinstance(backend, TritonAttention):
            p.error(f"--sweep tunes the GPU (Triton) kernel, and {platform}'s is {type(backend).__name__}")
        tiny = platform == "cpu"
        deadline = started + args.deadline_s if args.deadline_s is not None else float("inf")
        rows = sweep(backend, sweep_cases(tiny), block_size=args.block_size, iters=1 if tiny else (args.iters or 20),
                     bandwidth=bandwidth, tiny=tiny, deadline=deadline, on_case=on_case)  # fmt: skip
        env = {"device": device, "platform": platform, "jax": jax.__version__, "copy_bandwidth_gbps": bandwidth / 1e9,
               "date": provenance.today(), "num_cores": backend.num_cores, "shared_memory": backend.shared_memory}  # fmt: skip
        report = {"env": env, "sweep": rows}
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return report

    goal_cases = [(g["batch"], g["context"]) for g in GOALS]
    if quick:
        decode = [(1, 128), (8, 512), (16, 2048)] + ([] if platform == "cpu" else goal_cases)
        prefill = [(1, 256, 256), (2, 512, 128)]
    else:
        decode = [(b, c) for b in (1, 8, 64, 256) for c in (128, 512, 2048, 8192)]
        decode += [c for c in goal_cases if c not in decode]
        prefill = [(1, 2048, 2048), (4, 2048, 512), (8, 4096, 256), (1, 8192, 2048)]
    shape = {"heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": args.block_size, "dtype": dtype}  # Llama-3-8B's attention
    rows = []
    header = f"{'kind':8}{'batch':>6}{'ctx':>6}{'q_len':>6} | " + " | ".join(
        f"{b:>9} ms {'GB/s':>7} {'of bw':>6}" for b in backends
    )
    print(header + ("   speedup" if len(backends) == 2 else ""))
    cases = [("decode", b, c, 1) for b, c in decode] + [("prefill", b, c, q) for b, c, q in prefill]
    for kind, batch, context, q_len in cases:
        row = run_case(kind, batch=batch, context=context, q_len=q_len, backends=backends, iters=iters,
                       bandwidth=bandwidth, **shape)  # fmt: skip
        rows.append(row)
        cells = " | ".join(
            f"{row[f'{b}_ms']:12.3f} {row[f'{b}_kv_gbps']:7.1f} {row[f'{b}_of_copy_bw']:6.1%}" for b in backends
        )
        print(f"{kind:8}{batch:>6}{context:>6}{q_len:>6} | {cells}" + (f"   {row['speedup']:6.2f}x" if "speedup" in row else ""))

    kernel = next((b for b in backends if b != "reference"), None)
    target = next(
        (r for r in rows if r["kind"] == "decode" and r["batch"] == TARGET["batch"] and r["context"] == TARGET["context"]),
        None,
    )
    if target and kernel and "speedup" in target and dtype.name == TARGET["dtype"]:
        print(f"target case (decode, batch 64, context 2048, bf16): {target['speedup']:.2f}x the reference (goal >= 2x)")
    goals = goal_results(rows, kernel, dtype.name)
    for line in goal_lines(goals):
        print(line)
    env = {"device": device, "platform": platform, "jax": jax.__version__, "copy_bandwidth_gbps": bandwidth / 1e9,
           "date": provenance.today(), "dtype": dtype.name, "kernel": kernel, "backends": backends,
           "quick": quick, "iters": iters}  # fmt: skip
    report = {"env": env, "rows": rows, "goals": goals}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


def goal_results(rows: list[dict], kernel: str | None, dtype: str) -> list[dict]:
    """Each goal with the kernel's measured fraction of the copy bandwidth and PASS (True) / FAIL (False); passed is
    None (not measured) when the goal's case, dtype or a kernel backend is missing from this run."""
    out = []
    for goal in GOALS:
        row = next(
            (r for r in rows if r["kind"] == "decode" and all(r[k] == goal[k] for k in ("batch", "context", "head_dim", "kv_heads", "dtype"))),
            None,
        )
        fraction = row.get(f"{kernel}_of_copy_bw") if row is not None and kernel else None
        result = {"backend": kernel, "of_copy_bw": fraction, "passed": None if fraction is None else bool(fraction >= goal["min_of_copy_bw"])}
        if row is not None and kernel:
            result["kv_gbps"] = row.get(f"{kernel}_kv_gbps")
        out.append(goal | result)
    return out


def goal_lines(goals: list[dict]) -> list[str]:
    """One line per goal: 'goal decode batch 64, context 2048 (bf16): 74% of copy bandwidth (>= 70%): PASS'."""
    lines = []
    for g in goals:
        what = f"goal decode batch {g['batch']}, context {g['context']} ({g['dtype']}, head_dim {g['head_dim']}, {g['kv_heads']} KV heads)"
        if g["passed"] is None:
            lines.append(f"{what}: not measured in this run (>= {g['min_of_copy_bw']:.0%} of copy bandwidth)")
        else:
            verdict = "PASS" if g["passed"] else "FAIL"
            lines.append(f"{what}: {g['of_copy_bw']:.0%} of copy bandwidth (>= {g['min_of_copy_bw']:.0%}): {verdict}")
    return lines


if __name__ == "__main__":
    main()

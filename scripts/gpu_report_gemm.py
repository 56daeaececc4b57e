"""gpu_report.py's gemm stages: the bandwidth at which each decode matmul of the report's model reads its weights,
JAX's GEMM against torch's (cuBLAS) and a plain copy, so a slow decode step can be pinned on the GEMMs or cleared.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from workload import Stopwatch

if TYPE_CHECKING:
    from gpu_report import Partial


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

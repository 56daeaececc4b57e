"""The least time a workload could take on a device, from its weights', K/V's and FLOPs' costs alone: what
bench_throughput.py and gpu_report.py measure jaxpaged against.

Memory: each request holds one of max_num_seqs slots from its prefill to its last token (first come, first served),
so a run has at least as many steps as that schedule; every step reads all the weights once, each decode step reads
its batch's cached K/V, and every token's K/V is written once. Compute: two FLOPs per weight per token processed plus
attention's. The roofline is the larger of the two times, at the device's copy bandwidth and matmul rate (measured as
scripts/bench_attention.py measures them, or given). The token budget per step and the host are not modelled: they
can only add time.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench_throughput import Result


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

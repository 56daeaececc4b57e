"""Why queueing a decode step blocks the host on a GPU (issue 33): the same decode step of `--rows` rows dispatched
back to back in four ways, timing the host's calls and the whole run.

- `engine`: the forward, then the KV write that donates the cache the forward just read (what the engine does);
- `engine_sampled`: the same, then the sampler the engine would pick for the step (a greedy decode);
- `forward`: the forward alone, the cache not donated;
- `write`: the donated write alone;
- `fused`: one executable that attends, writes and returns the cache, donated (its temporaries are recorded: on
  XLA:CPU it holds a full copy of the cache);
- `fused_barrier`: the same with the write tied to the logits by an optimization barrier, so it must follow every
  layer's read of the cache (whether XLA then writes in place: its temporaries).

A variant whose host time per step is near its wall time per step waits on the device inside a call; one whose host
time is small keeps the device fed. On the H200 the engine's dispatch took about the forward's device time.

    python scripts/dispatch_probe.py --model HF_FOLDER --rows 256 --ctx 600 --steps 30 --json probe.json
    python scripts/dispatch_probe.py --tiny     # a tiny random Llama (CPU, tests)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048}  # fmt: skip


def decode_step(runner, rows: int, ctx: int):
    """A decode step of `rows` rows, each reading `ctx` tokens of its own blocks and writing its next slot."""
    step = runner.input_batch.blank(rows)
    meta, bs = step.attention, runner.block_size
    blocks = -(-(ctx + 1) // bs)
    if rows * blocks > runner.num_blocks:
        raise ValueError(f"{rows} rows of {ctx} tokens need {rows * blocks} KV blocks; the pool has {runner.num_blocks}")
    tables = np.arange(rows * blocks, dtype=np.int32).reshape(rows, blocks)
    meta.block_tables[:rows, :blocks] = tables
    meta.seq_lens[:rows] = ctx + 1
    meta.query_start_loc[: rows + 1] = np.arange(rows + 1)
    meta.query_start_loc[rows + 1 :] = rows
    meta.slot_mapping[:rows] = tables[:, ctx // bs] * bs + ctx % bs
    step.positions[:rows] = ctx
    step.logit_rows[:rows] = np.arange(rows)
    return step


def _timed(calls, steps: int, sync) -> dict:
    """Run `calls()` steps times after two untimed ones: host seconds per call and wall per step, one sync at the end."""
    for _ in range(2):
        calls()
    sync()
    host = []
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        calls()
        host.append(time.perf_counter() - t)
    sync()
    wall = (time.perf_counter() - t0) / steps
    return {"host_ms_per_step": 1e3 * statistics.mean(host), "host_ms_max": 1e3 * max(host),
            "wall_ms_per_step": 1e3 * wall, "host_share_of_wall": statistics.mean(host) / wall}  # fmt: skip


def probe(runner, rows: int, ctx: int, steps: int) -> dict:
    import jax

    from jaxpaged.pallas_kernels.attention import write_kv

    step = decode_step(runner, rows, ctx)
    t = step.input_ids.shape[0]
    args = runner._forward_args(step, None)  # (state, kv_cache, packed step, previous tokens)
    forward = runner._executable("forward", runner._forward, t, args)
    _, _, new_kv, slots = forward(*args)
    write = runner._executable("write", runner._write, t, (runner.kv_cache, new_kv, slots))
    state, packed, prev = args[0], args[2], args[3]
    sync = lambda: jax.block_until_ready(runner.kv_cache)  # noqa: E731
    results = {}

    split = {"forward": [], "write": []}

    def engine_step():
        t0 = time.perf_counter()
        out = forward(state, runner.kv_cache, packed, prev)
        t1 = time.perf_counter()
        runner.kv_cache = write(runner.kv_cache, out[2], out[3])
        split["forward"].append(t1 - t0)
        split["write"].append(time.perf_counter() - t1)

    results["engine"] = _timed(engine_step, steps, sync)
    # which of the two calls holds the host (the first two are untimed warm-ups)
    results["engine"].update({f"{k}_call_host_ms": 1e3 * statistics.mean(v[2:]) for k, v in split.items()})
    last = []
    results["forward"] = _timed(lambda: last.append(forward(state, runner.kv_cache, packed, prev)[0]), steps,
                                lambda: jax.block_until_ready(last[-1]))  # fmt: skip

    def write_only():
        runner.kv_cache = write(runner.kv_cache, new_kv, slots)

    results["write"] = _timed(write_only, steps, sync)

    # the whole dispatch as the engine queues a greedy decode step: forward, write, then the sampler on its logits
    sampling_args = runner._sampling_args(step.sampling)
    plan = runner._samplers.plan(step.sampling, suppress=False, bias=False)
    first = forward(state, runner.kv_cache, packed, prev)
    sampler = runner._samplers.executable(first[0].shape[0], plan, (first[0], *sampling_args, runner._no_sampled))
    calls = {"forward": [], "write": [], "sample": []}

    def with_sampler():
        t0 = time.perf_counter()
        out = forward(state, runner.kv_cache, packed, prev)
        t1 = time.perf_counter()
        runner.kv_cache = write(runner.kv_cache, out[2], out[3])
        t2 = time.perf_counter()
        sampler(out[0], *sampling_args, runner._no_sampled)
        calls["forward"].append(t1 - t0), calls["write"].append(t2 - t1), calls["sample"].append(time.perf_counter() - t2)

    results["engine_sampled"] = _timed(with_sampler, steps, sync)
    results["engine_sampled"].update({f"{k}_call_host_ms": 1e3 * statistics.mean(v[2:]) for k, v in calls.items()})

    def fused_impl(state, kv_cache, packed, prev):
        logits, prompt, kv, slot_mapping = runner._forward_impl(state, kv_cache, packed, prev)
        return logits, write_kv(kv_cache, kv, slot_mapping)

    def fused_barrier_impl(state, kv_cache, packed, prev):
        # the write made to depend on the logits, so on every layer's read of the cache: nothing left for XLA to order
        logits, prompt, kv, slot_mapping = runner._forward_impl(state, kv_cache, packed, prev)
        logits, kv = jax.lax.optimization_barrier((logits, kv))
        return logits, write_kv(kv_cache, kv, slot_mapping)

    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
                                      if isinstance(x, jax.Array) else x, (state, runner.kv_cache, packed, prev))  # fmt: skip
    results["cache_bytes"] = sum(x.nbytes for x in jax.tree_util.tree_leaves(runner.kv_cache))
    for name, impl in (("fused", fused_impl), ("fused_barrier", fused_barrier_impl)):
        t0 = time.perf_counter()
        fused = jax.jit(impl, donate_argnums=(1,)).lower(*abstract).compile()
        results[f"{name}_compile_s"] = time.perf_counter() - t0
        results[f"{name}_temp_bytes"] = getattr(fused.memory_analysis(), "temp_size_in_bytes", None)

        def fused_step(fused=fused):
            runner.kv_cache = fused(state, runner.kv_cache, packed, prev)[1]

        results[name] = _timed(fused_step, steps, sync)
    return {"rows": rows, "ctx": ctx, "steps": steps, "bucket": t, "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind, "variants": results}  # fmt: skip


def make_llm(model: str, rows: int, ctx: int, dtype: str):
    from jaxpaged import LLM

    blocks = rows * (-(-(ctx + 1) // 16)) + 64
    return LLM(model, dtype=dtype, max_num_seqs=rows, max_num_batched_tokens=max(rows, 256), num_kv_blocks=blocks,
               max_model_len=max(ctx + 64, 256), precompile=False, background_compile=False, log_level="WARNING")  # fmt: skip


def table(report: dict) -> str:
    lines = [f"dispatch probe: {report['rows']} decode rows at context {report['ctx']}, {report['steps']} steps, "
             f"{report['device']} ({report['backend']})", "| variant | host ms/step | wall ms/step | host / wall |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for name in ("engine", "engine_sampled", "forward", "write", "fused", "fused_barrier"):
        v = report["variants"].get(name)
        if v:
            lines.append(f"| {name} | {v['host_ms_per_step']:.3f} | {v['wall_ms_per_step']:.3f} | {v['host_share_of_wall']:.0%} |")
    v = report["variants"]
    if "forward_call_host_ms" in v.get("engine", {}):
        lines.append(f"engine's calls, host ms: forward {v['engine']['forward_call_host_ms']:.3f}, "
                     f"write {v['engine']['write_call_host_ms']:.3f}")
    if "sample_call_host_ms" in v.get("engine_sampled", {}):
        e = v["engine_sampled"]
        lines.append(f"with the sampler, host ms: forward {e['forward_call_host_ms']:.3f}, write {e['write_call_host_ms']:.3f}, "
                     f"sample {e['sample_call_host_ms']:.3f}")
    for name in ("fused", "fused_barrier"):
        if v.get(f"{name}_temp_bytes") is not None:
            lines.append(f"{name} temporaries {v[f'{name}_temp_bytes'] / 1e6:.1f} MB against a {v['cache_bytes'] / 1e6:.1f} MB cache")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="an HF folder or config.json")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--ctx", type=int, default=600, help="context each row reads (default 600)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    if args.tiny:
        folder = Path("/tmp/jaxpaged-dispatch-probe")
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(TINY))
        args.model = str(folder / "config.json")
        args.rows, args.ctx, args.steps, args.dtype = min(args.rows, 16), min(args.ctx, 64), min(args.steps, 5), "float32"
    if not args.model:
        p.error("--model or --tiny")
    llm = make_llm(args.model, args.rows, args.ctx, args.dtype)
    report = probe(llm.engine.runner, args.rows, args.ctx, args.steps)
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long a trainer's weight sync takes (issue 47): LLM.update_weights of a whole model from arrays already on the
device, by HF name (torch's [out, in]: transposed in the update's program) and by the port's parameter paths (an NNX
State, as a Flax trainer holds it), a subset (one layer's MLP), and sleep/wake_up with the device memory in use
before, asleep and after.

    python scripts/bench_weight_update.py --model scripts/configs/llama-3.2-1b.json --dtype float32 --runs 3

The model's weights are random (a bare config.json); the new weights are drawn on the device, so the timed part is
the update alone, from the call until every new parameter is computed (block_until_ready). The first update of a
set of names compiles its program (reported apart); the others reuse it. On the CPU, float32 weights are repacked
for the native matmul inside that program; on a GPU, a weight already in the engine's dtype and sharding is a
pointer swap. One JSON line per measurement; --json writes them all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def _draw(shapes: dict[str, tuple], dtype, seed: int) -> dict[str, jax.Array]:
    """Random arrays on the device, one jitted draw per shape (a model has a handful)."""
    draw = jax.jit(lambda key, shape: jax.random.normal(key, shape, dtype) * 0.02, static_argnums=1)
    key = jax.random.key(seed)
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        out[name] = draw(jax.random.fold_in(key, i), shape)
    jax.block_until_ready(list(out.values()))
    return out


def _timed_update(llm, weights) -> float:
    t0 = time.perf_counter()
    llm.update_weights(weights, in_flight="abort")
    jax.block_until_ready(llm.engine.runner.state)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="scripts/configs/llama-3.2-1b.json")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None, help="write the measurements here")
    args = p.parse_args(argv)

    from jaxpaged import LLM, SamplingParams

    results = []

    def report(**row):
        row = {"load1": round(os.getloadavg()[0], 2), **row}
        print(json.dumps(row), flush=True)
        results.append(row)

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=16, block_size=16,
              num_kv_blocks=64, log_level="WARNING")  # fmt: skip
    runner = llm.engine.runner
    layout = runner.loaded_layout
    params = sum(int(np.prod(a.shape)) for a in layout.avals)
    report(what="start", seconds=round(time.perf_counter() - t0, 1), parameters=params, backend=jax.default_backend(),
           device=str(runner.device), matmul=runner.matmul_backend)  # fmt: skip
    dtype = jnp.dtype(args.dtype)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(1, 40))}

    # by HF name, torch's layout: what a PyTorch-named trainer sends
    hf_shapes = {}
    for name, spec in layout.specs.items():
        if name in layout.head_aliases:
            continue
        shapes = [tuple(layout.avals[layout.index[path]].shape) for path in spec.paths]
        shape = shapes[0][:-1] + (sum(s[-1] for s in shapes),)
        hf_shapes[name] = shape[::-1] if spec.transpose else shape
    for variant, shapes in (("hf_names", hf_shapes), ("port_paths", dict(zip(layout.paths, (tuple(a.shape) for a in layout.avals))))):
        weights = _draw(shapes, dtype, seed=len(results))
        gb = sum(x.nbytes for x in weights.values()) / 1e9
        times = [_timed_update(llm, weights) for _ in range(args.runs + 1)]
        report(what="update_weights", variant=variant, tensors=len(weights), gigabytes=round(gb, 2),
               first_s=round(times[0], 3), median_s=round(statistics.median(times[1:]), 3), runs_s=[round(t, 3) for t in times[1:]],
               gb_per_s=round(gb / statistics.median(times[1:]), 2))  # fmt: skip
        del weights
    mlp = {name: shape for name, shape in hf_shapes.items() if ".layers.3.mlp." in name}
    weights = _draw(mlp, dtype, seed=99)
    times = [_timed_update(llm, weights) for _ in range(args.runs + 1)]
    report(what="update_weights", variant="one_layer_mlp", tensors=len(weights), first_s=round(times[0], 3),
           median_s=round(statistics.median(times[1:]), 3))  # fmt: skip
    del weights
    llm.generate([prompt], greedy, use_tqdm=False)
    report(what="after_updates", num_compiles_after_warmup=llm.get_stats()["num_compiles_after_warmup"])

    for level in (1, 2):
        asleep = llm.sleep(level)
        t0 = time.perf_counter()
        llm.wake_up(["weights"])
        weights_s = time.perf_counter() - t0
        if level == 2:  # dropped: the trainer sends them
            weights = _draw(hf_shapes, dtype, seed=7)
            weights_s += _timed_update(llm, weights)
            del weights
        t0 = time.perf_counter()
        awake = llm.wake_up(["kv_cache"])
        kv_s = time.perf_counter() - t0
        llm.generate([prompt], greedy, use_tqdm=False)
        report(what="sleep", level=level, bytes_before=asleep["bytes_before"], bytes_asleep=asleep["bytes_asleep"],
               bytes_after=awake["bytes_in_use"], sleep_s=round(asleep["seconds"], 3), wake_weights_s=round(weights_s, 3),
               wake_kv_s=round(kv_s, 3), num_compiles_after_warmup=llm.get_stats()["num_compiles_after_warmup"])  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Tensor vs pipeline vs data parallelism on the same model and workload, in one run: step time and throughput.

Each layout is one engine over the same devices (default 4: T=4, P=4, D=4, and one device as the baseline) on a
random-weight Llama (--layers, --hidden, --heads, ...) driven with the same requests (--num-requests prompts of
--prompt-len tokens, --max-tokens greedy tokens each, EOS ignored). Reported per layout: the mean time of one engine
step (a step of every replica, under D), output tokens per second, and both as a ratio to one device, with the
machine's load around each side (scripts/machine_load.py).

On CPU the "devices" are XLA's simulated host devices (XLA_FLAGS=--xla_force_host_platform_device_count=N, set here
before JAX starts): they share the machine's cores, so this measures each layout's overheads (collectives,
micro-batching, routing), not the speed-up real devices would give.

    python scripts/bench_parallel.py --json docs/data/bench_parallel_cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import machine_load  # noqa: E402
import provenance  # noqa: E402
from workload import Stopwatch, random_prompts  # noqa: E402

log = logging.getLogger("bench")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=4, help="devices every layout spans (default: 4)")
    p.add_argument("--layouts", default="1,T,P,D", help="comma-separated among 1 (one device), T, P, D and PxT "
                   "(P=devices/2 x T=2) (default: 1,T,P,D)")  # fmt: skip
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--matmul-backend", default="auto", help="EngineConfig.matmul_backend for every layout (default: auto)")
    p.add_argument("--settle-s", type=float, default=60.0, help="wait up to this long for the load to drop before each side")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def layouts(names: str, n: int) -> dict[str, dict]:
    table = {
        "1": {},
        "T": {"tensor_parallel_size": n},
        "P": {"pipeline_parallel_size": n},
        "D": {"data_parallel_size": n},
        "PxT": {"pipeline_parallel_size": n // 2, "tensor_parallel_size": 2},
    }
    return {name: table[name] for name in names.split(",")}


def make_model(args, folder: Path) -> Path:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(512, args.prompt_len + args.max_tokens), bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)  # a bare config.json: the engine draws random weights
    return folder / "config.json"


def run_layout(name: str, kwargs: dict, model: Path, args) -> dict:
    from jaxpaged import LLM, SamplingParams

    llm = LLM(str(model), dtype="float32", max_num_seqs=args.max_num_seqs, attention_backend="reference", matmul_backend=args.matmul_backend,
              max_num_batched_tokens=args.max_num_batched_tokens, log_level="WARNING", **kwargs)  # fmt: skip
    engine = llm.engine
    prompts = random_prompts(args.num_requests, args.prompt_len, 2, args.vocab, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # untimed: first-use costs
    machine_load.settle(args.settle_s, machine_load.cores(), log=log.info)
    with machine_load.SideWatch(name) as watch:
        for p in prompts:
            engine.add_request(None, {"prompt_token_ids": p}, params)
        steps, tokens, clock = 0, 0, Stopwatch()
        while engine.has_unfinished_requests():
            tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
            steps += 1
        seconds = clock.seconds
    record = {"layout": name, "kwargs": kwargs, "steps": steps, "output_tokens": tokens, "seconds": seconds,
              "step_ms": 1000 * seconds / steps, "tok_s": tokens / seconds,
              "compiles_after_warmup": engine.num_compiles_after_warmup, "matmul_backend": _runner(engine).matmul_backend,
              "load": watch.record}  # fmt: skip
    log.info("%s: %s", name, {k: v for k, v in record.items() if k != "load"})
    return record


def _runner(engine):
    """The (first replica's) model runner."""
    return engine.replicas[0].runner if hasattr(engine, "replicas") else engine.runner


def main(argv=None) -> int:
    args = parse_args(argv)
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    if flag not in os.environ.get("XLA_FLAGS", ""):  # must be set before JAX starts: run again with it
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip())
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import jax

    records = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(args, Path(tmp))
        for name, kwargs in layouts(args.layouts, args.devices).items():
            records.append(run_layout(name, kwargs, model, args))
    base = next((r for r in records if r["layout"] == "1"), records[0])
    print(f"{'layout':<8}{'step ms':>9}{'x':>7}{'tok/s':>9}{'x':>7}{'matmul':>8}{'load before':>13}{'busy':>6}")
    for r in records:
        load = r["load"]
        print(f"{r['layout']:<8}{r['step_ms']:>9.1f}{r['step_ms'] / base['step_ms']:>7.2f}{r['tok_s']:>9.1f}"
              f"{r['tok_s'] / base['tok_s']:>7.2f}{r['matmul_backend']:>8}{load['loadavg_1min']['before']:>13.2f}{'yes' if load['busy'] else 'no':>6}")  # fmt: skip
    for line in machine_load.busy_lines({r["layout"]: r["load"] for r in records}):
        print(line)
    if args.json:
        out = {"date": provenance.today(), "machine": platform.node(), "cpu": machine_load.cpu_model(),
               "cores": machine_load.cores(), "jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
               "devices": args.devices, "args": vars(args), "records": records}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

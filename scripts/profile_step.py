"""Where an engine step's time goes: host work (scheduling, packing, dispatch, reading results back,
detokenizing and stop checks) against device work, with async scheduling off and on, in one run.

The workload keeps a full decode batch: N requests (default 64) with short random prompts and EOS
ignored. After a warm-up of prefill steps, every step is a decode step of N rows. Host phases are
timed by wrapping the engine's methods; device time is the same jitted step run alone, back to back.
"Exposed host" is step wall time minus device time: the host work the device had to wait for.

    python scripts/profile_step.py                       # built-in model, batch 64
    python scripts/profile_step.py --batch 64 --steps 40 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np

from jaxpaged import LLM, SamplingParams
from jaxpaged.worker.model_runner import DispatchedStep

PHASES = ("schedule", "pack", "dispatch", "wait", "process")


class PhaseTimer:
    """Adds up wall time per phase while installed; `wait` is time blocked on the device's results."""

    def __init__(self):
        self.totals = dict.fromkeys(PHASES, 0.0)

    def wrap(self, owner, name: str, phase: str):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - t0

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)


@contextlib.contextmanager
def instrumented(engine, timer: PhaseTimer):
    undo = [
        timer.wrap(engine.scheduler, "schedule", "schedule"),
        timer.wrap(engine.runner.input_batch, "build", "pack"),
        timer.wrap(engine.runner, "dispatch", "dispatch"),
        timer.wrap(DispatchedStep, "fetch", "wait"),
        timer.wrap(engine, "_update", "process"),  # the update stage: the device's tokens are already read
    ]
    try:
        yield
    finally:
        for u in undo:
            u()


def device_step_seconds(engine, batch: int, ctx: int, repeats: int = 10) -> float:
    """One decode step of `batch` rows on the device alone: the same jitted call, back to back, blocked."""
    runner = engine.runner
    step = runner.input_batch.blank(batch)
    # a realistic decode: every row reads a context of ~ the workload's length
    attn_metadata = step.attention
    blocks = -(-ctx // runner.block_size)
    attn_metadata.block_tables[:batch, :blocks] = np.arange(batch * blocks).reshape(batch, blocks) % runner.num_blocks
    attn_metadata.seq_lens[:batch] = ctx
    attn_metadata.query_start_loc[: batch + 1] = np.arange(batch + 1)
    attn_metadata.query_start_loc[batch + 1 :] = batch
    step.logit_rows[:batch] = np.arange(batch)
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        runner.dispatch(step).fetch()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def profile(llm: LLM, batch: int, prompt_len: int, steps: int, async_scheduling: bool, seed: int) -> dict:
    engine = llm.engine
    engine.config.async_scheduling = async_scheduling
    rng = np.random.default_rng(seed)
    vocab = len(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{i}", {"prompt_token_ids": rng.integers(0, vocab, prompt_len).tolist()}, params)
    while any(len(r.output_token_ids) < 2 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill, until every row decodes
    for _ in range(3):
        engine.step()
    timer = PhaseTimer()
    walls = []
    with instrumented(engine, timer):
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    for i in range(batch):
        engine.abort_request(f"p{i}")
    while engine.has_unfinished_requests():
        engine.step()
    device = device_step_seconds(engine, batch, ctx=prompt_len + steps)
    wall = sum(walls) / steps
    per_step = {k: v / steps for k, v in timer.totals.items()}
    host = sum(v for k, v in per_step.items() if k != "wait")
    exposed = max(0.0, wall - device)
    return {
        "async_scheduling": async_scheduling, "step_ms": wall * 1e3, "device_ms": device * 1e3,
        "host_ms": host * 1e3, "exposed_host_ms": exposed * 1e3, "exposed_host_fraction": exposed / wall,
        "phases_ms": {k: v * 1e3 for k, v in per_step.items()}, "tokens_per_s": batch / wall,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=64, help="decode rows per step (default 64)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per mode (default 30)")
    p.add_argument("--rounds", type=int, default=2, help="alternate sync/async this many times (default 2)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch, max_model_len=args.prompt_len + args.steps + 128,
              log_level="WARNING")  # fmt: skip
    runs = []
    for r in range(args.rounds):
        for mode in (False, True):
            runs.append(profile(llm, args.batch, args.prompt_len, args.steps, mode, seed=r))
            print(json.dumps(runs[-1]), file=sys.stderr)
    print(f"\nbatch {args.batch}, context ~{args.prompt_len}-{args.prompt_len + args.steps}, {jax.devices()[0].device_kind}")
    print("| async | step ms | device ms | host ms (" + ", ".join(PHASES[:3]) + ", process) | exposed host ms | exposed % | tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    summary = {}
    for mode in (False, True):
        mine = [x for x in runs if x["async_scheduling"] == mode]
        avg = {k: statistics.mean(x[k] for x in mine) for k in ("step_ms", "device_ms", "host_ms", "exposed_host_ms", "tokens_per_s")}
        phases = {k: statistics.mean(x["phases_ms"][k] for x in mine) for k in PHASES}
        avg["exposed_host_fraction"] = avg["exposed_host_ms"] / avg["step_ms"]
        summary["async" if mode else "sync"] = {**avg, "phases_ms": phases}
        split = ", ".join(f"{phases[k]:.1f}" for k in ("schedule", "pack", "dispatch", "process"))
        print(f"| {'on' if mode else 'off'} | {avg['step_ms']:.1f} | {avg['device_ms']:.1f} | {avg['host_ms']:.1f} ({split}) "
              f"| {avg['exposed_host_ms']:.1f} | {100 * avg['exposed_host_fraction']:.1f}% | {avg['tokens_per_s']:.1f} |")
    if args.json:
        env = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "python": platform.python_version(),
               "date": datetime.date.today().isoformat(), "batch": args.batch, "prompt_len": args.prompt_len, "steps": args.steps}
        Path(args.json).write_text(json.dumps({"env": env, "summary": summary, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()

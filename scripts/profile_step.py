"""Where an engine step's time goes: host work (scheduling, packing, dispatch, reading results back,
detokenizing and stop checks) against device work, with async scheduling off and on, in one run.

The workload keeps a full decode batch: N requests (default 64) with short random prompts and EOS
ignored. After a warm-up of prefill steps, every step is a decode step of N rows. Host phases are
timed by wrapping the engine's methods; device time is the same jitted step run alone, back to back.
"Exposed host" is step wall time minus device time: the host work the device had to wait for.

    python scripts/profile_step.py                       # built-in model, batch 64
    python scripts/profile_step.py --batch 64 --steps 40 --json out.json
    python scripts/profile_step.py --tiny --batch 256     # host work alone: a model whose device part is ~nothing
    python scripts/profile_step.py --tiny --batch 256 --cprofile 30   # and the 30 costliest host functions

--tiny is the "stub device" of issue 33: a 3-layer, 64-wide random Llama with a 512-token vocabulary (its ids are
the built-in tokenizer's first 512, so detokenizing is real), so a step's device part is small next to the host's.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import io
import json
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np

from jaxpaged import LLM, RequestOutputKind, SamplingParams
from jaxpaged.worker.step_output import DispatchedStep

PHASES = ("schedule", "pack", "dispatch", "wait", "process")


class PhaseTimer:
    """Adds up wall time and the host thread's own CPU time per phase while installed; `wait` is time blocked on the
    device's results. On a CPU backend the device's threads share the cores with the host, which stretches the host's
    wall time but not its thread time: the thread time is the host's own work, what a GPU host would spend."""

    def __init__(self, phases=PHASES):
        self.totals = dict.fromkeys(phases, 0.0)
        self.cpu = dict.fromkeys(phases, 0.0)

    def wrap(self, owner, name: str, phase: str):
        original = getattr(owner, name)
        self.totals.setdefault(phase, 0.0)
        self.cpu.setdefault(phase, 0.0)

        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - t0
                self.cpu[phase] += time.thread_time() - c0

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)


@contextlib.contextmanager
def device_calls(engine, timer: PhaseTimer):
    """Inside dispatch: the forward, its KV write (donating the cache) and the sampler, each a call that queues
    device work; a call that takes long on the host is waiting for the device (on a GPU: spinning, so it counts as
    CPU time too)."""
    runner = engine.runner
    undo = [timer.wrap(runner, "_run_forward", "forward"), timer.wrap(runner, "_run_write", "kv_write"),
            timer.wrap(runner, "_run_fused", "forward_and_kv_write"),  # fused_kv_write's one call
            timer.wrap(runner, "_sample_now", "sample"),
            timer.wrap(runner, "copy", "block_copies"), timer.wrap(runner.input_batch, "sampling", "sampling_rows")]
    try:
        yield
    finally:
        for u in undo:
            u()


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


def profile(llm: LLM, batch: int, prompt_len: int, steps: int, async_scheduling: bool, seed: int,
            profiler: cProfile.Profile | None = None, output_kind=RequestOutputKind.FINAL_ONLY) -> dict:
    engine = llm.engine
    engine.config.async_scheduling = async_scheduling
    rng = np.random.default_rng(seed)
    vocab = engine.loaded.config.vocab_size
    # nobody may finish before the timed steps end: the prompts take prefill_steps(...) steps to get in, during which
    # the first ones already decode (with max_tokens=steps + 64 alone, "256 rows" had thinned to ~80 by the timing)
    max_tokens = engine.max_model_len - prompt_len
    if max_tokens < prefill_steps(batch, prompt_len, engine.config.max_num_batched_tokens) + steps + 8:
        raise ValueError(f"max_model_len ({engine.max_model_len}) leaves too few tokens to keep {batch} rows decoding")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=output_kind)
    for i in range(batch):
        engine.add_request(f"p{i}", {"prompt_token_ids": rng.integers(0, vocab, prompt_len).tolist()}, params)
    # prefill, until every row decodes (its count read, not its output list: reading the list would take the
    # sequence out of the scheduler's DecodeLanes each step)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) + 2 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    if len(engine.scheduler.running) != batch:
        raise RuntimeError(f"{len(engine.scheduler.running)} rows decode, not {batch}: the KV pool is too small")
    timer = PhaseTimer()
    walls = []
    with instrumented(engine, timer), (profiler or contextlib.nullcontext()):
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
    cpu_per_step = {k: v / steps for k, v in timer.cpu.items() if k != "wait"}
    host = sum(v for k, v in per_step.items() if k != "wait")
    exposed = max(0.0, wall - device)
    return {
        "async_scheduling": async_scheduling, "step_ms": wall * 1e3, "device_ms": device * 1e3,
        "host_ms": host * 1e3, "exposed_host_ms": exposed * 1e3, "exposed_host_fraction": exposed / wall,
        "phases_ms": {k: v * 1e3 for k, v in per_step.items()}, "tokens_per_s": batch / wall,
        "host_cpu_ms": sum(cpu_per_step.values()) * 1e3, "phases_cpu_ms": {k: v * 1e3 for k, v in cpu_per_step.items()},
    }


def prefill_steps(batch: int, prompt_len: int, step_tokens: int) -> int:
    """Steps until every prompt is in (some of each step's budget goes to the rows already decoding)."""
    return 2 * -(-batch * prompt_len // step_tokens) + 4


TINY_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 1,
    "eos_token_id": 2,
}  # fmt: skip


def tiny_model(folder: Path) -> str:
    """TINY_CONFIG (random weights) beside the built-in model's tokenizer files (none where the built-in model or
    the gguf package is missing, as on a bare GPU image: then nothing is detokenized); returns its config.json."""
    try:
        from jaxpaged.models import builtin, gguf_io

        gguf = str(builtin.builtin_gguf_path())
        gguf_io.gguf_tokenizer(gguf_io.open_gguf(gguf), gguf).save_pretrained(folder)
    except (ImportError, FileNotFoundError) as exc:
        print(f"tiny model without a tokenizer: {exc}", file=sys.stderr)
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(folder / "config.json")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=64, help="decode rows per step (default 64)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per mode (default 30)")
    p.add_argument("--rounds", type=int, default=2, help="alternate sync/async this many times (default 2)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama with the built-in tokenizer: host work alone")
    p.add_argument("--cumulative", action="store_true", help="every request's output every step, as the server streams "
                   "(default: FINAL_ONLY, as LLM.generate)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the N costliest host functions (cumulative)")
    args = p.parse_args(argv)

    if args.tiny:
        args.model = tiny_model(Path(tempfile.mkdtemp(prefix="jaxpaged-tiny-")))
    profiler = cProfile.Profile() if args.cprofile else None
    step_tokens = max(2 * args.batch, 256)  # every row decodes in one step
    model_len = args.prompt_len + prefill_steps(args.batch, args.prompt_len, step_tokens) + args.steps + 64
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch, max_model_len=model_len,
              max_num_batched_tokens=step_tokens, log_level="WARNING")  # fmt: skip
    runs = []
    for r in range(args.rounds):
        for mode in (False, True):
            runs.append(profile(llm, args.batch, args.prompt_len, args.steps, mode, seed=r, profiler=profiler,
                                output_kind=RequestOutputKind.CUMULATIVE if args.cumulative else RequestOutputKind.FINAL_ONLY))
            print(json.dumps(runs[-1]), file=sys.stderr)
    kind = "cumulative outputs" if args.cumulative else "final outputs only"
    print(f"\n{kind}, batch {args.batch}, context ~{args.prompt_len}-{args.prompt_len + args.steps}, {jax.devices()[0].device_kind}")
    print("| async | step ms | device ms | host wall ms (" + ", ".join(PHASES[:3]) + ", process) | host CPU ms (same) "
          "| exposed host ms | exposed % | tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    summary = {}
    own = ("schedule", "pack", "dispatch", "process")
    for mode in (False, True):
        mine = [x for x in runs if x["async_scheduling"] == mode]
        keys = ("step_ms", "device_ms", "host_ms", "host_cpu_ms", "exposed_host_ms", "tokens_per_s")
        avg = {k: statistics.mean(x[k] for x in mine) for k in keys}
        phases = {k: statistics.mean(x["phases_ms"][k] for x in mine) for k in PHASES}
        cpu = {k: statistics.mean(x["phases_cpu_ms"][k] for x in mine) for k in own}
        avg["exposed_host_fraction"] = avg["exposed_host_ms"] / avg["step_ms"]
        summary["async" if mode else "sync"] = {**avg, "phases_ms": phases, "phases_cpu_ms": cpu}
        split = ", ".join(f"{phases[k]:.2f}" for k in own)
        cpu_split = ", ".join(f"{cpu[k]:.2f}" for k in own)
        print(f"| {'on' if mode else 'off'} | {avg['step_ms']:.1f} | {avg['device_ms']:.1f} | {avg['host_ms']:.2f} ({split}) "
              f"| {avg['host_cpu_ms']:.2f} ({cpu_split}) | {avg['exposed_host_ms']:.1f} | {100 * avg['exposed_host_fraction']:.1f}% "
              f"| {avg['tokens_per_s']:.1f} |")
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.cprofile)
        print(text.getvalue())
    if args.json:
        env = {"model": "tiny" if args.tiny else args.model, "jax": jax.__version__, "device": jax.devices()[0].device_kind, "python": platform.python_version(),
               "date": datetime.date.today().isoformat(), "batch": args.batch, "cumulative": args.cumulative, "prompt_len": args.prompt_len, "steps": args.steps}
        Path(args.json).write_text(json.dumps({"env": env, "summary": summary, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()

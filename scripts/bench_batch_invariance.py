"""Does a greedy answer depend on what else is in the batch? Measure it, per dtype and batch size.

Each target prompt runs alone, then inside batches of 8, 32 and 64 random other requests
(random lengths, so the step shapes and the target's place in the batch change). The figure is
the fraction of targets whose greedy tokens come out identical to the run alone.

    python scripts/bench_batch_invariance.py                       # built-in model, float32 and bfloat16
    python scripts/bench_batch_invariance.py --batch-invariant     # the same with LLM(batch_invariant=True)
    python scripts/bench_batch_invariance.py --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpaged import LLM, SamplingParams  # noqa: E402

TARGETS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colors: 1.",
    "Water boils at",
    "The quick brown fox",
    "In 1969, the first",
    "To make a cup of tea,",
]


def run(llm: LLM, targets, batch_sizes, max_tokens: int, seed: int) -> dict:
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokenizer = llm.get_tokenizer()
    vocab = len(tokenizer)
    alone = [o.outputs[0].token_ids for o in llm.generate(targets, greedy, use_tqdm=False)]
    rng = np.random.default_rng(seed)
    result = {}
    for size in batch_sizes:
        same, seconds, tokens = 0, 0.0, 0
        for i, target in enumerate(targets):
            others = [{"prompt_token_ids": rng.integers(0, vocab, int(rng.integers(4, 200))).tolist()} for _ in range(size)]
            params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(8, 64)), ignore_eos=True) for _ in others]
            place = int(rng.integers(0, size + 1))
            batch = others[:place] + [target] + others[place:]
            t0 = time.perf_counter()
            outs = llm.generate(batch, params[:place] + [greedy] + params[place:], use_tqdm=False)
            seconds += time.perf_counter() - t0
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
            same += outs[place].outputs[0].token_ids == alone[i]
        result[size] = {"identical": same / len(targets), "tokens_per_s": tokens / seconds}
        print(f"  batch of {size:3d} others: {same}/{len(targets)} identical, {tokens / seconds:.1f} tok/s")
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M-Instruct")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batch-sizes", default="8,32,64")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch-invariant", action="store_true", help="run with LLM(batch_invariant=True)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    report = {"env": {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                      "date": datetime.date.today().isoformat(), "batch_invariant": args.batch_invariant}}  # fmt: skip
    for dtype in args.dtypes.split(","):
        print(f"{dtype}, batch_invariant={args.batch_invariant}:")
        kw = {"batch_invariant": True} if args.batch_invariant else {}
        llm = LLM(args.model, dtype=dtype, max_model_len=512, log_level="WARNING", **kw)
        report[dtype] = run(llm, TARGETS, sizes, args.max_tokens, seed=0)
        del llm
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

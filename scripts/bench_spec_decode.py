"""Speculative decoding's gain: output tokens/s with `ngram` speculation against the same engine without it.

The workload is one whose answers repeat their prompts: "Repeat this text exactly: <random words>" to the built-in
model (SmolLM2-135M-Instruct), greedy. Both sides run in one process, alternating, each watched for machine load
(scripts/machine_load.py). `--batch 1` is where speculation pays; `--batch 64` checks that it costs little where
it is turned off (disable_by_batch_size). Greedy outputs of both sides are checked to be identical.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine_load  # noqa: E402 - the sibling script's module

WORDS = ("river stone apple window garden silver paper orange yellow market cloud engine quiet winter summer "
         "forest candle mirror pocket ladder basket thunder violet copper harbor meadow lantern pepper rocket").split()  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--batch", type=int, default=1, help="requests in flight at once (default: 1)")
    p.add_argument("--num-requests", type=int, default=4, help="requests per run (default: 4)")
    p.add_argument("--words", type=int, default=40, help="random words per prompt (default: 40)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request (default: 64)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default: 4)")
    p.add_argument("--repeats", type=int, default=2, help="runs per side, alternating (default: 2)")
    p.add_argument("--settle-s", type=float, default=0.0, help="wait up to this long for the load to drop before each run")
    p.add_argument("--json", default=None, help="write the report here")
    return p.parse_args(argv)


def prompts(args, tokenizer) -> list[str]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(args.num_requests):
        text = " ".join(rng.choice(WORDS, size=args.words))
        messages = [{"role": "user", "content": f"Repeat this text exactly: {text}"}]
        out.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log = logging.getLogger("bench_spec_decode")
    import jax

    from jaxpaged import LLM, SamplingParams

    common = dict(max_num_seqs=max(args.batch, 8), log_level="WARNING")
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    engines = {"off": LLM(args.model, **common), "ngram": LLM(args.model, speculative_config=spec, **common)}
    texts = prompts(args, engines["off"].engine.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)

    def run(llm):
        outs = []
        for i in range(0, len(texts), args.batch):
            outs += llm.generate(texts[i : i + args.batch], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    reference = {side: run(llm) for side, llm in engines.items()}  # untimed: compiles and the prefix cache warm
    if reference["off"] != reference["ngram"]:
        raise RuntimeError("greedy outputs differ with speculation")
    runs, sides = [], {}
    for k in range(args.repeats):
        for side in (("off", "ngram") if k % 2 == 0 else ("ngram", "off")):
            waited = machine_load.settle(args.settle_s, machine_load.cores(), log=log.info) if args.settle_s > 0 else 0.0
            before = dict(engines[side].get_stats())
            with machine_load.SideWatch(f"{side} run {k}") as watch:
                t0 = time.perf_counter()
                out = run(engines[side])
                seconds = time.perf_counter() - t0
            tokens = sum(len(t) for t in out)
            after = engines[side].get_stats()
            row = {"side": side, "output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}
            if side == "ngram":
                drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
                accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
                row |= {"draft_tokens": drafted, "accepted_tokens": accepted, "acceptance_rate": accepted / max(drafted, 1)}
            runs.append(row)
            sides[f"{side} run {k}"] = watch.record | {"settled_s": waited}
            log.info("%s: %d tokens in %.2fs (%.1f tok/s)", side, tokens, seconds, tokens / seconds)
    per_side = {}
    for side in engines:
        rs = [r for r in runs if r["side"] == side]
        per_side[side] = {"output_tokens": sum(r["output_tokens"] for r in rs), "seconds": sum(r["seconds"] for r in rs)}
        per_side[side]["tok_s"] = per_side[side]["output_tokens"] / per_side[side]["seconds"]
    speedup = per_side["ngram"]["tok_s"] / per_side["off"]["tok_s"]
    report = {
        "benchmark": "spec_decode", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/bench_spec_decode.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"platform": platform.platform(), "cpu_model": machine_load.cpu_model(), "cores": machine_load.cores(),
                    "jax_backend": jax.default_backend(), "jax": jax.__version__},
        "workload": {"model": args.model or "built-in SmolLM2-135M-Instruct", "batch": args.batch, "num_requests": args.num_requests,
                     "words": args.words, "output_len": args.output_len, "greedy": True, "speculative_config": spec},
        "runs": runs, "sides": per_side, "speedup": speedup,
        "compiles_after_warmup": {side: llm.get_stats()["num_compiles_after_warmup"] for side, llm in engines.items()},
        "spec_stats": {k: v for k, v in engines["ngram"].get_stats().items() if k.startswith("spec_decode")}, "load": sides,
    }  # fmt: skip
    for side, s in per_side.items():
        print(f"{side}: {s['output_tokens']} tokens in {s['seconds']:.2f}s = {s['tok_s']:.1f} tok/s")
    print(f"ngram / off: {speedup:.2f}x")
    for line in machine_load.busy_lines(sides):
        print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What serving LoRA adapters costs: the same batch with and without enable_lora, throughput ratio printed.

A random-weight base of SmolLM2-135M's shape (a Llama: 30 layers, hidden 576, 9 query / 3 KV heads, MLP 1536,
vocabulary 49152; --num-layers for a quicker, smaller run) is saved as an HF folder, and --num-adapters PEFT LoRA
adapters of rank --rank (random A and B, PEFT's default targets q_proj and v_proj unless --targets) are written next to
it by PEFT itself. Two engines load the folder: one plain, one with enable_lora (max_loras = the adapter count,
max_lora_rank = --rank, lora_target_modules = the adapters' targets unless --lora-target-modules). The same
--num-requests random prompts then run on each, request i under adapter i mod N on the LoRA engine (so every step
mixes all of them), greedy, EOS ignored, every request --output-len tokens, prefix caching off, after one untimed
run of the same workload on each engine (it compiles the shapes the workload meets and loads the adapters). The sides alternate
plain, LoRA, LoRA, plain, ... (--repeats pairs) so that a change of load falls on both; each run waits (bounded) for
the load to settle and is watched as scripts/bench_throughput.py watches its sides (scripts/machine_load.py).

The figure is output tokens per second with LoRA over without, both summed over their runs; the issue's goal is
>= 0.85 at batch 64 with 4 rank-16 adapters on the CPU. Beside it, the same ratio from this process's CPU time (all
its threads), which other processes on a busy machine disturb less than wall time.

    python scripts/bench_lora.py --json docs/data/lora_cost_cpu_2026-11-26.json
    python scripts/bench_lora.py --num-layers 4 --num-requests 16 --output-len 8   # a quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages, not an installed copy
import machine_load  # noqa: E402 - the sibling script's module
import provenance  # noqa: E402
from workload import Stopwatch, random_prompts  # noqa: E402

log = logging.getLogger("bench_lora")

# SmolLM2-135M's config.json (HuggingFaceTB/SmolLM2-135M-Instruct), the built-in model's shape
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, hidden_act="silu")  # fmt: skip
PEFT_DEFAULT_TARGETS = "q_proj,v_proj"  # what PEFT's LoraConfig targets on a Llama when target_modules is not given
GOAL = {"rows": 64, "adapters": 4, "rank": 16, "min_ratio": 0.85}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64, help="requests per run, all in one batch (default 64)")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt (default 32)")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request, EOS ignored (default 32)")
    p.add_argument("--num-adapters", type=int, default=4, help="distinct adapters mixed in every step (default 4)")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank r, and max_lora_rank (default 16)")
    p.add_argument("--targets", default=PEFT_DEFAULT_TARGETS, help=f"the adapters' target_modules (default: PEFT's, {PEFT_DEFAULT_TARGETS})")
    p.add_argument("--lora-target-modules", default=None, help="the engine's lora_target_modules (default: --targets; 'all' for all seven)")
    p.add_argument("--num-layers", type=int, default=None, help="override the base's layer count (default 30, SmolLM2-135M's)")
    p.add_argument("--vocab-size", type=int, default=None, help="override the base's vocabulary (default 49152, SmolLM2-135M's)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and activations (default float32)")
    p.add_argument("--repeats", type=int, default=2, help="pairs of runs, ordered plain, LoRA, LoRA, plain, ... (default 2)")
    p.add_argument("--settle-s", type=float, default=120.0, help="before each run wait up to this long for the 1-min load to drop (0: never)")
    p.add_argument("--seed", type=int, default=0, help="weights, adapters and prompts (default 0)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure here as JSON")
    return p.parse_args(argv)


def run_order(repeats: int) -> list[str]:
    """plain, lora, lora, plain, ...: each side sees the start and the end of the session alike."""
    pairs = [("plain", "lora") if i % 2 == 0 else ("lora", "plain") for i in range(repeats)]
    return [side for pair in pairs for side in pair]


def summarize(runs: list[dict]) -> dict:
    """Per side: tokens, seconds and tokens/s summed over its runs; the ratio lora / plain and each pair's ratio."""
    sides = {}
    for side in ("plain", "lora"):
        mine = [r for r in runs if r["side"] == side]
        tokens, seconds = sum(r["output_tokens"] for r in mine), sum(r["seconds"] for r in mine)
        sides[side] = {"runs": len(mine), "output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds if seconds else None}
    plain, lora = ([r["tok_s"] for r in runs if r["side"] == s] for s in ("plain", "lora"))
    ratio = sides["lora"]["tok_s"] / sides["plain"]["tok_s"] if sides["plain"]["tok_s"] and sides["lora"]["tok_s"] else None
    out = {"sides": sides, "ratio": ratio, "ratio_per_pair": [b / a for a, b in zip(plain, lora)]}
    if all("cpu_s" in r for r in runs):  # the process's CPU time (all threads): work done, which contention disturbs less
        cpu = {side: sum(r["cpu_s"] for r in runs if r["side"] == side) for side in ("plain", "lora")}
        out["cpu_ratio"] = cpu["plain"] / cpu["lora"] if cpu["lora"] else None  # plain's CPU per token over LoRA's
        for side in sides:
            sides[side]["cpu_s"] = cpu[side]
    return out


def base_config(num_layers: int | None = None, vocab_size: int | None = None):
    import transformers

    overrides = {k: v for k, v in (("num_hidden_layers", num_layers), ("vocab_size", vocab_size)) if v}
    return transformers.LlamaConfig(**dict(SMOLLM2_135M, **overrides))


def write_models(root: Path, args) -> tuple[Path, list[Path]]:
    """The random base (HF folder) and the adapters (PEFT folders), all written by transformers and PEFT."""
    import peft
    import torch
    import transformers

    torch.manual_seed(args.seed)
    base = transformers.AutoModelForCausalLM.from_config(base_config(args.num_layers, args.vocab_size), dtype=torch.float32)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.02)
    base.save_pretrained(root / "base")
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    folders = []
    for i in range(args.num_adapters):
        torch.manual_seed(args.seed + 1 + i)
        config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets, init_lora_weights=False)
        model = peft.get_peft_model(base, config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.02)
        model.save_pretrained(root / f"adapter{i}")
        base = model.unload()  # the plain base back, for the next adapter
        folders.append(root / f"adapter{i}")
    return root / "base", folders


def engine_targets(args) -> str | None:
    if args.lora_target_modules == "all":
        return None
    return args.lora_target_modules or args.targets


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    import jax

    from jaxpaged import LLM, LoRARequest, SamplingParams

    vocab = base_config(args.num_layers, args.vocab_size).vocab_size
    prompts = [{"prompt_token_ids": ids} for ids in random_prompts(args.num_requests, args.prompt_len, 3, vocab, args.seed)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    common = dict(dtype=args.dtype, max_num_seqs=args.num_requests, max_model_len=args.prompt_len + args.output_len + 16,
                  max_num_batched_tokens=max(512, args.num_requests), enable_prefix_caching=False, precompile=False, log_level="WARNING")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        with Stopwatch() as written:
            base, adapter_folders = write_models(Path(tmp), args)
        log.info("base and %d adapters written by transformers + PEFT in %.1fs", len(adapter_folders), written.seconds)
        loras = [LoRARequest(f"adapter{i}", i + 1, str(f)) for i, f in enumerate(adapter_folders)]
        per_request = {"plain": None, "lora": [loras[i % len(loras)] for i in range(args.num_requests)]}  # by side
        engines = {}
        for side, extra in (("plain", {}), ("lora", dict(enable_lora=True, max_loras=len(loras), max_lora_rank=args.rank,
                                                          lora_target_modules=engine_targets(args)))):  # fmt: skip
            with Stopwatch() as warm:
                engines[side] = LLM(str(base), **common, **extra)
                # untimed: the workload once, so every shape it meets is compiled and every adapter is in its slot
                engines[side].generate(prompts, params, use_tqdm=False, lora_request=per_request[side])
            log.info("%s engine constructed and warmed in %.1fs", side, warm.seconds)
        compiles = {side: llm.engine.num_compiles_after_warmup for side, llm in engines.items()}
        runs, sides = [], {}
        for k, side in enumerate(run_order(args.repeats)):
            waited = machine_load.settle(args.settle_s, machine_load.cores(), log=log.info) if args.settle_s > 0 else 0.0
            with machine_load.SideWatch(f"{side} run {k}") as watch, Stopwatch() as run:
                outs = engines[side].generate(prompts, params, use_tqdm=False, lora_request=per_request[side])
            seconds, cpu_s = run.seconds, run.cpu_seconds
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            if tokens != args.num_requests * args.output_len:
                raise RuntimeError(f"{side}: {tokens} output tokens, expected {args.num_requests * args.output_len}")
            runs.append({"side": side, "output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "cpu_s": cpu_s})
            sides[f"{side} run {k}"] = watch.record | {"settled_s": waited}
            log.info("%s: %d tokens in %.2fs (%.1f tok/s)", side, tokens, seconds, tokens / seconds)
        new_compiles = {side: llm.engine.num_compiles_after_warmup - compiles[side] for side, llm in engines.items()}
    summary = summarize(runs)
    report = {
        "benchmark": "lora_cost", "date": provenance.utc_now(),
        "command": "python scripts/bench_lora.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"platform": platform.platform(), "cpu_model": machine_load.cpu_model(), "cores": machine_load.cores(),
                    "jax_backend": jax.default_backend(), "jax_device_kind": jax.devices()[0].device_kind, "jax": jax.__version__},
        "workload": {"base": "random weights, SmolLM2-135M's shape", "num_layers": base_config(args.num_layers).num_hidden_layers,
                     "vocab_size": vocab,
                     "num_requests": args.num_requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "num_adapters": args.num_adapters, "rank": args.rank, "adapter_targets": args.targets,
                     "lora_target_modules": engine_targets(args) or "all seven", "dtype": args.dtype, "greedy": True, "ignore_eos": True},
        "runs": runs, **summary, "compiles_during_runs": new_compiles, "load": sides, "goal": GOAL,
        "meets_goal": summary["ratio"] is not None and summary["ratio"] >= GOAL["min_ratio"],
    }  # fmt: skip
    for side, s in summary["sides"].items():
        print(f"{side}: {s['output_tokens']} tokens in {s['seconds']:.2f}s over {s['runs']} runs = {s['tok_s']:.1f} tok/s")
    print(f"LoRA / plain throughput: {summary['ratio']:.3f} (per pair: {', '.join(f'{r:.3f}' for r in summary['ratio_per_pair'])}; "
          f"goal >= {GOAL['min_ratio']}); by process CPU time: {summary['cpu_ratio']:.3f}")  # fmt: skip
    for name, rec in sides.items():
        print(f"{name}: 1-min load {rec['loadavg_1min']['before']:.2f} before, {rec['loadavg_1min']['after']:.2f} after; "
              f"other processes {100 * (rec['others_cpu_share'] or 0):.0f}% of the CPU")  # fmt: skip
    for line in machine_load.busy_lines(sides):
        print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

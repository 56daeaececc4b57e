"""Embedding throughput: jaxpaged's pooling runner against transformers on the same CPU, weights and prompts, one run.

The model: random weights of Qwen3-Embedding-0.6B's shape (a Qwen3: 28 layers, hidden 1024, 16 heads of 128, 8 KV
heads, MLP 3072, a tied 151,669-token vocabulary), built from a transformers config in this process and saved as an
HF folder (no tokenizer: the prompts are token ids); --tiny, --num-layers or --vocab-size make it smaller. The
workload: --num-prompts prompts of lengths uniform over [--min-len, --max-len] (scripts/workload.py's
uniform_requests, bench_throughput's draw).

- jaxpaged: `LLM(folder, runner="pooling", dtype="float32")`, LAST pooling, normalized (Qwen3-Embedding's pooling),
  warmed up on other prompts (precompile, then one untimed embed), then one timed `embed` of the whole workload.
- transformers: AutoModel in float32, torch threads = the cores, the prompts sorted by length into batches of
  --batch-size, padded (--padding-side) with an attention mask, the last real token's last_hidden_state (Qwen3-
  Embedding's last_token_pool), L2-normalized; one untimed batch first, then the whole workload timed.

jaxpaged runs first (torch's spinning worker threads slow whatever runs after them). Each side waits (bounded) for the
load to settle and is watched (scripts/machine_load.py). Printed and recorded: wall s, prompt tokens/s, embeddings/s,
the ratio jaxpaged / transformers, the largest |difference| of the two sides' embeddings, the load and the versions.

    python scripts/bench_embed.py --json docs/data/bench_embed_cpu_2026-11-28.json
    python scripts/bench_embed.py --tiny --num-prompts 8 --max-len 64   # seconds
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages, not an installed copy
import machine_load  # noqa: E402 - the sibling script's module
import provenance  # noqa: E402
from workload import Stopwatch, uniform_requests  # noqa: E402

log = logging.getLogger("bench_embed")

# Qwen/Qwen3-Embedding-0.6B's config.json (architectures names Qwen3ForCausalLM; its pooling is LAST, normalized)
QWEN3_EMBEDDING_0_6B = dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                            rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                            attention_bias=False, bos_token_id=151643, eos_token_id=151643,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})  # fmt: skip
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=1)  # fmt: skip
VERSIONS = ("jax", "jaxlib", "torch", "transformers", "numpy", "jaxpaged")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=256, help="prompts in the workload (default 256)")
    p.add_argument("--min-len", type=int, default=32, help="shortest prompt, tokens (default 32)")
    p.add_argument("--max-len", type=int, default=512, help="longest prompt, tokens; also max_model_len (default 512)")
    p.add_argument("--batch-size", type=int, default=16, help="transformers' padded batch (default 16)")
    p.add_argument("--padding-side", default="right", choices=["right", "left"], help="transformers' padding")
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen3 (2 layers of 64, vocabulary 512): tests")
    p.add_argument("--num-layers", type=int, default=None, help="override the layer count (default 28)")
    p.add_argument("--vocab-size", type=int, default=None, help="override the vocabulary (default 151669)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="jaxpaged's step budget (engine's default)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="jaxpaged's rows per step (default: the engine's)")
    p.add_argument("--warmup-prompts", type=int, default=4, help="jaxpaged's untimed embed, other prompts (default 4)")
    p.add_argument("--settle-s", type=float, default=120.0,
                   help="before each side wait up to this long for the 1-min load to drop (0: never)")  # fmt: skip
    p.add_argument("--no-calibrate", action="store_true", help="skip the matmul-rate probe (provenance.calibrate)")
    p.add_argument("--atol", type=float, default=1e-4, help="the largest |difference| that counts as agreeing")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts (default 0)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure here as JSON")
    return p.parse_args(argv)


def model_config(args):
    """Qwen3-Embedding-0.6B's shape (or the tiny one) with the overrides."""
    import transformers

    shape = dict(QWEN3_EMBEDDING_0_6B, **(TINY if args.tiny else {}))
    shape |= {k: v for k, v in (("num_hidden_layers", args.num_layers), ("vocab_size", args.vocab_size)) if v}
    return transformers.Qwen3Config(**shape, architectures=["Qwen3ForCausalLM"])


def write_model(folder: Path, args) -> Path:
    """Random weights (transformers' own init, std 0.02, seeded) saved as an HF folder both sides load."""
    import torch
    import transformers

    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(model_config(args), dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def workload(num: int, args, vocab: int, seed: int) -> list[list[int]]:
    """Token-id prompts, lengths uniform over [min_len, max_len] (the output length drawn beside them is unused)."""
    return [ids for ids, _ in uniform_requests(num, (args.min_len, args.max_len), (1, 1), vocab, seed)]


def figures(num_prompts: int, tokens: int, clock: Stopwatch) -> dict:
    return {"prompts": num_prompts, "prompt_tokens": tokens, "seconds": clock.seconds, "cpu_s": clock.cpu_seconds,
            "prompt_tok_s": tokens / clock.seconds, "embeddings_per_s": num_prompts / clock.seconds}  # fmt: skip


def _settled(args) -> float:
    return machine_load.settle(args.settle_s, machine_load.cores(), log=log.info) if args.settle_s > 0 else 0.0


def run_jaxpaged(folder: Path, prompts: list[list[int]], warm: list[list[int]], args) -> tuple[np.ndarray, dict]:
    """The embeddings in prompt order and the side's figures."""
    from jaxpaged import LLM

    engine = {"max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs}
    engine = {k: v for k, v in engine.items() if v}  # unset: the engine's defaults
    with Stopwatch() as start:
        llm = LLM(str(folder), runner="pooling", dtype="float32", pooler_config={"pooling_type": "LAST", "normalize": True},
                  max_model_len=args.max_len, log_level="WARNING", **engine)  # fmt: skip
        llm.embed(warm, use_tqdm=False)  # other prompts than the timed ones: no prefix-cache hit carries over
    before = llm.get_stats()
    waited = _settled(args)
    with machine_load.SideWatch("jaxpaged") as watch, Stopwatch() as clock:
        outs = llm.embed(prompts, use_tqdm=False)
    after = llm.get_stats()
    vectors = np.array([o.outputs.embedding for o in outs], np.float32)
    config = llm.engine.config
    out = figures(len(prompts), sum(map(len, prompts)), clock) | {
        "startup_and_warmup_s": start.seconds, "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_num_seqs": config.max_num_seqs,
        "compiles_during_run": after["num_compiles_after_warmup"] - before["num_compiles_after_warmup"],
        "prefix_cache_hits_during_run": after.get("prefix_cache_hits", 0) - before.get("prefix_cache_hits", 0),
        "load": watch.record | {"settled_s": waited},
    }  # fmt: skip
    return vectors, out


def last_token_pool(hidden, mask):
    """Qwen3-Embedding's pooling: the last real token's state, whichever side the batch was padded on."""
    import torch

    if bool(mask[:, -1].all()):  # left padding (or none): every row ends with a real token
        return hidden[:, -1]
    return hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]


def pad(batch: list[list[int]], side: str):
    """input_ids and attention_mask of a batch padded (id 0) to its longest prompt."""
    import torch

    width = max(map(len, batch))
    ids, mask = torch.zeros(len(batch), width, dtype=torch.long), torch.zeros(len(batch), width, dtype=torch.long)
    for row, prompt in enumerate(batch):
        cols = slice(width - len(prompt), width) if side == "left" else slice(0, len(prompt))
        ids[row, cols], mask[row, cols] = torch.tensor(prompt), 1
    return ids, mask


def length_batches(prompts: list[list[int]], size: int) -> list[list[int]]:
    """Prompt indices sorted by length, in batches of `size`: the least padding."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [order[i : i + size] for i in range(0, len(order), size)]


def embed_transformers(model, prompts: list[list[int]], args) -> np.ndarray:
    import torch

    vectors = np.zeros((len(prompts), model.config.hidden_size), np.float32)
    with torch.inference_mode():
        for batch in length_batches(prompts, args.batch_size):
            ids, mask = pad([prompts[i] for i in batch], args.padding_side)
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            vectors[batch] = torch.nn.functional.normalize(last_token_pool(hidden, mask), dim=-1).numpy()
    return vectors


def run_transformers(folder: Path, prompts: list[list[int]], warm: list[list[int]], args) -> tuple[np.ndarray, dict]:
    import torch
    import transformers

    torch.set_num_threads(machine_load.cores())
    with Stopwatch() as start:
        model = transformers.AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
        embed_transformers(model, warm, args)  # untimed: first-call costs
    waited = _settled(args)
    with machine_load.SideWatch("transformers") as watch, Stopwatch() as clock:
        vectors = embed_transformers(model, prompts, args)
    out = figures(len(prompts), sum(map(len, prompts)), clock) | {
        "load_and_warmup_s": start.seconds, "batch_size": args.batch_size, "padding_side": args.padding_side,
        "padded_tokens": sum(max(len(prompts[i]) for i in b) * len(b) for b in length_batches(prompts, args.batch_size)),
        "torch_threads": torch.get_num_threads(), "attn_implementation": model.config._attn_implementation,
        "load": watch.record | {"settled_s": waited},
    }  # fmt: skip
    return vectors, out


def compare(jp: np.ndarray, hf: np.ndarray, atol: float) -> dict:
    """How closely the two sides' embeddings agree."""
    diff = np.abs(jp - hf)
    cos = np.sum(jp * hf, axis=1) / (np.linalg.norm(jp, axis=1) * np.linalg.norm(hf, axis=1))
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()), "min_cosine": float(cos.min()),
            "atol": atol, "agree": bool(diff.max() <= atol)}  # fmt: skip


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    config = model_config(args)
    prompts = workload(args.num_prompts, args, config.vocab_size, args.seed)
    warm = workload(max(args.warmup_prompts, 1), args, config.vocab_size, args.seed + 1)  # shares no prefix
    load_at_start = list(os.getloadavg())
    calibration = None if args.no_calibrate else provenance.calibrate()
    with tempfile.TemporaryDirectory(prefix="bench-embed-") as tmp:
        with Stopwatch() as written:
            folder = write_model(Path(tmp) / "model", args)
        log.info("random %d-layer Qwen3 written in %.1fs", config.num_hidden_layers, written.seconds)
        jp_vectors, jp = run_jaxpaged(folder, prompts, warm, args)
        log.info("jaxpaged: %d prompts in %.2fs", len(prompts), jp["seconds"])
        hf_vectors, hf = run_transformers(folder, prompts, warm, args)
        log.info("transformers: %d prompts in %.2fs", len(prompts), hf["seconds"])
    agreement = compare(jp_vectors, hf_vectors, args.atol)
    report = {
        "benchmark": "embed", "date": provenance.utc_now(),
        "command": "python scripts/bench_embed.py " + " ".join(sys.argv[1:] if argv is None else argv), "args": vars(args),
        "machine": provenance.machine_info() | {"cores": machine_load.cores(), "calibration": calibration},
        "versions": provenance.versions(VERSIONS), "runtime_env": provenance.runtime_env(),
        "model": {"shape": "tiny Qwen3" if args.tiny else "Qwen3-Embedding-0.6B's", "weights": "random (transformers' init)",
                  **{k: getattr(config, k) for k in QWEN3_EMBEDDING_0_6B if k not in ("bos_token_id", "eos_token_id")}},
        "workload": {"num_prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "min_len": args.min_len,
                     "max_len": args.max_len, "draw": "workload.uniform_requests", "seed": args.seed, "pooling": "LAST",
                     "normalize": True, "dtype": "float32"},
        "jaxpaged": jp, "transformers": hf, "ratio": jp["prompt_tok_s"] / hf["prompt_tok_s"],
        "cpu_ratio": hf["cpu_s"] / jp["cpu_s"], "agreement": agreement,
        "loadavg_at_start": load_at_start, "loadavg_at_end": list(os.getloadavg()),
    }  # fmt: skip
    print_report(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def print_report(report: dict) -> None:
    print(f"{'':14}{'wall s':>9}{'prompt tok/s':>14}{'embeddings/s':>14}{'CPU s':>9}")
    for side in ("jaxpaged", "transformers"):
        s = report[side]
        print(f"{side:14}{s['seconds']:9.2f}{s['prompt_tok_s']:14.1f}{s['embeddings_per_s']:14.2f}{s['cpu_s']:9.1f}")
    a = report["agreement"]
    print(f"jaxpaged / transformers: {report['ratio']:.2f}x (by process CPU time {report['cpu_ratio']:.2f}x); max |diff| "
          f"{a['max_abs_diff']:.2e}, min cosine {a['min_cosine']:.7f} ({'agree' if a['agree'] else 'DISAGREE'} at {a['atol']:g})")  # fmt: skip
    sides = {side: report[side]["load"] for side in ("jaxpaged", "transformers")}
    for name, rec in sides.items():
        print(f"{name}: 1-min load {rec['loadavg_1min']['before']:.2f} before, {rec['loadavg_1min']['after']:.2f} after; "
              f"other processes {100 * (rec['others_cpu_share'] or 0):.0f}% of the CPU")  # fmt: skip
    for line in machine_load.busy_lines(sides):
        print(line)


if __name__ == "__main__":
    main()

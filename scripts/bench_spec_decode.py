"""Speculative decoding's gain: output tokens/s with `ngram` or `draft_model` speculation against the same engine
without it.

Workloads whose answers repeat their prompts, greedy:

- `--workload copy` (default): a random-weight Llama of SmolLM2-135M's shape (30 layers, hidden 576, vocabulary
  49152) built so greedy decoding copies its prompt exactly: attention and MLP outputs are zero, so the next token
  depends only on the current one, and the lm_head maps each byte token to its successor on a random cycle of
  `--words` tokens; a prompt is one lap of a cycle, so the answer repeats the prompt lap after lap. Every step still
  pays the full model's compute (the zeroed projections are ordinary weights). The upper bound: every guess holds.
- `--workload repeat`: "Repeat this text exactly: <random words>" to the built-in SmolLM2-135M-Instruct (or
  --model), which copies the words only partly.

`--sides` picks the speculating sides, each run once per `--ks` value: `ngram`; `draft-self`, the target drafting
for itself (the upper bound of a draft model: every guess holds, and each costs a full target step); `draft-random`,
a random-weight Llama with the target's vocabulary (2 layers, hidden 64: the floor, almost no guess holds, so it
shows what drafting and verifying cost); `draft-copy` (copy workload only), the forced-copy model cut to 2 layers
(a draft that agrees on every token at about a quarter of the target's
multiply-adds per token, most of them its lm_head over 49,152 tokens: the best case of a real draft); `draft:PATH`, any draft model.

The off side and the speculating sides run in one process, alternating (the order reversed every
repeat), each watched for machine load (scripts/machine_load.py). `--batch 1` is where speculation pays;
`--batch 64` checks that it costs little where it is turned off (disable_by_batch_size); `--disable-by-batch-size N`
above the batch forces it on there, to see what it would cost. Greedy outputs of all sides are checked to be
identical.
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
    p.add_argument("--workload", choices=("copy", "repeat"), default="copy",
                   help="copy: the forced-copy model (default); repeat: the built-in chat model")
    p.add_argument("--model", default=None, help="model (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--batch", type=int, default=1, help="requests in flight at once (default: 1)")
    p.add_argument("--num-requests", type=int, default=4, help="requests per run (default: 4)")
    p.add_argument("--words", type=int, default=40, help="random words per prompt, or the copy workload's prompt tokens (default: 40)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request (default: 64)")
    p.add_argument("--ks", default="4", help="num_speculative_tokens, one side each per --sides entry, comma-separated (default: 4)")
    p.add_argument("--sides", default="ngram", help="speculating sides, comma-separated: ngram, draft-self, draft-random, "
                   "draft-copy, draft:PATH (default: ngram)")
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="speculation off at this many running sequences (default: the engine's); set above --batch to "
                        "force it on, with max_num_seqs raised so every guess fits a step's sampled rows")  # fmt: skip
    p.add_argument("--repeats", type=int, default=2, help="runs per side, alternating (default: 2)")
    p.add_argument("--max-model-len", type=int, default=1024, help="the engines' max_model_len, which sizes a draft's KV pool (default: 1024)")
    p.add_argument("--settle-s", type=float, default=0.0, help="wait up to this long for the load to drop before each run")
    p.add_argument("--json", default=None, help="write the report here")
    return p.parse_args(argv)


SMOLLM2_135M_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                      "num_key_value_heads": 3, "vocab_size": 49152}  # fmt: skip


def copy_cycles(num_tokens: int, length: int, seed: int = 0) -> list[list[int]]:
    """Token ids 0..num_tokens-1 shuffled and cut into cycles of `length` (the rest left out): each token's greedy
    successor is the next one on its cycle, so a prompt that is one lap is repeated exactly by its answer."""
    order = np.random.default_rng(seed).permutation(num_tokens)
    return [order[i : i + length].tolist() for i in range(0, num_tokens - length + 1, length)]


def copy_prompts(cycles: list[list[int]], count: int, seed: int = 0) -> list[list[int]]:
    """`count` distinct laps (a cycle from a start), so no two prompts share a prefix."""
    length = len(cycles[0])
    if count > len(cycles) * length:
        raise ValueError(f"only {len(cycles) * length} distinct prompts of {length} tokens")
    picks = np.random.default_rng(seed).choice(len(cycles) * length, size=count, replace=False)
    return [cycles[p // length][p % length :] + cycles[p // length][: p % length] for p in picks]


def write_copy_model(folder: Path, cycles: list[list[int]], max_position_embeddings: int = 2048, layers: int | None = None) -> Path:
    """The forced-copy Llama (module docstring) with the byte tokenizer of tests/cycle_model.py; `layers` cuts its
    depth (the same greedy tokens: every layer's output is zero)."""
    from safetensors.numpy import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.cycle_model import EOS_ID, _tokenizer

    shape = SMOLLM2_135M_SHAPE | ({"num_hidden_layers": layers} if layers else {})
    d, vocab, inter, layers = shape["hidden_size"], shape["vocab_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    hd = d // shape["num_attention_heads"]
    rng = np.random.default_rng(1)
    embed = rng.normal(0, 1, (vocab, d)).astype(np.float32)
    unit = embed / np.linalg.norm(embed, axis=1, keepdims=True)
    head = rng.normal(0, 1, (vocab, d)).astype(np.float32)
    head /= np.linalg.norm(head, axis=1, keepdims=True)
    for cycle in cycles:  # the RMS-normed embedding of t scores sqrt(d) = 24 on its successor, about N(0, 1) elsewhere
        for i, tok in enumerate(cycle):
            head[cycle[(i + 1) % len(cycle)]] = unit[tok]
    w = {"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": np.ones(d, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = np.ones(d, np.float32)
        w[f"{p}.post_attention_layernorm.weight"] = np.ones(d, np.float32)
        for name, rows in (("q_proj", d), ("k_proj", shape["num_key_value_heads"] * hd), ("v_proj", shape["num_key_value_heads"] * hd)):
            w[f"{p}.self_attn.{name}.weight"] = rng.normal(0, 0.05, (rows, d)).astype(np.float32)
        for name in ("gate_proj", "up_proj"):
            w[f"{p}.mlp.{name}.weight"] = rng.normal(0, 0.05, (inter, d)).astype(np.float32)
        w[f"{p}.self_attn.o_proj.weight"] = np.zeros((d, d), np.float32)  # zero outputs: the residual stays the embedding
        w[f"{p}.mlp.down_proj.weight"] = np.zeros((d, inter), np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape, "max_position_embeddings": max_position_embeddings,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 256,
              "eos_token_id": EOS_ID, "hidden_act": "silu", "torch_dtype": "float32"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(w, str(folder / "model.safetensors"))
    _tokenizer().save_pretrained(str(folder))
    return folder


RANDOM_DRAFT_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                      "num_key_value_heads": 1}  # fmt: skip


def write_random_draft(folder: Path, vocab_size: int, max_position_embeddings: int) -> Path:
    """A bare config.json (jaxpaged loads it with random weights): a small Llama with the target's vocabulary."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **RANDOM_DRAFT_SHAPE, "vocab_size": vocab_size,
              "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}  # fmt: skip
    path = folder / "config.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def spec_configs(sides: list[str], ks: list[int], target: str | None, vocab_size: int, max_len: int, scratch: Path,
                 cycles: list[list[int]] | None = None) -> dict:  # fmt: skip
    """side name -> speculative_config, one per side and k (cycles: the copy workload's, for draft-copy)."""
    from jaxpaged.models.builtin import builtin_gguf_path

    out = {}
    for side in sides:
        if side == "ngram":
            model = None
        elif side == "draft-self":
            model = target or builtin_gguf_path()
        elif side == "draft-random":
            model = str(write_random_draft(scratch / "random_draft", vocab_size, max(max_len, 2048)))
        elif side == "draft-copy":
            if cycles is None:
                raise ValueError("draft-copy drafts for the copy workload only")
            model = str(write_copy_model(scratch / "copy_draft", cycles, layers=2))
        elif side.startswith("draft:"):
            model = side[len("draft:") :]
        else:
            raise ValueError(f"unknown side {side!r}: ngram, draft-self, draft-random, draft-copy or draft:PATH")
        for k in ks:
            if model is None:
                out[f"ngram k={k}"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
            else:
                out[f"{side} k={k}"] = {"method": "draft_model", "model": model, "num_speculative_tokens": k}
    return out


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

    import atexit
    import shutil
    import tempfile

    ks = [int(k) for k in args.ks.split(",")]
    model, texts, cycles = args.model, None, None
    common = dict(max_num_seqs=max(args.batch, 8), max_model_len=args.max_model_len, log_level="WARNING")
    forced = {}
    if args.disable_by_batch_size is not None:
        forced = {"disable_by_batch_size": args.disable_by_batch_size}
        common["max_num_seqs"] = max(args.batch * (max(ks) + 1), 8)  # a step samples every guess of every row
        common["max_num_batched_tokens"] = max(256, common["max_num_seqs"])
    scratch = Path(tempfile.mkdtemp(prefix="bench_spec_decode_"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    if args.workload == "copy":
        cycles = copy_cycles(256, args.words)
        texts = [{"prompt_token_ids": ids} for ids in copy_prompts(cycles, args.num_requests)]
        model = str(write_copy_model(scratch / "copy_model", cycles))  # 650 MB of float32 weights, removed at exit
        blocks_per_seq = -(-(args.words + args.output_len + max(ks) + 1) // 16)
        common |= {"num_kv_blocks": args.batch * blocks_per_seq + 16}
    engines = {"off": LLM(model, **common)}
    target = engines["off"].engine
    specs = spec_configs(args.sides.split(","), ks, model, target.loaded.config.vocab_size, target.max_model_len, scratch, cycles)
    specs = {side: {**spec, **forced} for side, spec in specs.items()}
    engines |= {side: LLM(model, speculative_config=spec, **common) for side, spec in specs.items()}
    texts = texts or prompts(args, engines["off"].engine.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=args.workload == "copy")

    def run(llm):
        outs = []
        for i in range(0, len(texts), args.batch):
            outs += llm.generate(texts[i : i + args.batch], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    reference = {side: run(llm) for side, llm in engines.items()}  # untimed: compiles and the prefix cache warm
    if any(reference[side] != reference["off"] for side in specs):
        raise RuntimeError("greedy outputs differ with speculation")
    copied = [out[: len(t["prompt_token_ids"])] == t["prompt_token_ids"] for out, t in zip(reference["off"], texts)] if args.workload == "copy" else []
    if not all(copied):
        raise RuntimeError("the copy model did not copy its prompts")
    runs, sides = [], {}
    for k in range(args.repeats):
        for side in (list(engines) if k % 2 == 0 else list(engines)[::-1]):
            waited = machine_load.settle(args.settle_s, machine_load.cores(), log=log.info) if args.settle_s > 0 else 0.0
            before = dict(engines[side].get_stats())
            with machine_load.SideWatch(f"{side} run {k}") as watch:
                t0 = time.perf_counter()
                out = run(engines[side])
                seconds = time.perf_counter() - t0
            tokens = sum(len(t) for t in out)
            after = engines[side].get_stats()
            row = {"side": side, "output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}
            if side != "off":
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
    speedup = {side: per_side[side]["tok_s"] / per_side["off"]["tok_s"] for side in specs}
    report = {
        "benchmark": "spec_decode", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/bench_spec_decode.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"platform": platform.platform(), "cpu_model": machine_load.cpu_model(), "cores": machine_load.cores(),
                    "jax_backend": jax.default_backend(), "jax": jax.__version__},
        "workload": {"kind": args.workload, "batch": args.batch, "num_requests": args.num_requests, "words": args.words,
                     "model": ("random-weight forced-copy Llama, SmolLM2-135M's shape, float32" if args.workload == "copy"
                               else args.model or "built-in SmolLM2-135M-Instruct"),
                     "output_len": args.output_len, "greedy": True, "speculative_configs": specs,
                     **({"draft_random_shape": RANDOM_DRAFT_SHAPE} if "draft-random" in args.sides.split(",") else {})},
        "runs": runs, "sides": per_side, "speedup": speedup,
        "compiles_after_warmup": {side: llm.get_stats()["num_compiles_after_warmup"] for side, llm in engines.items()},
        "spec_stats": {side: {k: v for k, v in engines[side].get_stats().items() if k.startswith("spec_decode")} for side in specs},
        "load": sides,
    }  # fmt: skip
    for side, s in per_side.items():
        print(f"{side}: {s['output_tokens']} tokens in {s['seconds']:.2f}s = {s['tok_s']:.1f} tok/s")
    for side, ratio in speedup.items():
        print(f"{side} / off: {ratio:.2f}x")
    for line in machine_load.busy_lines(sides):
        print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tunix's rollout step with jaxpaged against Tunix's own vanilla engine (issue 47 step 7), on the same machine and
model, in one run: generate G completions for each of P prompts (RolloutConfig as GRPO passes it), then sync the
trainer's weights into the engine, as RLCluster.generate and RLCluster.sync_weights do (the sync under Tunix's
transfer guards on the CPU).

    python scripts/bench_rl_rollout.py --prompts 32 --generations 8 --max-tokens 128 --runs 2

The model is the built-in SmolLM2-135M-Instruct as a Tunix Llama 3 (read by Tunix's own loader from the HF folder
jaxpaged converts the GGUF into); --tiny uses a small random one (for tests). EOS is a token neither side samples
(--eos none, the default), so every completion is --max-tokens long and both sides do the same work; --eos model
stops at the model's EOS. Each side runs once untimed (compiles), then --runs timed steps, alternating sides.
Reported: seconds per rollout step (generate + sync), generation tokens/s, sync seconds, the generation's process
CPU seconds, and the ratio vanilla / jaxpaged of the step time (the goal: at least 3) and of the CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (GRPO's G)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-length", type=int, default=32, help="RolloutConfig.max_prompt_length")
    p.add_argument("--runs", type=int, default=2, help="timed rollout steps per side")
    p.add_argument("--eos", choices=("none", "model"), default="none")
    p.add_argument("--tiny", action="store_true", help="a small random Tunix Llama 3 (tests)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="jaxpaged's; a whole rollout batch runs at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def policy_and_tokenizer(args):
    """(the Tunix model, its HF tokenizer)."""
    from flax import nnx
    from tunix.models.llama3 import model as llama3
    from tunix.models.llama3 import params as llama3_params

    from jaxpaged.models import convert_cache
    from jaxpaged.models.builtin import builtin_gguf_path
    from jaxpaged.models.loader import load_model

    loaded = load_model()  # the built-in GGUF, converted once into an HF folder in jaxpaged's cache (its tokenizer too)
    hf = loaded.hf_config
    if args.tiny:
        config = llama3.ModelConfig(num_layers=2, vocab_size=hf.vocab_size, embed_dim=64, hidden_dim=128, num_heads=4,
                                    head_dim=16, num_kv_heads=2, rope_theta=10_000, norm_eps=1e-5, weight_tying=True)  # fmt: skip
        return llama3.Llama3(config, rngs=nnx.Rngs(0)), loaded.tokenizer
    folder = convert_cache.entry_dir(convert_cache.cache_root(), convert_cache.file_sha256(str(builtin_gguf_path())), "float32")
    config = llama3.ModelConfig(
        num_layers=hf.num_hidden_layers, vocab_size=hf.vocab_size, embed_dim=hf.hidden_size, hidden_dim=hf.intermediate_size,
        num_heads=hf.num_attention_heads, head_dim=hf.head_dim, num_kv_heads=hf.num_key_value_heads,
        rope_theta=int(hf.rope_parameters["rope_theta"]), norm_eps=hf.rms_norm_eps, weight_tying=hf.tie_word_embeddings,
    )  # fmt: skip
    return llama3_params.create_model_from_safe_tensors(str(folder), config), loaded.tokenizer


def prompts(n: int) -> list[str]:
    topics = ["the sea", "a prime number", "the moon", "bread", "a river", "music", "the desert", "a library"]
    return [f"Question {i}: tell me one fact about {topics[i % len(topics)]}." for i in range(n)]


def timed_step(rollout, batch, config, params) -> dict:
    """One rollout step: generate, then the weight sync under Tunix's guards (as RLCluster does on the CPU)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = rollout.generate(batch, config)
    generate_s, generate_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    t1 = time.perf_counter()
    with jax.transfer_guard_device_to_host("disallow_explicit"), jax.transfer_guard_host_to_device("disallow_explicit"):
        rollout.update_params(params, None)
    jax.block_until_ready(rollout.llm.engine.runner.state if hasattr(rollout, "llm") else rollout._sampler.transformer_state)
    sync_s = time.perf_counter() - t1
    tokens = sum(len(t) for t in out.tokens)
    return {"generate_s": generate_s, "sync_s": sync_s, "step_s": generate_s + sync_s, "tokens": tokens,
            "tok_s": tokens / generate_s, "generate_cpu_s": generate_cpu_s, "load1": os.getloadavg()[0]}  # fmt: skip


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Median per side, and vanilla / jaxpaged of the step time (and of the generation's process CPU time, which
    other jobs on a shared machine disturb less than the wall clock)."""
    keys = ("generate_s", "sync_s", "step_s", "tok_s", "generate_cpu_s")
    sides = {side: {key: statistics.median(r[key] for r in rows) for key in keys if key in rows[0]} |
             {"tokens": rows[0]["tokens"]} for side, rows in runs.items()}  # fmt: skip
    both = {"vanilla", "jaxpaged"} <= set(sides)
    ratio = sides["vanilla"]["step_s"] / sides["jaxpaged"]["step_s"] if both else None
    cpu = both and "generate_cpu_s" in sides["vanilla"]
    cpu_ratio = sides["vanilla"]["generate_cpu_s"] / sides["jaxpaged"]["generate_cpu_s"] if cpu else None
    return {"sides": sides, "ratio": ratio, "cpu_ratio": cpu_ratio}


def main(argv=None) -> int:
    args = parse_args(argv)
    from flax import nnx
    from tunix.generate import tokenizer_adapter
    from tunix.rl.rollout import base_rollout, vanilla_rollout

    from jaxpaged.rl import JaxpagedRollout

    policy, hf_tokenizer = policy_and_tokenizer(args)
    tokenizer = tokenizer_adapter.TokenizerAdapter(hf_tokenizer)
    c = policy.config
    # an EOS id past the vocabulary, which nobody samples, keeps every completion max_tokens long: the same work
    eos = None if args.eos == "model" else [c.vocab_size]
    config = base_rollout.RolloutConfig(max_tokens_to_generate=args.max_tokens, temperature=1.0, top_p=1.0, seed=0,
                                        max_prompt_length=args.prompt_length, eos_tokens=eos,
                                        kv_cache_size=args.prompt_length + args.max_tokens + 1)  # fmt: skip
    batch = [p for p in prompts(args.prompts) for _ in range(args.generations)]  # as GRPO repeats each prompt G times
    params = nnx.state(policy, nnx.Param)
    t0 = time.perf_counter()
    sides = {
        "jaxpaged": JaxpagedRollout(rollout_actor=policy, tokenizer=tokenizer, rollout_config=config, log_level="WARNING",
                                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens),
    }  # fmt: skip
    start = {"jaxpaged": time.perf_counter() - t0}
    t0 = time.perf_counter()
    sides["vanilla"] = vanilla_rollout.VanillaRollout(policy, tokenizer, base_rollout.CacheConfig(
        cache_size=config.kv_cache_size, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim))  # fmt: skip
    start["vanilla"] = time.perf_counter() - t0
    results = {"args": vars(args), "backend": jax.default_backend(), "device": str(jax.devices()[0]),
               "completions": len(batch), "start_s": start, "first_step_s": {}, "runs": {"jaxpaged": [], "vanilla": []}}  # fmt: skip
    for side, rollout in sides.items():  # compiles
        results["first_step_s"][side] = timed_step(rollout, batch, config, params)["step_s"]
        print(json.dumps({"side": side, "first_step_s": round(results["first_step_s"][side], 2)}), flush=True)
    order = [s for i in range(args.runs) for s in (("jaxpaged", "vanilla") if i % 2 == 0 else ("vanilla", "jaxpaged"))]
    for side in order:
        row = timed_step(sides[side], batch, config, params)
        results["runs"][side].append(row)
        print(json.dumps({"side": side, **{k: round(v, 3) for k, v in row.items()}}), flush=True)
    results["summary"] = summarize(results["runs"])
    print(json.dumps({"summary": results["summary"]}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

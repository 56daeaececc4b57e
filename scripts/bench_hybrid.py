"""A hybrid linear-attention model against a dense one of equal parameters (issue 45 step 5), random weights, float32:

- `bytes`: KV + state bytes one sequence holds at each --contexts length, counted by running the engine's Scheduler
  and cache manager through its tokens (as scripts/kv_window_bytes.py does), plus a hybrid's state slot;
- `throughput`: --num-requests requests of --prompt-len prompt and --output-len output tokens through LLM, all at once
  (max_num_seqs = num_requests): wall time, output and total tokens per second, time to the first tokens;
- `decode`: the median decode step (every sequence decoding) at each --decode-contexts length, --decode-batch
  sequences: where the linear layers' fixed-size state starts to pay against K/V that grows with the context.

The shapes: a Qwen3.5 text model of 0.5B non-embedding parameters (Qwen3.5-0.8B's layers: hidden 1024, 24 layers
of which every fourth is gated attention with 8 heads of 256 and 2 KV heads, the others Gated DeltaNet with 16 key and
value heads of 128; MLP 3584), and a dense Qwen3 of the same width with 32 layers to match (Qwen3-0.6B's layer:
16 heads of 128, 8 KV heads, MLP 3072); both with Qwen3's 151,936-token tied vocabulary.

    python scripts/bench_hybrid.py --only bytes --json docs/data/bench_hybrid_cpu.json
    python scripts/bench_hybrid.py --only throughput --model "qwen3.5-0.5b-shaped (hybrid)" --json ...   # a part a run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import provenance  # the sibling scripts' modules (this folder is on sys.path when run as a file)
import transformers
from workload import Stopwatch, random_prompts

COMMON = dict(vocab_size=151936, hidden_size=1024, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
              bos_token_id=0, eos_token_id=1)  # fmt: skip
SHAPES = {
    "qwen3.5-0.5b-shaped (hybrid)": lambda: transformers.Qwen3_5TextConfig(
        **COMMON, num_hidden_layers=24, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, architectures=["Qwen3_5ForCausalLM"],
    ),
    "qwen3-0.5b-shaped (dense, 32 layers)": lambda: transformers.Qwen3Config(
        **COMMON, num_hidden_layers=32, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        architectures=["Qwen3ForCausalLM"],
    ),
}


def parameters(config) -> tuple[int, int]:
    """(all parameters, non-embedding ones) of the port, from its abstract model (shapes only, nothing allocated)."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxpaged.models.registry import resolve_architecture

    arch, port = resolve_architecture(config.architectures)
    cfg = port.config_from_hf(config, arch)
    model = port(cfg)
    total = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    return total, total - cfg.vocab_size * cfg.hidden_size


def held_bytes(config, context: int, block_size: int, step_tokens: int, dtype_bytes: int) -> dict:
    """KV and state bytes one sequence holds once `context` tokens are computed (prompt: half of it, in chunks)."""
    from jaxpaged.core.block_pool import BlockPool
    from jaxpaged.core.kv_cache_manager import KVCacheManager
    from jaxpaged.core.state_slots import HybridKVCacheManager
    from jaxpaged.models.registry import resolve_architecture
    from scripts.kv_window_bytes import blocks_held_at

    arch, port = resolve_architecture(config.architectures)
    cfg = port.config_from_hf(config, arch)
    pool = BlockPool(2 * context // block_size + 8, enable_caching=False)
    hybrid = hasattr(port, "state_spec")
    kv = HybridKVCacheManager(pool, block_size, 1) if hybrid else KVCacheManager(pool, block_size)
    blocks = len(blocks_held_at(kv, context, context // 2, step_tokens).held_blocks("r"))
    kv_bytes = blocks * block_size * cfg.num_kv_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    import jax.numpy as jnp

    dtype = {2: jnp.bfloat16, 4: jnp.float32}[dtype_bytes]  # the conv states' (the recurrent ones are float32)
    state = port(cfg, dtype=dtype).state_spec().slot_bytes if hybrid else 0
    return {"context": context, "blocks": blocks, "kv_bytes": kv_bytes, "state_bytes": state, "total_bytes": kv_bytes + state,
            "kv_layers": cfg.num_kv_layers}  # fmt: skip


def _engine(config_file: str, max_seqs: int, max_len: int, step_tokens: int):
    from jaxpaged import LLM

    blocks = max_seqs * -(-max_len // 16) + 8
    return LLM(config_file, dtype="float32", max_num_seqs=max_seqs, max_num_batched_tokens=step_tokens, block_size=16,
               max_model_len=max_len, num_kv_blocks=blocks, log_level="WARNING")  # fmt: skip


def _prompts(config_file: str, n: int, length: int, seed: int) -> list[dict]:
    vocab = json.loads(Path(config_file).read_text())["vocab_size"]
    return [{"prompt_token_ids": ids} for ids in random_prompts(n, length, 2, vocab, seed)]


def throughput(config_file: str, args) -> dict:
    from jaxpaged import SamplingParams

    llm = _engine(config_file, args.num_requests, args.prompt_len + args.output_len, args.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine = llm.engine
    for i, prompt in enumerate(_prompts(config_file, args.num_requests, args.prompt_len, seed=1)):
        engine.add_request(str(i), prompt, params)
    run, first, steps = Stopwatch(), [], []
    while engine.has_unfinished_requests():
        with Stopwatch() as step:
            outs = engine.step()
        steps.append(step.seconds)
        first += [run.seconds for o in outs if len(o.outputs[0].token_ids) == 1]
    wall = run.seconds
    out_tokens = args.num_requests * args.output_len
    return {"wall_s": wall, "output_tok_s": out_tokens / wall, "total_tok_s": (out_tokens + args.num_requests * args.prompt_len) / wall,
            "first_token_s": sorted(first), "steps": len(steps), "compiles_after_warmup": llm.get_stats()["num_compiles_after_warmup"]}  # fmt: skip


def decode_steps(config_file: str, args) -> list[dict]:
    """The median step while all --decode-batch sequences decode, after prompts of each context length."""
    from jaxpaged import SamplingParams

    step = args.max_num_batched_tokens

    def tokens(context):  # the first sequence decodes while the others prefill, a chunk a step: past that, all decode
        return args.decode_tokens + (args.decode_batch - 1) * -(-context // step) + 2

    longest = max(c + tokens(c) for c in args.decode_contexts)
    llm = _engine(config_file, args.decode_batch, longest, step)
    engine, rows = llm.engine, []
    for context in args.decode_contexts:
        params = SamplingParams(temperature=0.0, max_tokens=tokens(context), ignore_eos=True)
        for i, prompt in enumerate(_prompts(config_file, args.decode_batch, context, seed=context)):
            engine.add_request(f"{context}-{i}", prompt, params)
        times = []
        while engine.has_unfinished_requests():
            decoding = engine.scheduler.running and all(r.num_computed_tokens >= context for r in engine.scheduler.running)
            full = decoding and len(engine.scheduler.running) == args.decode_batch
            with Stopwatch() as step:
                engine.step()
            if full:
                times.append(step.seconds)
        if len(times) < args.decode_tokens // 2:
            raise RuntimeError(f"only {len(times)} steps had every sequence decoding at context {context}")
        rows.append({"context": context, "median_decode_step_ms": 1e3 * statistics.median(times[1:]), "steps": len(times)})
        print(f"  context {context}: {rows[-1]['median_decode_step_ms']:.1f} ms a decode step", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["bytes", "throughput", "decode"], action="append")
    parser.add_argument("--contexts", default="8192,32768", help="bytes: context lengths")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="bytes: bytes of one K/V element (2: bfloat16)")
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--decode-contexts", default="512,2048,4096,8192")
    parser.add_argument("--decode-batch", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=12, help="decode steps timed with every sequence decoding")
    parser.add_argument("--model", choices=list(SHAPES), action="append", help="only these shapes (default: both)")
    parser.add_argument("--json", help="write the results here (merged into what the file holds: one part per run)")
    args = parser.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.decode_contexts = [int(c) for c in args.decode_contexts.split(",")]
    only = set(args.only or ["bytes", "throughput", "decode"])
    from scripts import machine_load

    record = {"date": provenance.today(), "command": " ".join(sys.argv), "cpu": machine_load.cpu_model(),
              "cores": machine_load.cores(), "models": {}}  # fmt: skip
    for name, make in SHAPES.items():
        if args.model and name not in args.model:
            continue
        config = make()
        total, body = parameters(config)
        row = record["models"][name] = {"parameters": total, "non_embedding_parameters": body, "load_before": machine_load.load1()}
        print(f"{name}: {total / 1e6:.0f}M parameters ({body / 1e6:.0f}M without the embeddings)", file=sys.stderr)
        if "bytes" in only:
            row["bytes"] = [held_bytes(config, c, 16, args.max_num_batched_tokens, args.dtype_bytes) for c in args.contexts]
            for b in row["bytes"]:
                print(f"  at {b['context']}: KV {b['kv_bytes'] / 2**20:.1f} MiB + state {b['state_bytes'] / 2**20:.1f} MiB",
                      file=sys.stderr)  # fmt: skip
        if only & {"throughput", "decode"}:
            with tempfile.TemporaryDirectory() as folder:
                config.save_pretrained(folder)
                config_file = str(Path(folder) / "config.json")
                if "throughput" in only:
                    row["throughput"] = throughput(config_file, args)
                    print(f"  throughput: {row['throughput']['output_tok_s']:.2f} output tok/s, "
                          f"{row['throughput']['wall_s']:.0f} s", file=sys.stderr)  # fmt: skip
                if "decode" in only:
                    row["decode"] = decode_steps(config_file, args)
        row["load_after"] = machine_load.load1()  # the 1-minute load average: other processes' share of the cores
    if args.json:  # each run's parts beside the earlier runs' (a run per part keeps one 2.6 GB model in memory)
        path = Path(args.json)
        merged = json.loads(path.read_text()) if path.exists() else {"runs": [], "models": {}}
        merged["runs"].append({"date": record["date"], "command": record["command"], "cpu": record["cpu"], "cores": record["cores"]})
        for name, row in record["models"].items():
            merged["models"].setdefault(name, {}).update(row)
        path.write_text(json.dumps(merged, indent=2) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

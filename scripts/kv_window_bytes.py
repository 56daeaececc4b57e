"""KV bytes per token a sequence holds at 8k context, with and without freeing the blocks its sliding windows no
longer see (issue 34 item 7), counted by running the engine's Scheduler and KVCacheManager through the tokens.

Two model shapes, built from transformers configs as the loader reads them (models/config.py's per-layer windows):
Mistral-7B-shaped (every layer windowed, 4,096: the engine frees today) and Gemma-3-shaped (5 local layers of
window 1,024 per global layer, emulated with a Qwen2 config's `layer_types`). The "per group" column runs the
KVCacheCoordinator over the model's layer groups (local: windowed, global: not), the KV cache groups of
docs/design.md's stage 2, which the engine uses for hybrid models (its "engine" column then equals "per group"; with
--disable-hybrid-kv-cache-manager it keeps every block, as "no freeing").

    python scripts/kv_window_bytes.py                        # prints a table
    python scripts/kv_window_bytes.py --json docs/data/kv_window_bytes_8k.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformers

from jaxpaged.core.block_pool import BlockPool
from jaxpaged.core.kv_cache_coordinator import KVCacheCoordinator, kv_groups, layer_groups
from jaxpaged.core.kv_cache_manager import KVCacheManager, freeing_window
from jaxpaged.core.request import ParentRequest, Request
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.models.config import model_config_from_hf
from jaxpaged.sampling_params import SamplingParams

SHAPES = {
    "mistral-7b-shaped": lambda: transformers.MistralConfig(
        num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, sliding_window=4096,
        max_position_embeddings=32768,
    ),
    "gemma-3-12b-shaped (qwen2 layer_types)": lambda: transformers.Qwen2Config(
        num_hidden_layers=48, hidden_size=3840, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        use_sliding_window=True, sliding_window=1024, max_window_layers=0, max_position_embeddings=131072,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8,
    ),
}


def blocks_held_at(kv, context: int, prompt: int, step_tokens: int):
    """Run one sequence until `context` tokens are in the cache (its prompt prefilled in chunks of step_tokens, then
    decoded a token a step) through the engine's Scheduler and `kv`; returns `kv` holding it."""
    scheduler = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=step_tokens)
    params = SamplingParams(max_tokens=context, ignore_eos=True)
    ids = [(7 * i) % 30000 + 2 for i in range(prompt)]
    group = ParentRequest("r", None, ids, params)
    request = Request("r", group, 0, ids, params, context, seed=0)
    group.sequences.append(request)
    scheduler.add(request)
    while request.num_computed_tokens < context:
        out = scheduler.schedule()
        scheduler.update(out, [5] * len(out.scheduled), {})
    return kv


def measure(name: str, context: int, block_size: int, prompt: int, step_tokens: int, dtype_bytes: int,
            hybrid: bool = True) -> dict:  # fmt: skip
    cfg = model_config_from_hf(SHAPES[name](), "measure")
    windows = cfg.sliding_windows or (None,) * cfg.num_layers
    per_layer_token = 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes  # K and V of one token in one layer
    layers_by_window: dict[int | None, int] = {}
    for w in windows:
        layers_by_window[w] = layers_by_window.get(w, 0) + 1
    pool = lambda: BlockPool(2 * context // block_size + 8)  # noqa: E731

    def held(window: int | None) -> int:
        kv = blocks_held_at(KVCacheManager(pool(), block_size, window), context, prompt, step_tokens)
        return len(kv.held_blocks("r"))

    full = held(None)
    engine_window = freeing_window(cfg.sliding_windows)
    engine = held(engine_window) if engine_window else full
    groups = layer_groups(cfg.sliding_windows, cfg.num_layers)
    coordinator = blocks_held_at(KVCacheCoordinator(pool(), block_size, [w for w, _ in groups]), context, prompt,
                                 step_tokens)  # fmt: skip
    group_blocks = [len(g.held_blocks("r")) for g in coordinator.groups]
    per_group_bytes = sum(len(layers) * n for (_, layers), n in zip(groups, group_blocks)) * block_size * per_layer_token
    per_group = {str(w): n for (w, _), n in zip(groups, group_blocks)}  # equal windows' groups hold equally many
    engine_groups = hybrid and kv_groups(cfg.sliding_windows, cfg.num_layers) is not None
    engine_bytes = per_group_bytes if engine_groups else cfg.num_layers * engine * block_size * per_layer_token
    return {
        "model": name, "layers": cfg.num_layers, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "layers_by_window": {str(w): n for w, n in layers_by_window.items()},
        "bytes_per_token_per_layer": per_layer_token, "num_groups": len(groups), "layers_per_group": len(groups[0][1]),
        "blocks_held_without_freeing": full, "engine_freeing_window": engine_window, "blocks_held_engine": engine,
        "blocks_held_per_group": per_group, "engine_uses_groups": engine_groups,
        "kv_bytes_per_token_without_freeing": cfg.num_layers * full * block_size * per_layer_token / context,
        "kv_bytes_per_token_engine": engine_bytes / context,
        "kv_bytes_per_token_per_group": per_group_bytes / context,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=8192, help="tokens in the cache when measured")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens (prefilled in chunks), the rest decoded")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="a prefill chunk's tokens")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="bytes of one K or V element (2: bfloat16)")
    parser.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                        help="the engine as with that flag: a hybrid model keeps every block")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    rows = [measure(name, args.context, args.block_size, args.prompt, args.max_num_batched_tokens, args.dtype_bytes,
                    not args.disable_hybrid_kv_cache_manager) for name in SHAPES]  # fmt: skip
    print(f"KV bytes per token held at {args.context} tokens (block {args.block_size}, {args.dtype_bytes}-byte K/V)")
    print(f"{'model':42} {'no freeing':>12} {'engine':>12} {'per group':>12}")
    for r in rows:
        kib = lambda key: f"{r[key] / 1024:9.1f} KiB"  # noqa: E731
        print(f"{r['model']:42} {kib('kv_bytes_per_token_without_freeing')} {kib('kv_bytes_per_token_engine')} "
              f"{kib('kv_bytes_per_token_per_group')}")  # fmt: skip
    if args.json:
        record = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), **vars(args), "results": rows}
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()

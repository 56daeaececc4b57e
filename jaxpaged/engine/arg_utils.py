"""The model and engine flags both CLIs take (generate and serve), defined once so they cannot drift apart."""

from __future__ import annotations

import argparse
from typing import Any

from jaxpaged.config import ATTENTION_BACKEND_CHOICES, MATMUL_BACKEND_CHOICES


def add_engine_args(p: argparse.ArgumentParser, precompile: bool = True) -> None:
    """`precompile` is this CLI's default: the server compiles every bucket at start-up, generate on first use."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="local HF folder, .gguf file, config.json (random weights), or a Hugging Face Hub id "
                   "(org/name, from the HF cache or downloaded: safetensors only); default: the built-in model")
    g.add_argument("--revision", default=None, help="with a hub id: the branch, tag or commit to load (default: main)")
    g.add_argument("--dtype", default="auto", help="float32, bfloat16, float16, or auto (float32 on CPU, bfloat16 on GPU/TPU)")
    g = p.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + answer (default: the model's context)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one step (default: 64 on CPU, 256 on GPU/TPU)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step (default: 256 on CPU, 2048 on GPU/TPU)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (default: sized from memory)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                   help="share of free memory for the KV cache (default: 0.9 on GPU/TPU; on CPU a 2 GiB budget, or this share of free RAM)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="split the model over this many devices (default: 1)")
    g.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKEND_CHOICES), help="attention implementation (default: auto: the Pallas kernel on GPU/TPU, the native kernel on CPU)")
    g.add_argument("--matmul-backend", default="auto", choices=list(MATMUL_BACKEND_CHOICES),
                   help="matmul implementation (default: auto: native, with weights packed at load, for float32 on one CPU device; else XLA's dot)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of prompt prefixes seen before (default: on)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens and logprobs never depend on the rest of the batch (one step shape; slower)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule and pack the next step while the device runs this one; outputs are identical (default: on)")
    g.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=precompile,
                   help="compile every step bucket at start-up, so no request waits for a compile; off, each bucket "
                   f"compiles (or loads from the cache) on first use (default: {'on' if precompile else 'off'})")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's (and LLM's) keyword arguments from the flags above."""
    return {
        "model": args.model, "revision": args.revision, "dtype": args.dtype, "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "num_kv_blocks": args.num_kv_blocks,
        "kv_cache_memory_fraction": args.kv_cache_memory_fraction, "block_size": args.block_size,
        "tensor_parallel_size": args.tensor_parallel_size, "attention_backend": args.attention_backend,
        "matmul_backend": args.matmul_backend,
        "enable_prefix_caching": args.enable_prefix_caching, "batch_invariant": args.batch_invariant,
        "async_scheduling": args.async_scheduling, "precompile": args.precompile,
    }

"""EngineConfig: every engine knob in one place, validated once, with defaults per platform."""

from __future__ import annotations

import dataclasses

import jax

ATTENTION_BACKEND_CHOICES = ("auto", "reference", "pallas", "native")
MATMUL_BACKEND_CHOICES = ("auto", "xla", "native")
CPU_KV_CACHE_BYTES = 2 << 30  # on CPU the pool is sized to fit comfortably in RAM, not to fill it


def _positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (got {value!r})")


@dataclasses.dataclass
class EngineConfig:
    model: str | None = None  # HF folder, .gguf, config.json, hub id (org/name); None = built-in SmolLM2-135M-Instruct
    revision: str | None = None  # of a hub id: a branch, tag or commit (default: main)
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on GPU/TPU
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size; overrides kv_cache_memory_fraction
    kv_cache_memory_fraction: float | None = None  # of device memory left after the weights; on CPU, of free RAM
    max_num_seqs: int | None = None  # default 256 on GPU/TPU, 64 on CPU
    max_num_batched_tokens: int | None = None  # token budget per step; default 2048 on GPU/TPU, 256 on CPU
    attention_backend: str = "auto"  # auto = the Pallas kernel on GPU/TPU, the native kernel on CPU
    matmul_backend: str = "auto"  # auto = native (weights packed at load) for float32 on one CPU device, else XLA's dot
    seed: int = 0
    enable_prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes seen before
    batch_invariant: bool = False  # a request's tokens never depend on the rest of the batch (one step shape)
    async_scheduling: bool = True  # schedule and pack step N+1 while the device runs step N; same outputs
    tensor_parallel_size: int = 1  # devices the model is split over (a "model" mesh axis); see docs/models.md
    precompile: bool = True  # compile every step bucket at start-up; False: each on its first use (the CLI's way)
    compilation_cache_dir: str | None = None  # JAX's persistent cache, for tensor parallel; default under the cache root
    cache_dir: str | None = None  # GGUF conversion cache root
    platform: str = dataclasses.field(default_factory=lambda: jax.default_backend())

    def __post_init__(self) -> None:
        from jaxpaged.models.loader import resolve_dtype

        accelerator = self.platform != "cpu"
        self.dtype = ("bfloat16" if accelerator else "float32") if self.dtype == "auto" else resolve_dtype(self.dtype)
        if self.max_num_seqs is None:
            self.max_num_seqs = 256 if accelerator else 64
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if accelerator else 256
        if self.kv_cache_memory_fraction is None and accelerator:
            self.kv_cache_memory_fraction = 0.9
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            _positive_int(name, getattr(self, name))
        for name in ("num_kv_blocks", "max_model_len"):
            _positive_int(name, getattr(self, name), allow_none=True)
        if not 1 <= self.block_size <= 256 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two between 1 and 256 (got {self.block_size})")
        if self.kv_cache_memory_fraction is not None and not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1] (got {self.kv_cache_memory_fraction})")
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKEND_CHOICES} (got {self.attention_backend!r})")
        if self.matmul_backend not in MATMUL_BACKEND_CHOICES:
            raise ValueError(f"matmul_backend must be one of {MATMUL_BACKEND_CHOICES} (got {self.matmul_backend!r})")
        for name in ("enable_prefix_caching", "batch_invariant", "async_scheduling", "precompile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool (got {getattr(self, name)!r})")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer (got {self.seed!r})")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence needs at least one token of budget in a step
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )

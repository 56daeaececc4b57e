"""Random ragged attention steps over a paged KV cache: the cases kernels and references are checked on.

ACCELERATOR_CASES is the list a compiled kernel is checked on where there is a GPU or TPU
(scripts/check_accelerator.py and tests/kernels/test_compiled_attention.py): float32 and bfloat16, GQA ratios 1, 4
and 8, sliding windows, soft-caps, ALiBi and chunked local attention, block sizes 16 to 128 and head dims 64, 128 and
256, over decode rows, prefill chunks on cached context and fresh prompts. SMOKE_CASES are two small ones for
interpret mode on a CPU."""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jaxpaged.pallas_kernels import AttentionMetadata, AttentionSpec, kv_cache_shape, paged_attention, stack_new_kv, write_kv
from jaxpaged.pallas_kernels.kv_quant import QuantizedKV, dequantize_kv, quantize_kv
from jaxpaged.pallas_kernels.reference import naive_paged_attention


@dataclasses.dataclass
class Case:
    q: jnp.ndarray  # [T, H, D]
    k: jnp.ndarray  # [T, H_kv, D] this step's keys
    v: jnp.ndarray
    kv_cache: jnp.ndarray  # one layer, kv_cache_shape(1, ...), this step's K/V not yet written
    attn_metadata: AttentionMetadata
    num_real_tokens: int


def attention_args(scale, sliding_window=None, soft_cap=None, alibi_slopes=None, sinks=None, chunk_size=None):
    """The kernels' trailing arguments, (AttentionSpec, alibi_slopes, sinks), from keywords."""
    return AttentionSpec(scale, sliding_window, soft_cap, chunk_size), alibi_slopes, sinks


def random_case(
    rng: np.random.Generator,
    *,
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    padded_seqs: int = 2,
    padded_tokens: int = 5,
    extra_width: int = 3,
    dtype=jnp.float32,
) -> Case:
    """Sequences with context seq_lens[i], of which the last q_lens[i] tokens are this step's."""
    num_seqs = len(seq_lens) + padded_seqs
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_needed) + extra_width
    num_blocks = sum(blocks_needed) + 4
    ids = rng.permutation(num_blocks)
    tables = np.zeros((num_seqs, width), np.int32)
    start = 0
    for i, nb in enumerate(blocks_needed):
        tables[i, :nb] = ids[start : start + nb]
        start += nb
    query_start_loc = np.zeros(num_seqs + 1, np.int32)
    query_start_loc[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    query_start_loc[len(q_lens) + 1 :] = query_start_loc[len(q_lens)]
    real = int(query_start_loc[-1])
    total = real + padded_tokens
    slots = np.full(total, -1, np.int32)
    for i, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        for j in range(ql):
            p = n - ql + j
            slots[query_start_loc[i] + j] = tables[i, p // block_size] * block_size + p % block_size
    lens = np.zeros(num_seqs, np.int32)
    lens[: len(seq_lens)] = seq_lens
    shape = kv_cache_shape(1, num_kv_heads, num_blocks, block_size, head_dim)
    return Case(
        q=jnp.asarray(rng.normal(size=(total, num_heads, head_dim)), dtype),
        k=jnp.asarray(rng.normal(size=(total, num_kv_heads, head_dim)), dtype),
        v=jnp.asarray(rng.normal(size=(total, num_kv_heads, head_dim)), dtype),
        kv_cache=jnp.asarray(rng.normal(size=shape), dtype),
        attn_metadata=AttentionMetadata(jnp.asarray(slots), jnp.asarray(tables), jnp.asarray(lens), jnp.asarray(query_start_loc)),
        num_real_tokens=real,
    )


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One kernel-against-definition check: a step's shape, its attention options and the tolerance."""

    name: str
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float32"
    sliding_window: int | None = None
    soft_cap: float | None = None
    alibi: bool = False
    sinks: bool = False  # GPT-OSS's per-head sink logits
    chunk_size: int | None = None  # chunked local attention (Llama 4)

    @property
    def atol(self) -> float:
        """float32 at HIGHEST precision stays within 1e-5 interpreted; 1e-4 leaves room for a device's exp; 16-bit
        inputs and outputs round at ~2^-8."""
        return 1e-4 if self.dtype == "float32" else 2e-2

    def kwargs(self) -> dict:
        """attention_args' keywords (scale, window, cap, ALiBi slopes: steep, so positions matter)."""
        slopes = jnp.asarray(2.0 ** -np.arange(1, self.num_heads + 1, dtype=np.float32) * 4) if self.alibi else None
        sinks = jnp.asarray(np.linspace(-2.0, 3.0, self.num_heads, dtype=np.float32)) if self.sinks else None
        return dict(scale=self.head_dim**-0.5, sliding_window=self.sliding_window, soft_cap=self.soft_cap, alibi_slopes=slopes,
                    sinks=sinks, chunk_size=self.chunk_size)  # fmt: skip

    def build(self) -> Case:
        rng = np.random.default_rng(zlib.crc32(self.name.encode()))
        return random_case(
            rng, seq_lens=list(self.seq_lens), q_lens=list(self.q_lens), num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, block_size=self.block_size, dtype=jnp.dtype(self.dtype),
        )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("spec", "layer"))
def definition(q, k, v, kv_cache, attn_metadata: AttentionMetadata, spec: AttentionSpec, alibi_slopes=None, sinks=None,
               layer: int = 0):  # fmt: skip
    """The definition in float32: this step's K/V written into the cache's `layer`, then naive attention over it.
    One compiled program per shape and spec (run op by op it compiled some sixty small programs per case)."""
    new = stack_new_kv([(k, v)])
    written = kv_cache.at[layer].set(write_kv(kv_cache[layer : layer + 1], new, attn_metadata.slot_mapping)[0])
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return naive_paged_attention(f32(q), f32(written), layer, attn_metadata, spec, alibi_slopes, sinks)


def expected_output(case: Case, **kwargs) -> np.ndarray:
    """The definition in float32: this step's K/V written into the cache, then naive attention over it."""
    return np.asarray(definition(case.q, case.k, case.v, case.kv_cache, case.attn_metadata, *attention_args(**kwargs)))


def compare_kernel(backend, kc: KernelCase, kv_cache_dtype: str = "auto") -> dict:
    """Run `backend` (an AttentionBackend) on kc through the jitted entry point and compare with the definition:
    max abs error on the real rows, padding rows all zero, shape and dtype kept; `passed` says all of them hold.
    kv_cache_dtype "int8" or "fp8": the case's cache quantized (a QuantizedKV), against the definition over its
    dequantized float32 values (the kernel must read them exactly; the quantization's own error is not counted)."""
    case = kc.build()
    kwargs = kc.kwargs()
    spec, slopes, sinks = attention_args(**kwargs)
    cache, expected_case = case.kv_cache, case
    if kv_cache_dtype != "auto":
        data, scale = quantize_kv(case.kv_cache, kv_cache_dtype)
        cache = QuantizedKV(data, scale, kv_cache_dtype)
        expected_case = dataclasses.replace(case, kv_cache=dequantize_kv(data, scale, jnp.float32, kv_cache_dtype))
    fn = jax.jit(lambda q, k, v, c, md, sl, sk: paged_attention(q, k, v, c, 0, md, spec, sl, sk, backend=backend))
    got = fn(case.q, case.k, case.v, cache, case.attn_metadata, slopes, sinks)
    same_shape = got.shape == case.q.shape and got.dtype == case.q.dtype
    got = np.asarray(got.astype(jnp.float32))
    n = case.num_real_tokens
    error = float(np.max(np.abs(got[:n] - expected_output(expected_case, **kwargs)[:n])))
    padding_zero = bool(np.all(got[n:] == 0))  # padding rows are covered by no tile
    finite = bool(np.isfinite(error))
    name = kc.name if kv_cache_dtype == "auto" else f"{kc.name}-kv-{kv_cache_dtype}"
    return {"case": name, "max_abs_error": error, "atol": kc.atol, "padding_zero": padding_zero, "shape_and_dtype": same_shape,
            "passed": finite and error <= kc.atol and padding_zero and same_shape}  # fmt: skip


# (seq_lens, q_lens): decode rows (one a 4k context); mixed prefill + decode over partial blocks; a long context's
# prefill chunk beside fresh prompts; fresh prompts only.
_DECODE = ((1, 17, 300, 2000, 4097), (1, 1, 1, 1, 1))
_MIXED = ((37, 5, 300, 129), (1, 5, 40, 1))
_CHUNKED = ((1999, 64, 64, 70), (37, 64, 1, 33))
_PREFILL = ((513, 128, 1024), (513, 128, 256))
# name, shape, block size, (heads, KV heads): GQA 1, 4 or 8, head_dim, window, soft-cap, ALiBi (and a sinks case per dtype)
_ACCELERATOR_PLAN = [
    ("decode", _DECODE, 16, (8, 8), 128, None, None, False),
    ("mixed", _MIXED, 32, (8, 2), 64, None, None, False),
    ("chunked", _CHUNKED, 64, (16, 2), 128, None, None, False),
    ("prefill", _PREFILL, 128, (4, 4), 256, None, None, False),
    ("window", _MIXED, 16, (8, 2), 128, 64, None, False),
    ("softcap", _CHUNKED, 32, (8, 1), 64, None, 30.0, False),
    ("alibi", _DECODE, 64, (16, 2), 64, None, None, True),
    ("all", _CHUNKED, 128, (32, 8), 128, 7, 5.0, True),
    ("d256-window", _DECODE, 32, (8, 1), 256, 1000, None, False),
]


def _accelerator_cases() -> list[KernelCase]:
    cases = []
    for dtype, short in (("float32", "f32"), ("bfloat16", "bf16")):
        for i, (what, (seq_lens, q_lens), bs, (h, kv), d, window, cap, alibi) in enumerate(_ACCELERATOR_PLAN):
            if dtype == "bfloat16":
                bs = (16, 32, 64, 128)[(i + 2) % 4]  # every block size meets other shapes in bf16
            name = f"{short}-{what}-bs{bs}-h{h}kv{kv}-d{d}"
            cases.append(KernelCase(name, seq_lens, q_lens, h, kv, d, bs, dtype, window, cap, alibi))
        # GPT-OSS's layers: sinks, GQA 8, head_dim 64, a 128-token window on a mixed step
        cases.append(KernelCase(f"{short}-sinks-window-bs16-h64kv8-d64", *_MIXED, 64, 8, 64, 16, dtype, 128, sinks=True))
        # Llama 4's RoPE layers: chunked local attention (GQA 5, padded; head_dim 128), 48-token chunks (not whole
        # blocks) that the prefill chunks cross
        cases.append(KernelCase(f"{short}-chunk48-bs32-h40kv8-d128", *_CHUNKED, 40, 8, 128, 32, dtype, chunk_size=48))
    return cases


ACCELERATOR_CASES = _accelerator_cases()
SMOKE_CASES = [  # small enough for interpret mode on a CPU in seconds
    KernelCase("f32-smoke-bs16-h4kv1-d32-window", (9, 20, 3), (1, 4, 3), 4, 1, 32, 16, "float32", sliding_window=8),
    KernelCase("bf16-smoke-bs16-h2kv2-d16-softcap-alibi", (5, 33), (5, 1), 2, 2, 16, 16, "bfloat16", soft_cap=20.0, alibi=True),
]

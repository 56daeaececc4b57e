"""Every attention backend reads an int8 or fp8 KV cache (a QuantizedKV) as its dequantized float cache reads.

Each case quantizes a random float cache whole (quantize_kv), runs the GPU (Triton) and TPU (Mosaic) kernels in
interpret mode, the native CPU kernel and the pure-JAX reference over the QuantizedKV, and compares with the definition over dequantize_kv's float32 cache, within
float32 rounding: the kernels' dequantization is exact, only the order of the multiplies differs. The quantization
error itself is far larger, so a kernel that skipped a scale or read the float values would fail. The kernels also
lower for "cuda" and "tpu" with 8-bit caches, and the TPU kernel's page and scale DMAs are counted race-free.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu
from jaxpaged.pallas_kernels import AttentionMetadata, AttentionSpec, MosaicAttention, TritonAttention
from jaxpaged.pallas_kernels.gpu_attention import (
    DECODE_CONFIGS, DEFAULT_SHARED_MEMORY, PREFILL_CONFIGS, SHARED_MEMORY_MARGIN, LaunchConfig, gpu_paged_attention,
    launch_config, shared_memory_estimate,
)  # fmt: skip
from jaxpaged.pallas_kernels.kv_quant import QuantizedKV, dequantize_kv, quantize_kv
from jaxpaged.pallas_kernels.reference import reference_paged_attention
from jaxpaged.pallas_kernels.tiles import decode_kv
from jaxpaged.pallas_kernels.tpu_attention import tpu_paged_attention
from jaxpaged.platforms.cpu import attention as cpu_attention
from jaxpaged.platforms.gpu import SHARED_MEMORY_KIB

from tests.attention_cases import attention_args, expected_output, random_case
from tests.exporting import MOSAIC_CALL, TRITON_CALLS, export_checks, kernel_calls, lowering_for

KINDS = ["int8", "fp8"]
KERNELS = {
    "gpu": functools.partial(gpu_paged_attention, interpret=True),
    "tpu": functools.partial(tpu_paged_attention, interpret=True),
    "reference": reference_paged_attention,
    "native": lambda *args: _native(*args),
}


def _native(q, k, v, cache, layer, *rest):
    if not cpu_attention.available():
        pytest.skip("no C++ compiler: the native CPU kernel is not built")
    return cpu_attention.cpu_paged_attention(q, k, v, cache, int(layer), *rest)  # the layer is the call's attribute


def quantized(case, kind, storage=None):
    """(the case's cache quantized whole, optionally stored as `storage`; the case over its dequantized float32
    cache, the definition's input)."""
    data, scale = quantize_kv(case.kv_cache, kind)
    dequantized = dequantize_kv(data, scale, jnp.float32, kind)
    if storage is not None:
        data = jax.lax.bitcast_convert_type(data, storage)
    return QuantizedKV(data, scale, kind), dataclasses.replace(case, kv_cache=dequantized)


def _check(got, case, float_case, atol, discriminates=True, **kw):
    assert got.shape == case.q.shape and got.dtype == case.q.dtype
    n = case.num_real_tokens
    got, expected = np.asarray(got.astype(jnp.float32)), expected_output(float_case, **kw)
    np.testing.assert_allclose(got[:n], expected[:n], atol=atol, rtol=0)
    assert np.all(got[n:] == 0)  # padding rows are covered by no tile
    if discriminates:  # the quantization error dwarfs the tolerance: reading the float values, or no scale, would fail
        assert np.max(np.abs(expected_output(case, **kw)[:n] - expected[:n])) > 100 * atol


def test_decode_is_exact():
    """Every int8 value and every fp8 e4m3fn bit pattern but NaN (subnormals, both zeros) decodes as astype does."""
    ints = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)
    np.testing.assert_array_equal(decode_kv(ints, "int8", jnp.float32), np.arange(-128, 128, dtype=np.float32))
    bits = np.arange(256, dtype=np.uint8)
    bits = bits[(bits & 0x7F) != 0x7F]
    want = np.asarray(jnp.asarray(bits).view(jnp.float8_e4m3fn).astype(jnp.float32))
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):  # exact in each
        got = np.asarray(decode_kv(jnp.asarray(bits.view(np.int8)), "fp8", dtype).astype(jnp.float32))
        np.testing.assert_array_equal(got, want)
        assert np.array_equal(np.signbit(got), np.signbit(want))


GQA_SPLITS = LaunchConfig(rows=16, kv_chunk=32, num_warps=4, num_stages=2, num_splits=4)
# name: (random_case keywords, attention keywords, the GPU kernel's launch or None for its own choice)
CASES = {
    # decode rows, a prefill chunk on cached context and a fresh prompt over partial blocks; GQA 4, soft-cap
    "mixed-softcap": (dict(seq_lens=[37, 5, 300, 129], q_lens=[1, 5, 40, 1], num_heads=8, num_kv_heads=2,
                           head_dim=32, block_size=16), dict(scale=32**-0.5, soft_cap=20.0), None),
    # a long context decoded in 4 KV splits on the GPU kernel, a window skipping most of it; MQA
    "long-window-splits": (dict(seq_lens=[1500, 9, 70], q_lens=[1, 9, 3], num_heads=4, num_kv_heads=1, head_dim=64,
                                block_size=32), dict(scale=0.125, sliding_window=300), GQA_SPLITS),
    # ALiBi with a group of 3 (padded to 4) and a short window, block size 8
    "alibi-gqa3-window": (dict(seq_lens=[150, 9, 70], q_lens=[30, 9, 1], num_heads=6, num_kv_heads=2, head_dim=16,
                               block_size=8),
                          dict(scale=0.25, sliding_window=7,
                               alibi_slopes=jnp.asarray(2.0 ** -np.arange(1, 7, dtype=np.float32) * 4)), None),
}  # fmt: skip


# How the cache is stored: int8, fp8, and fp8 held as uint8 (a platform may: the same bits, read the same). The int8
# and fp8 chunks are decoded by tiles.decode_kv, exact for every value and dtype (test_decode_is_exact), and the
# scales are applied the same way for both, so each kernel runs each storage once and each case meets each storage on
# some kernel (kernel i, case j: storage (i + j) % 3) instead of every case in every storage (each one more compile).
CACHE_STORAGES = {"int8": ("int8", None), "fp8": ("fp8", None), "fp8-as-uint8": ("fp8", jnp.uint8)}
COVERING = [
    (kernel, name, list(CACHE_STORAGES)[(i + j) % 3]) for i, kernel in enumerate(KERNELS) for j, name in enumerate(CASES)
]


@pytest.mark.parametrize("kernel,name,storage", COVERING)
def test_kernel_over_quantized_cache_equals_definition(kernel, name, storage):
    case_kw, kw, launch = CASES[name]
    case = random_case(np.random.default_rng(len(name)), **case_kw)
    cache, float_case = quantized(case, *CACHE_STORAGES[storage])
    run = functools.partial(KERNELS[kernel], launch=launch) if kernel == "gpu" and launch else KERNELS[kernel]
    got = run(case.q, case.k, case.v, cache, 0, case.attn_metadata, *attention_args(**kw))
    _check(got, case, float_case, 1e-5, **kw)


@pytest.mark.parametrize("kernel,kind", [(kernel, KINDS[i % 2]) for i, kernel in enumerate(KERNELS)])
def test_bfloat16_queries_over_a_quantized_cache(kernel, kind):
    """16-bit queries: the decoded chunk is exact in bfloat16, the output rounds at ~2^-8; a layer past the first.
    int8 on two kernels, fp8 on the other two (the decoding into bfloat16 is decode_kv's, checked exactly)."""
    case = random_case(np.random.default_rng(9), seq_lens=[200, 64], q_lens=[33, 64], num_heads=8, num_kv_heads=2,
                       head_dim=128, block_size=16, dtype=jnp.bfloat16)  # fmt: skip
    rng = np.random.default_rng(10)
    layers = jnp.asarray(rng.normal(size=(3,) + case.kv_cache.shape[1:]), jnp.float32)
    cache, _ = quantized(dataclasses.replace(case, kv_cache=layers), kind)
    layer2 = dataclasses.replace(case, kv_cache=layers[2:])
    float_case = dataclasses.replace(case, kv_cache=dequantize_kv(cache.data[2:], cache.scale[2:], jnp.float32, kind))
    kw = dict(scale=128**-0.5)
    got = KERNELS[kernel](case.q, case.k, case.v, cache, jnp.int32(2), case.attn_metadata, *attention_args(**kw))
    _check(got, layer2, float_case, 2e-2, discriminates=False, **kw)


@pytest.mark.parametrize("backend", [TritonAttention(interpret=True), MosaicAttention(interpret=True)], ids=repr)
def test_backends_pass_a_quantized_cache_through(backend):
    """PallasAttention hands the QuantizedKV to its kernel (under jit: a pytree with a static kind)."""
    case = random_case(np.random.default_rng(11), seq_lens=[40, 3], q_lens=[1, 3], num_heads=4, num_kv_heads=1,
                       head_dim=16, block_size=16)  # fmt: skip
    cache, float_case = quantized(case, "int8")
    kw = dict(scale=0.25, soft_cap=10.0)
    spec, slopes, _ = attention_args(**kw)
    got = jax.jit(lambda q, k, v, c, md: backend(q, k, v, c, 0, md, spec, slopes))(case.q, case.k, case.v, cache,
                                                                                  case.attn_metadata)  # fmt: skip
    _check(got, case, float_case, 1e-5, **kw)


@pytest.mark.parametrize("window,table_chunk,width,dmas_per_head", [(None, 128, 8192, 54 + 42), (40, 8, 19, 22 + 10)])
def test_tpu_scale_dmas_are_race_free(window, table_chunk, width, dmas_per_head):
    """test_tpu_attention.test_dmas_fetch_only_live_pages over an int8 cache: each live page adds its K and V
    scales' two DMAs (21 pages per KV head, 5 with a window of 40), on their own semaphores, without races."""
    from tests.kernels.test_tpu_attention import _garbage_tables, _tpu_interpret_state

    rng = np.random.default_rng(3)
    seq_lens, q_lens, block_size = [24, 300, 37], [24, 1, 5], 16
    case = random_case(rng, seq_lens=seq_lens, q_lens=q_lens, num_heads=4, num_kv_heads=2, head_dim=32,
                       block_size=block_size)  # fmt: skip
    tables, _ = _garbage_tables(rng, case, seq_lens, q_lens, block_size, width, window)
    cache, float_case = quantized(case, "int8")
    md = case.attn_metadata
    md = AttentionMetadata(md.slot_mapping, jnp.asarray(tables), md.seq_lens, md.query_start_loc)
    kw = dict(scale=32**-0.5, sliding_window=window)
    try:
        interpret = pltpu.InterpretParams(detect_races=True)
        got = tpu_paged_attention(case.q, case.k, case.v, cache, 0, md, *attention_args(**kw), interpret=interpret,
                                  table_chunk=table_chunk)  # fmt: skip
        dmas, races = _tpu_interpret_state()
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    assert dmas == 2 * dmas_per_head and not races  # two KV heads
    _check(got, case, float_case, 1e-5, **kw)


# Lowering without the hardware, as test_pallas_attention's export tests do for float caches.
_sd = jax.ShapeDtypeStruct


def _export(kernel, platform, dtype, storage, kind, block_size=16, head_dim=128, tokens=64, seqs=32, **kw):
    width, blocks, heads, kv_heads = 16, 256, 32, 8
    md = AttentionMetadata(_sd((tokens,), jnp.int32), _sd((seqs, width), jnp.int32), _sd((seqs,), jnp.int32),
                           _sd((seqs + 1,), jnp.int32))  # fmt: skip
    shape = (2, 2, blocks, kv_heads, block_size, head_dim)
    cache = QuantizedKV(_sd(shape, storage), _sd(shape[:-1], jnp.float32), kind)
    alibi = jnp.linspace(0.5, 0.01, heads, dtype=jnp.float32)
    fn = jax.jit(lambda q, k, v, c, layer, md: kernel(q, k, v, c, layer, md, AttentionSpec(0.1, 64, 30.0), alibi, **kw))
    with lowering_for(platform):
        exported = export.export(fn, platforms=[platform], **export_checks(platform))(
            _sd((tokens, heads, head_dim), dtype), _sd((tokens, kv_heads, head_dim), dtype),
            _sd((tokens, kv_heads, head_dim), dtype), cache, _sd((), jnp.int32), md,
        )  # fmt: skip
    return exported.mlir_module()


STORAGES = [(jnp.int8, "int8"), (jnp.float8_e4m3fn, "fp8"), (jnp.uint8, "fp8")]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("storage,kind", STORAGES)
def test_kernels_lower_over_a_quantized_cache(storage, kind, dtype):
    module = _export(gpu_paged_attention, "cuda", dtype, storage, kind)
    assert len(kernel_calls(module, TRITON_CALLS)) == 1
    module = _export(tpu_paged_attention, "tpu", dtype, storage, kind)
    assert len(kernel_calls(module, (MOSAIC_CALL,))) == 1


GPU_MEMORIES = sorted({kib * 1024 for kib in SHARED_MEMORY_KIB.values()} | {DEFAULT_SHARED_MEMORY})


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_quantized_launches_fit_and_lower(head_dim):
    """8-bit chunks take less shared memory: a launch at least as big as bfloat16's fits every GPU, and the decode
    (split) and prefill launches on the smallest and largest lower."""
    for memory in GPU_MEMORIES:
        for tokens, seqs in ((8, 8), (2048, 64)):
            common = dict(shared_memory=memory, num_cores=132, num_kv_heads=8)
            launch = launch_config(tokens, seqs, head_dim, 2, kv_itemsize=1, **common)
            used = shared_memory_estimate(launch.rows, launch.kv_chunk, head_dim, 2, launch.num_stages, 1)
            assert used <= memory * SHARED_MEMORY_MARGIN, (memory, tokens, launch)
            as_float = launch_config(tokens, seqs, head_dim, 2, **common)
            preferred = (DECODE_CONFIGS if tokens <= seqs else PREFILL_CONFIGS).index
            key = lambda c: preferred((c.rows, c.kv_chunk, c.num_warps, c.num_stages))  # noqa: E731
            assert key(launch) <= key(as_float) and launch.num_splits == as_float.num_splits
    for tokens, seqs in ((8, 8), (64, 8)):
        for memory in (GPU_MEMORIES[0], GPU_MEMORIES[-1]):
            module = _export(gpu_paged_attention, "cuda", jnp.bfloat16, jnp.int8, "int8", head_dim=head_dim,
                             tokens=tokens, seqs=seqs, num_cores=132, shared_memory=memory)  # fmt: skip
            assert len(kernel_calls(module, TRITON_CALLS)) == 1

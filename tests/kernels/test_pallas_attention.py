"""The kernels equal the definition: the Pallas ones (GPU/Triton and TPU/Mosaic, both run in interpret
mode here) and the native CPU one.

Every case is a ragged step over a paged cache built by tests/attention_cases.py: decode rows,
prefill chunks on top of cached context, fresh prompts, contexts up to 2,000 tokens ending
partway through a block, padded sequence slots and padded token rows. The kernels are also
exported for "cuda" and "tpu" so CI catches a kernel that no longer lowers, and the GPU kernel's
split-KV decode and launch choices are checked here; tests/kernels/test_compiled_attention.py runs
the kernels compiled on a GPU or TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jaxpaged import platforms
from jaxpaged.pallas_kernels import AttentionMetadata
from jaxpaged.config import EngineConfig
from jaxpaged.pallas_kernels import AttentionSpec, MosaicAttention, TritonAttention
from jaxpaged.pallas_kernels.gpu_attention import (
    DEFAULT_SHARED_MEMORY, SHARED_MEMORY_MARGIN, LaunchConfig, choose_splits, gpu_paged_attention, launch_config,
    shared_memory_estimate,
)  # fmt: skip
from jaxpaged.platforms.gpu import SHARED_MEMORY_KIB
from jaxpaged.pallas_kernels.tpu_attention import tpu_paged_attention

from jaxpaged.platforms.cpu import attention as cpu_attention
from tests.attention_cases import attention_args, expected_output, random_case
from tests.exporting import MOSAIC_CALL, TRITON_CALLS, export_checks, kernel_calls, lowering_for

KERNELS = {
    "gpu": functools.partial(gpu_paged_attention, interpret=True),
    "tpu": functools.partial(tpu_paged_attention, interpret=True),
    "native": cpu_attention.cpu_paged_attention,
}


@pytest.fixture(autouse=True)
def _native_needs_a_compiler(request):
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("kernel") == "native":
        if cpu_attention.compiler() is None:
            pytest.skip("no C++ compiler to build the native kernel")
        assert cpu_attention.available()  # a compiler, so it must build

# (seq_lens, q_lens): decode only; mixed prefill + decode over partial blocks; long contexts; fresh prompts.
SHAPES = [
    ([1, 9, 16, 17, 33], [1, 1, 1, 1, 1]),
    ([37, 5, 300, 129], [1, 5, 40, 1]),
    ([16, 17, 15, 2000], [16, 1, 3, 1]),
    ([1999, 64, 64, 70], [37, 64, 1, 33]),
]
# One case per shape: GQA ratios 1, 2, 4 and 8 (8:1 is MQA here), head dims 16, 32, 128 and 256 and block sizes 8,
# 16, 32 and 64 each met once (a kernel's cost here is its compile, one per case: a shape x block size x heads
# product compiled the same code again); the other tests add head dim 64 and other pairings.
CASES = [
    (SHAPES[0], 8, (4, 4), 16),
    (SHAPES[1], 32, (8, 1), 128),
    (SHAPES[2], 64, (8, 2), 256),
    (SHAPES[3], 16, (4, 2), 32),
]


def _check(kernel, case, atol, **kw):
    got = kernel(case.q, case.k, case.v, case.kv_cache, 0, case.attn_metadata, *attention_args(**kw))
    assert got.shape == case.q.shape and got.dtype == case.q.dtype
    n = case.num_real_tokens
    got = np.asarray(got.astype(jnp.float32))
    np.testing.assert_allclose(got[:n], expected_output(case, **kw)[:n], atol=atol, rtol=0)
    assert np.all(got[n:] == 0)  # padding rows are covered by no tile


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("shape,block_size,heads,head_dim", CASES)
def test_kernel_equals_definition_float32(kernel, shape, block_size, heads, head_dim):
    (seq_lens, q_lens), (num_heads, num_kv_heads) = shape, heads
    rng = np.random.default_rng(sum(seq_lens) + block_size * 7 + num_heads * 3 + num_kv_heads + head_dim)
    case = random_case(
        rng, seq_lens=seq_lens, q_lens=q_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size,
    )  # fmt: skip
    _check(KERNELS[kernel], case, 1e-5, scale=head_dim**-0.5)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("window,cap", [(1, None), (None, 30.0), (64, 5.0)])  # a window alone, a cap alone, both
def test_sliding_window_and_soft_cap(kernel, window, cap):
    rng = np.random.default_rng(window or 0)
    case = random_case(
        rng, seq_lens=[200, 9, 70, 1000], q_lens=[30, 9, 1, 50], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16
    )
    _check(KERNELS[kernel], case, 1e-5, scale=0.125, sliding_window=window, soft_cap=cap)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("chunk,window,block_size", [(32, None, 16), (40, 24, 8)])  # whole blocks; not, in a window
def test_chunked_local_attention(kernel, chunk, window, block_size):
    """Llama 4's chunked layers: a query sees its own chunk only, [pos // chunk * chunk, pos]. Prefill chunks that
    cross chunk boundaries, start on one or end just past one, beside decode rows at a chunk's first position and
    its last; GQA 5 (a padded group)."""
    rng = np.random.default_rng(chunk + block_size)
    case = random_case(
        rng, seq_lens=[130, 64, 33, 300, 81], q_lens=[70, 32, 1, 1, 2], num_heads=10, num_kv_heads=2, head_dim=32,
        block_size=block_size,
    )  # fmt: skip
    _check(KERNELS[kernel], case, 1e-5, scale=32**-0.5, chunk_size=chunk, sliding_window=window)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("heads,window", [((8, 1), 24), ((3, 3), None), ((6, 2), 7)])
def test_alibi(kernel, heads, window):
    """ALiBi slopes per query head, with GQA/MQA groups (padded when not a power of two) and windows, and without
    a window on an odd head count."""
    num_heads, num_kv_heads = heads
    rng = np.random.default_rng(num_heads * 10 + num_kv_heads)
    case = random_case(
        rng, seq_lens=[150, 9, 70, 300], q_lens=[30, 9, 1, 17], num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=32, block_size=16,
    )  # fmt: skip
    slopes = jnp.asarray(2.0 ** -np.arange(1, num_heads + 1, dtype=np.float32) * 4)  # steep, so positions matter
    _check(KERNELS[kernel], case, 1e-5, scale=32**-0.5, sliding_window=window, alibi_slopes=slopes)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("heads,window", [((8, 2), None), ((6, 2), 16)])
def test_sinks(kernel, heads, window):
    """GPT-OSS's per-head sink logits (one far above the scores, one far below), with GQA groups and a window."""
    num_heads, num_kv_heads = heads
    rng = np.random.default_rng(num_heads + 40)
    case = random_case(
        rng, seq_lens=[150, 9, 70, 300], q_lens=[30, 9, 1, 17], num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=32, block_size=16,
    )  # fmt: skip
    sinks = jnp.asarray(np.linspace(-20.0, 8.0, num_heads, dtype=np.float32))
    _check(KERNELS[kernel], case, 1e-5, scale=32**-0.5, sliding_window=window, sinks=sinks)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs_accumulate_in_float32(kernel, dtype):
    rng = np.random.default_rng(4)
    case = random_case(
        rng, seq_lens=[500, 33, 1200], q_lens=[1, 33, 20], num_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
        dtype=dtype,
    )  # fmt: skip
    _check(KERNELS[kernel], case, 2e-2, scale=128**-0.5)


@pytest.mark.parametrize("kernel", ["native"])
@pytest.mark.parametrize("head_dim,block_size", [(80, 8), (96, 16), (48, 32), (40, 16)])
def test_native_kernel_takes_any_head_dim(kernel, head_dim, block_size):
    """Head dims without a specialised build (and below one vector) take the generic loops."""
    rng = np.random.default_rng(head_dim)
    case = random_case(
        rng, seq_lens=[77, 5, 300], q_lens=[1, 5, 70], num_heads=6, num_kv_heads=2, head_dim=head_dim,
        block_size=block_size,
    )  # fmt: skip
    _check(KERNELS[kernel], case, 1e-5, scale=head_dim**-0.5, sliding_window=50, soft_cap=20.0)


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
def test_unsupported_head_dim_is_a_clear_error(kernel):
    case = random_case(np.random.default_rng(0), seq_lens=[4], q_lens=[4], num_heads=2, num_kv_heads=1, head_dim=80,
                       block_size=8)  # fmt: skip
    with pytest.raises(ValueError, match="head_dim=80"):
        KERNELS[kernel](case.q, case.k, case.v, case.kv_cache, 0, case.attn_metadata, AttentionSpec(1.0))


def resolve_attention_backend(requested, head_dim, platform, batch_invariant=False):
    return platforms.get(platform).attention_backend(requested, head_dim, batch_invariant).name


def test_backend_resolution():
    assert resolve_attention_backend("auto", 128, "gpu") == "pallas"
    assert resolve_attention_backend("auto", 128, "tpu") == "pallas"
    native = "native" if cpu_attention.available() else "reference"
    assert resolve_attention_backend("auto", 128, "cpu") == native
    assert resolve_attention_backend("auto", 80, "cpu") == native  # any head dim
    assert resolve_attention_backend("auto", 64, "cpu", batch_invariant=True) == "reference_invariant"
    with pytest.raises(ValueError, match="native"):
        resolve_attention_backend("native", 64, "gpu")
    assert resolve_attention_backend("auto", 80, "gpu") == "reference"  # the kernel can't take it: fall back
    assert resolve_attention_backend("pallas", 64, "cpu") == "pallas"  # interpret mode
    with pytest.raises(ValueError, match="head_dim=96"):
        resolve_attention_backend("pallas", 96, "gpu")
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


def test_each_platform_hands_models_a_backend_object():
    """The platform decides once; the kernels it picks for GPU and TPU run compiled, on CPU interpreted."""
    assert platforms.get("gpu").attention_backend("auto", 128) == TritonAttention(interpret=False)
    assert platforms.get("tpu").attention_backend("auto", 128) == MosaicAttention(interpret=False)
    assert platforms.get("cpu").attention_backend("pallas", 128) == TritonAttention(interpret=True)
    # stable: keys the executable cache
    assert repr(TritonAttention(interpret=False)) == "TritonAttention(interpret=False, num_cores=0, shared_memory=0, launch=None)"
    with pytest.raises(ValueError, match="platform"):
        platforms.get("quantum")


# Lowering without the hardware: jax.export traces and lowers for the named platform only.
_sd = jax.ShapeDtypeStruct
LOWERINGS = [
    (dtype, block_size, head_dim)
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32)
    for block_size, head_dim in ((8, 64), (16, 128), (64, 256))
]


def _export(kernel, platform, dtype, block_size, head_dim, tokens=64, seqs=32, **kw):
    width, blocks, heads, kv_heads = 16, 256, 32, 8
    attn_metadata = AttentionMetadata(
        _sd((tokens,), jnp.int32), _sd((seqs, width), jnp.int32), _sd((seqs,), jnp.int32), _sd((seqs + 1,), jnp.int32)
    )
    alibi = jnp.linspace(0.5, 0.01, heads, dtype=jnp.float32) if block_size == 16 else None  # with and without
    sinks = jnp.linspace(-1.0, 1.0, heads, dtype=jnp.float32) if block_size != 16 else None  # with and without
    spec = AttentionSpec(0.1, 64, 30.0, chunk_size=256 if block_size == 64 else None)  # chunked local attention too
    fn = jax.jit(
        lambda q, k, v, c, layer, attn_metadata: kernel(q, k, v, c, layer, attn_metadata, spec, alibi, sinks, **kw)
    )  # fmt: skip
    with lowering_for(platform):
        exported = export.export(fn, platforms=[platform], **export_checks(platform))(
            _sd((tokens, heads, head_dim), dtype), _sd((tokens, kv_heads, head_dim), dtype),
            _sd((tokens, kv_heads, head_dim), dtype), _sd((2, 2, blocks, kv_heads, block_size, head_dim), dtype),
            _sd((), jnp.int32), attn_metadata,
        )  # fmt: skip
    return exported.mlir_module()


@pytest.mark.parametrize("dtype,block_size,head_dim", LOWERINGS)
def test_gpu_kernel_lowers_for_cuda(dtype, block_size, head_dim):
    module = _export(gpu_paged_attention, "cuda", dtype, block_size, head_dim)
    assert len(kernel_calls(module, TRITON_CALLS)) == 1  # compiled Triton, not an interpreted loop


@pytest.mark.parametrize("dtype,block_size,head_dim", LOWERINGS)
def test_tpu_kernel_lowers_for_tpu(dtype, block_size, head_dim):
    module = _export(tpu_paged_attention, "tpu", dtype, block_size, head_dim)
    assert len(kernel_calls(module, (MOSAIC_CALL,))) == 1


# Split-KV decode: a sequence's context shared among programs, merged by the combine step.
# (splits, kv_chunk, sinks, window): no split; powers of two and not; 16 splits, more than the short contexts have
# chunks; each split count compiles its own kernel, so these stand for the counts between.
SPLIT_RUNS = [(1, 16, True, None), (2, 32, False, 500), (3, 16, True, 500), (5, 32, False, None), (8, 16, False, 500),
              (16, 32, True, 500)]  # fmt: skip


@pytest.mark.parametrize("kernel", ["gpu"])
def test_split_kv_decode_equals_definition(kernel):
    """Split counts from 1 to 16, over contexts shorter and longer than one chunk per split, with a window that
    leaves some splits no keys, sinks (counted in one split only), GQA and soft-cap."""
    rng = np.random.default_rng(16)
    case = random_case(rng, seq_lens=[3, 40, 700, 1333], q_lens=[1, 1, 1, 1], num_heads=8, num_kv_heads=2, head_dim=32,
                       block_size=16)  # fmt: skip
    for splits, kv_chunk, with_sinks, window in SPLIT_RUNS:
        launch = LaunchConfig(rows=16, kv_chunk=kv_chunk, num_warps=4, num_stages=2, num_splits=splits)
        run = functools.partial(gpu_paged_attention, interpret=True, launch=launch)
        sinks = jnp.linspace(-1.0, 3.0, 8, dtype=jnp.float32) if with_sinks else None
        _check(run, case, 1e-5, scale=32**-0.5, soft_cap=25.0, sliding_window=window, sinks=sinks)
    # chunked local attention: each split's share starts at the chunk's first key (splits past the chunk see none)
    launch = LaunchConfig(rows=16, kv_chunk=16, num_warps=4, num_stages=2, num_splits=4)
    run = functools.partial(gpu_paged_attention, interpret=True, launch=launch)
    _check(run, case, 1e-5, scale=32**-0.5, chunk_size=320)


def test_split_kv_takes_the_splits_the_live_sequences_need():
    """The grid has 16 splits; with 24 cores and 2 live sequences x 2 KV heads the step uses 6 of them (decided on
    device), and a prefill chunk among the rows still sees its own keys."""
    rng = np.random.default_rng(6)
    case = random_case(rng, seq_lens=[900, 77], q_lens=[1, 20], num_heads=4, num_kv_heads=2, head_dim=64, block_size=32)
    launch = LaunchConfig(rows=16, kv_chunk=32, num_warps=4, num_stages=2, num_splits=16)
    _check(functools.partial(gpu_paged_attention, interpret=True, launch=launch, num_cores=24), case, 1e-5, scale=0.125)


def test_splits_fill_the_cores():
    assert choose_splits(1, 8, 132) == 16  # one long request on an H100: 8 KV heads x 16 splits
    assert choose_splits(8, 8, 132) == 2
    assert choose_splits(64, 8, 132) == 1  # batch 64 fills it without splitting
    assert choose_splits(1, 8, 0) == 1  # unknown core count
    decode = launch_config(4, 4, 128, 2, shared_memory=227 * 1024, num_cores=132, num_kv_heads=8)
    prefill = launch_config(512, 64, 128, 2, shared_memory=227 * 1024, num_cores=132, num_kv_heads=8)
    assert decode.num_splits == 16 and decode.rows == 16
    assert prefill.num_splits == 1 and prefill.rows == 128 and prefill.num_warps == 8 and prefill.num_stages == 3


# Launches for every block size and head dim, in every dtype, on every GPU's shared memory: fit, and lower.
GPU_MEMORIES = sorted({kib * 1024 for kib in SHARED_MEMORY_KIB.values()} | {DEFAULT_SHARED_MEMORY})


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_launches_fit_shared_memory(head_dim, dtype):
    itemsize = jnp.dtype(dtype).itemsize
    for memory in GPU_MEMORIES:
        for tokens, seqs in ((8, 8), (2048, 64)):  # decode and prefill buckets
            launch = launch_config(tokens, seqs, head_dim, itemsize, shared_memory=memory, num_cores=132, num_kv_heads=8)
            used = shared_memory_estimate(launch.rows, launch.kv_chunk, head_dim, itemsize, launch.num_stages)
            assert used <= memory * SHARED_MEMORY_MARGIN, (memory, tokens, launch)
            if tokens > seqs and itemsize == 2 and head_dim <= 128 and memory >= 99 * 1024:
                assert launch.rows >= 64 and launch.num_warps >= 4, launch  # prefill tiles: 64-128 rows


# Every launch (head dim x dtype x decode/prefill x smallest/largest shared memory: 24, all different) lowered once,
# the block size taking 8, 16, 32, 64 and 128 in turn, so each block size lowers with decode and prefill launches in
# both dtypes, its pages shorter, as long as and longer than the launch's key chunk where the chunks allow.
LAUNCHES = [
    (head_dim, dtype, tokens, seqs, memory)
    for head_dim in (64, 128, 256)
    for dtype in (jnp.bfloat16, jnp.float32)
    for tokens, seqs in ((8, 8), (64, 8))
    for memory in (GPU_MEMORIES[0], GPU_MEMORIES[-1])
]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_every_launch_lowers_for_cuda(head_dim):
    """Decode (split) and prefill launches, 16- and 32-bit, on the smallest and the largest shared memory."""
    for i, (d, dtype, tokens, seqs, memory) in enumerate(LAUNCHES):
        if d != head_dim:
            continue
        block_size = (8, 16, 32, 64, 128)[i % 5]
        module = _export(gpu_paged_attention, "cuda", dtype, block_size, head_dim, tokens=tokens, seqs=seqs,
                         num_cores=132, shared_memory=memory)  # fmt: skip
        assert len(kernel_calls(module, TRITON_CALLS)) == 1

"""The MoE grouped-GEMM kernel (pallas_kernels/moe_gemm.py, models/moe.py's grouped_expert_mlp_gemm): interpreted on
the CPU against the loop over the experts in use, the GPU's loop of static tiles and a per-token reference, for
random routings, empty experts, one expert taking every token, bucket padding, experts held elsewhere (expert
parallelism), float32 and bfloat16, shapes that are not multiples of the blocks, quantized experts, GPT-OSS's
biases with its clamped SwiGLU, and MXFP4 experts kept 4-bit (decoded in the kernel, against models/mxfp4.py's
dequantization followed by the float kernel and the loop); its launches fit every GPU's shared memory; and it lowers
(exported) for cuda at Qwen3-30B-A3B's and GPT-OSS's shapes, MXFP4 included: two Triton calls a layer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jaxpaged.models.moe import (
    GroupedGemmExperts, dequantize_mxfp4_packed, gemm_tile_rows, grouped_expert_mlp, grouped_expert_mlp_gemm,
    grouped_expert_mlp_static, route,
)  # fmt: skip
from jaxpaged.models.mxfp4 import dequantize_mxfp4, pack_mxfp4
from jaxpaged.pallas_kernels.moe_gemm import (
    SHARED_MEMORY_MARGIN, GemmLaunch, expert_gemm, expert_glu_gemm, launch_config, shared_memory_estimate,
)  # fmt: skip
from jaxpaged.platforms.gpu import SHARED_MEMORY_KIB

from tests.exporting import TRITON_CALLS, export_checks, kernel_calls, lowering_for

KW = ("first_expert", "act")
LOOP = jax.jit(grouped_expert_mlp, static_argnames=KW)
STATIC = jax.jit(grouped_expert_mlp_static, static_argnames=KW)
GEMM = jax.jit(functools.partial(grouped_expert_mlp_gemm, interpret=True), static_argnames=KW)
CLAMPED = ("clamped_swiglu", 1.702, 7.0)


def _experts(rng, held, d, f, dtype, bias=False):
    def leaf(shape, scale=0.3):
        out = {"kernel": jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale, dtype)}
        if bias:
            out["bias"] = jnp.asarray(rng.standard_normal((shape[0], shape[2]), dtype=np.float32) * 0.5, dtype)
        return out

    return leaf((held, d, f)), leaf((held, d, f)), leaf((held, f, d))


def _per_token(x, ids, weights, gate, up, down, first, valid, act="silu"):
    """float64, one (token, expert) pair at a time, in the order transformers adds them."""
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    x, ids, weights = f64(x), np.asarray(ids), f64(weights)
    g, u, dn = (f64(p["kernel"]) for p in (gate, up, down))
    gb, ub = (f64(p["bias"]) if "bias" in p else None for p in (gate, up))
    out = np.zeros_like(x)
    for t in range(x.shape[0] if valid is None else valid):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot]) - first
            if not 0 <= e < g.shape[0]:
                continue
            a, b = x[t] @ g[e], x[t] @ u[e]
            if act == "silu":
                h = a / (1 + np.exp(-a)) * b
            else:
                a, b = np.minimum(a + gb[e], act[2]), np.clip(b + ub[e], -act[2], act[2])
                h = (b + 1) * a / (1 + np.exp(-act[1] * a))
            out[t] += weights[t, slot] * (h @ dn[e])
    return out


def _ids(rng, kind, tokens, experts, top_k):
    if kind == "one_expert":  # every token's first choice is expert 3: its run is the longest any routing makes
        ids = np.stack([np.full(tokens, 3)] + [rng.integers(0, experts, tokens) for _ in range(top_k - 1)], 1)
        ids[:, 1:] = np.where(ids[:, 1:] == 3, (ids[:, 1:] + 1) % experts, ids[:, 1:])
        return jnp.asarray(ids, jnp.int32), jnp.full((tokens, top_k), 1.0 / top_k, jnp.float32)
    logits = rng.standard_normal((tokens, experts), dtype=np.float32)
    if kind == "empty_experts":  # only experts 1 and 5 .. 6 are ever chosen: the others' runs are empty
        logits[:, [0, 2, 3, 4, 7]] -= 100.0
    return route(jnp.asarray(logits), top_k, True)[::-1]


# tokens, experts, top_k, d, f, first expert held, experts held, valid rows, routing, dtype: each case's layout in
# one dtype, float32 and bfloat16 in turn (the dtype changes the roundings, not the tiles: a case in both compiled
# the same layout twice)
CASES = [
    (1, 8, 2, 80, 40, 0, 8, None, "random", "float32"),  # decode: one token; d and f not multiples of the blocks
    (37, 8, 2, 80, 40, 0, 8, None, "random", "bfloat16"),  # two K blocks, a ragged N block
    (37, 8, 2, 64, 32, 0, 8, None, "empty_experts", "float32"),
    (24, 8, 2, 48, 24, 0, 8, None, "one_expert", "bfloat16"),
    (37, 8, 2, 48, 24, 0, 8, 5, "random", "float32"),  # rows from 5 on are bucket padding: routed nowhere
    (37, 8, 2, 48, 24, 4, 4, None, "random", "bfloat16"),  # experts 4..7 held here (expert parallelism), 0..3 elsewhere
    (300, 4, 2, 32, 48, 0, 4, None, "random", "float32"),  # 128-row tiles
]


@pytest.mark.parametrize("tokens,experts,top_k,d,f,first,held,valid,routing,dtype", CASES)
def test_kernel_equals_the_loops_and_a_per_token_reference(tokens, experts, top_k, d, f, first, held, valid, routing, dtype):
    rng = np.random.default_rng(tokens * 7 + d + f + held)
    dtype = jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal((tokens, d), dtype=np.float32), dtype)
    gate, up, down = _experts(rng, held, d, f, dtype)
    ids, weights = _ids(rng, routing, tokens, experts, top_k)
    num_valid = None if valid is None else jnp.int32(valid)
    args = (x, ids, weights, gate, up, down)
    got = np.asarray(GEMM(*args, first_expert=first, act="silu", num_valid=num_valid), np.float32)
    loop = np.asarray(LOOP(*args, first_expert=first, act="silu", num_valid=num_valid), np.float32)
    static = np.asarray(STATIC(*args, first_expert=first, act="silu", num_valid=num_valid), np.float32)
    want = _per_token(x, ids, weights, gate, up, down, first, valid)
    if valid is not None:
        assert not got[valid:].any()  # padding rows: zero, as the loop's
    scale = np.max(np.abs(loop))
    if dtype == jnp.float32:  # the same sums in another order
        np.testing.assert_allclose(got, loop, atol=1e-6 * scale, rtol=1e-6)
        np.testing.assert_allclose(got, static, atol=1e-6 * scale, rtol=1e-6)
        np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=1e-5)
    else:  # the same roundings (h and the products in bfloat16): a bfloat16 step or two where a sum's order differs
        np.testing.assert_allclose(got, loop, atol=2 ** -6 * scale, rtol=0)
        np.testing.assert_allclose(got, want, atol=2 ** -4 * scale, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_gpt_oss_biases_and_clamped_swiglu(dtype):
    """GPT-OSS's experts: gate/up biases (the sum rounded first, as torch adds them) and the clamped SwiGLU inside the
    kernel; the down bias is added outside the expert loop (SparseMoeBlock.experts_output), so none here."""
    rng = np.random.default_rng(5)
    tokens, experts, top_k, d, f = 29, 6, 2, 48, 40
    x = jnp.asarray(rng.standard_normal((tokens, d), dtype=np.float32) * 2, dtype)
    gate, up, down = _experts(rng, experts, d, f, dtype, bias=True)
    down.pop("bias")
    ids, weights = _ids(rng, "random", tokens, experts, top_k)
    args = (x, ids, weights, gate, up, down)
    got = np.asarray(GEMM(*args, first_expert=0, act=CLAMPED), np.float32)
    loop = np.asarray(LOOP(*args, first_expert=0, act=CLAMPED), np.float32)
    tol = 2e-6 if dtype == jnp.float32 else 2 ** -6
    np.testing.assert_allclose(got, loop, atol=tol * np.max(np.abs(loop)), rtol=0)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, _per_token(*args, 0, None, CLAMPED), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_experts(kind):
    """int8/fp8 kernels with a scale per expert and output channel: cast to x's dtype inside the kernel, the float32
    sum times the scale, as the loop's _expert_matmul."""
    from jaxpaged.models.quantization import quantize_channels

    rng = np.random.default_rng(9)
    tokens, experts, top_k, d, f = 21, 4, 2, 48, 40
    x = jnp.asarray(rng.standard_normal((tokens, d), dtype=np.float32))
    leaves = []
    for shape in ((experts, d, f), (experts, d, f), (experts, f, d)):
        pairs = [quantize_channels(w, kind) for w in rng.standard_normal(shape, dtype=np.float32) * 0.3]
        leaves.append({"kernel": jnp.asarray(np.stack([q for q, _ in pairs])), "scale": jnp.asarray(np.stack([s for _, s in pairs]))})
    ids, weights = _ids(rng, "random", tokens, experts, top_k)
    args = (x, ids, weights, *leaves)
    got = GEMM(*args, first_expert=0, act="silu")
    np.testing.assert_allclose(got, LOOP(*args, first_expert=0, act="silu"), atol=2e-6, rtol=2e-6)


def test_explicit_launches_small_blocks_and_dead_tiles():
    """The kernels alone, on tiles given by hand: 16-wide N and K blocks over ragged edges (many of each), dead
    tiles past num_live left unwritten, expert ids out of order."""
    rng = np.random.default_rng(2)
    m, k_dim, n_dim, experts = 16, 53, 37, 5
    tile_expert = jnp.asarray([4, 0, 2, 2, 5, 5], jnp.int32)  # the last two dead (5: no expert)
    x = jnp.asarray(rng.standard_normal((6 * m, k_dim), dtype=np.float32))
    gate, up, down = ({"kernel": jnp.asarray(rng.standard_normal(s, dtype=np.float32))}
                      for s in ((experts, k_dim, n_dim), (experts, k_dim, n_dim), (experts, n_dim, k_dim)))  # fmt: skip
    launch = GemmLaunch(block_n=16, block_k=16, num_warps=4, num_stages=2)
    glu = lambda g, u, dtype: (jax.nn.silu(g) * u).astype(dtype)  # noqa: E731
    h = expert_glu_gemm(x, gate, up, tile_expert, 4, m=m, glu=glu, interpret=True, launch=launch)
    y = expert_gemm(h, down, tile_expert, 4, m=m, interpret=True, launch=launch)
    hp = jax.lax.Precision.HIGHEST
    for i in range(4):
        rows, e = slice(i * m, (i + 1) * m), int(tile_expert[i])
        g, u = (jnp.dot(x[rows], w["kernel"][e], precision=hp) for w in (gate, up))
        np.testing.assert_allclose(h[rows], jax.nn.silu(g) * u, atol=1e-4, rtol=1e-5)
        np.testing.assert_allclose(y[rows], jnp.dot(h[rows], down["kernel"][e], precision=hp), atol=1e-4, rtol=1e-5)


def test_tile_rows_and_launches_fit_every_gpu():
    assert gemm_tile_rows(8, 128) == 16 and gemm_tile_rows(512, 128) == 16 and gemm_tile_rows(16384, 128) == 128
    memories = sorted({kib * 1024 for kib in SHARED_MEMORY_KIB.values()})
    for m in (16, 32, 64, 128):
        for num_weights, (n, k) in ((2, (768, 2048)), (1, (2048, 768)), (2, (40, 80))):
            for itemsize, w_itemsize in ((2, 2), (4, 4), (2, 1)):
                for memory in memories:
                    launch = launch_config(m, n, k, num_weights, itemsize, w_itemsize, shared_memory=memory)
                    used = shared_memory_estimate(m, launch.block_n, launch.block_k, num_weights, itemsize, w_itemsize,
                                                  launch.num_stages)  # fmt: skip
                    assert used <= memory * SHARED_MEMORY_MARGIN, (m, n, k, memory, launch)
                    assert m * launch.block_n * num_weights <= 16 * 1024
                    assert 16 <= launch.block_n <= max(16, n * 2) and 16 <= launch.block_k <= max(16, k * 2)


# -- MXFP4 experts kept 4-bit -----------------------------------------------------------------------


def _mxfp4(rng, experts, k, n, dtype, bias=False):
    """A random MXFP4 projection as a checkpoint stores it (blocks [E, n, k / 32, 16], every code in both nibbles;
    scales 2^-6 .. 2^1) -> (its packed leaves, the same weights dequantized by models/mxfp4.dequantize_mxfp4 in
    dtype: exact, e2m1 values times powers of two)."""
    blocks = rng.integers(0, 256, size=(experts, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(121, 129, size=(experts, n, k // 32), dtype=np.uint8)
    codes, mx_scale = pack_mxfp4(blocks, scales)
    packed = {"kernel": jnp.asarray(codes), "mx_scale": jnp.asarray(mx_scale)}
    floats = {"kernel": jnp.asarray(dequantize_mxfp4(blocks, scales), dtype)}
    assert np.array_equal(np.asarray(floats["kernel"], np.float32), dequantize_mxfp4(blocks, scales))  # exact in dtype
    if bias:
        b = jnp.asarray(rng.standard_normal((experts, n), dtype=np.float32), dtype)
        packed["bias"] = floats["bias"] = b
    return packed, floats


def test_mxfp4_layout_decodes_to_the_dequantized_values():
    """pack_mxfp4's layout (byte row 32b + r: inner rows 64b + r low and 64b + 32 + r high; one scale row per 32)
    decoded as the kernel decodes it equals dequantize_mxfp4 exactly, K padded to 64 with zeros; 4.25 bits a value."""
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, size=(2, 24, 3, 16), dtype=np.uint8)  # K = 96: padded to 128
    # every scale whose products stay normal float32s (the CPU, as a GPU, flushes a denormal result to zero)
    scales = rng.integers(2, 255, size=(2, 24, 3), dtype=np.uint8)
    codes, mx_scale = pack_mxfp4(blocks, scales)
    assert codes.shape == (2, 64, 24) and mx_scale.shape == (2, 4, 24) and codes.dtype == mx_scale.dtype == np.uint8
    assert not (codes[:, 32:] >> 4).any() and (mx_scale[:, 3] == 127).all()  # the padding (inner 96..127): zero codes
    want = dequantize_mxfp4(blocks, scales)
    for e in range(2):
        got = dequantize_mxfp4_packed(jnp.asarray(codes[e]), jnp.asarray(mx_scale[e]), 96, jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), want[e])
    low = codes[0, 5, 7] & 15
    assert dequantize_mxfp4(blocks, np.full_like(scales, 127))[0, 5, 7] == [0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6][low]
    blocks_k = 4096 * 2880
    assert (blocks_k // 2 + blocks_k // 32) * 8 / blocks_k == 4.25


MXFP4_CASES = [  # tokens, experts, top_k, d, f, routing, activation, dtype
    (1, 8, 2, 96, 64, "random", "gpt-oss", "bfloat16"),  # decode; d = 96: K padded to 128, a ragged 64-block
    (37, 8, 2, 128, 32, "empty_experts", "silu", "float32"),  # f = 32: down's K is half a block (its high half padding)
    (24, 8, 2, 64, 96, "one_expert", "gpt-oss", "float32"),
    (300, 4, 2, 64, 160, "random", "silu", "bfloat16"),  # 128-row tiles; N ragged against the column blocks
]  # each layout once, each activation in both dtypes: the layouts, the activation and the dtype are independent


@pytest.mark.parametrize("tokens,experts,top_k,d,f,routing,act,dtype", MXFP4_CASES)
def test_mxfp4_kernel_equals_dequantized_experts(tokens, experts, top_k, d, f, routing, act, dtype):
    """The grouped GEMM reading MXFP4 codes and scales (decoded in its inner loop) against the same experts
    dequantized once (models/mxfp4.dequantize_mxfp4, checked against transformers' in tests/models/test_gpt_oss.py)
    run by the float kernel and by the loop over the experts in use: GPT-OSS's clamped SwiGLU with alpha, limit and
    gate/up biases, and plain SiLU without; ragged expert counts, empty experts, one expert taking every token."""
    rng = np.random.default_rng(tokens + d + f)
    act, dtype = {"silu": "silu", "gpt-oss": CLAMPED}[act], jnp.dtype(dtype)
    bias = act == CLAMPED
    x = jnp.asarray(rng.standard_normal((tokens, d), dtype=np.float32) * (2 if bias else 1), dtype)
    (gate, gate_f), (up, up_f), (down, down_f) = (_mxfp4(rng, experts, *kn, dtype, bias=bias and i < 2)
                                                  for i, kn in enumerate(((d, f), (d, f), (f, d))))  # fmt: skip
    ids, weights = _ids(rng, routing, tokens, experts, top_k)
    got = np.asarray(GEMM(x, ids, weights, gate, up, down, first_expert=0, act=act), np.float32)
    floats = (x, ids, weights, gate_f, up_f, down_f)
    kernel = np.asarray(GEMM(*floats, first_expert=0, act=act), np.float32)
    loop = np.asarray(LOOP(*floats, first_expert=0, act=act), np.float32)
    scale = np.max(np.abs(loop))
    if dtype == jnp.float32:  # the same products, summed in 32-row halves instead of 64-row blocks
        np.testing.assert_allclose(got, kernel, atol=1e-6 * scale, rtol=1e-6)
        np.testing.assert_allclose(got, loop, atol=1e-6 * scale, rtol=1e-6)
    else:  # the same bfloat16 operands; a float32 sum's order differs, so h may round a step apart
        np.testing.assert_allclose(got, kernel, atol=2 ** -8 * scale, rtol=0)
        np.testing.assert_allclose(got, loop, atol=2 ** -6 * scale, rtol=0)
    # the loops that are not the kernel decode a model kept 4-bit per expert (or tile): the same sums
    np.testing.assert_allclose(np.asarray(LOOP(x, ids, weights, gate, up, down, first_expert=0, act=act), np.float32),
                               loop, atol=1e-6 * scale if dtype == jnp.float32 else 0, rtol=0)  # fmt: skip
    static = np.asarray(STATIC(x, ids, weights, gate, up, down, first_expert=0, act=act), np.float32)
    np.testing.assert_allclose(static, np.asarray(STATIC(*floats, first_expert=0, act=act), np.float32), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_mxfp4_explicit_launch_and_dead_tiles(dtype):
    """expert_glu_gemm / expert_gemm alone on MXFP4 leaves, tiles given by hand: dead tiles past num_live left
    unwritten, 16-wide N blocks over ragged edges, K = 96 (a block and a half); each live tile equals x times its
    expert's dequantized kernels, biases added as torch adds them. A launch whose K block is not 64 is refused."""
    rng = np.random.default_rng(4)
    m, k_dim, n_dim, experts = 16, 96, 40, 5
    tile_expert = jnp.asarray([4, 0, 2, 2, 5, 5], jnp.int32)  # the last two dead
    x = jnp.asarray(rng.standard_normal((6 * m, k_dim), dtype=np.float32), dtype)
    (gate, gate_f), (up, up_f) = (_mxfp4(rng, experts, k_dim, n_dim, dtype, bias=True) for _ in range(2))
    down, down_f = _mxfp4(rng, experts, n_dim + 24, k_dim, dtype)  # K = 64: h's 40 columns and 24 more
    launch = GemmLaunch(block_n=16, block_k=64, num_warps=4, num_stages=2)
    glu = lambda g, u, dtype: (jax.nn.silu(g) * u).astype(dtype)  # noqa: E731
    h = expert_glu_gemm(x, gate, up, tile_expert, 4, m=m, glu=glu, interpret=True, launch=launch)
    h_f = expert_glu_gemm(x, gate_f, up_f, tile_expert, 4, m=m, glu=glu, interpret=True)
    dead = np.asarray(h[4 * m :], np.float32)
    assert np.isnan(dead).all() or not dead.any()  # dead tiles: unwritten (interpret mode fills outputs with NaN)
    h64 = jnp.pad(h, ((0, 0), (0, 24)))
    y = expert_gemm(h64, down, tile_expert, 4, m=m, interpret=True)
    hp = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    close = lambda a, b: np.testing.assert_allclose(  # noqa: E731
        np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0,
        atol=(1e-6 if dtype == jnp.float32 else 2 ** -7) * np.max(np.abs(np.asarray(b, np.float32))))  # fmt: skip
    for i in range(4):
        rows, e = slice(i * m, (i + 1) * m), int(tile_expert[i])
        g, u = (jnp.dot(x[rows], w["kernel"][e], precision=hp, preferred_element_type=jnp.float32).astype(dtype).astype(jnp.float32)
                + w["bias"][e].astype(jnp.float32) for w in (gate_f, up_f))  # fmt: skip
        close(h[rows], glu(g, u, dtype))
        close(h[rows], h_f[rows])
        close(y[rows], jnp.dot(h64[rows], down_f["kernel"][e], precision=hp, preferred_element_type=jnp.float32))
    with pytest.raises(ValueError, match="64-deep inner blocks"):
        expert_gemm(h64, down, tile_expert, 4, m=m, interpret=True, launch=GemmLaunch(16, 32))


def test_mxfp4_launches_fit_every_gpu():
    """MXFP4's K block is always 64 (the packed layout's); the stages, then the N block, give way to fit, and the
    estimate counts the 4.25-bit blocks as stored and decoded."""
    memories = sorted({kib * 1024 for kib in SHARED_MEMORY_KIB.values()})
    for m in (16, 32, 64, 128):
        for num_weights, (n, k) in ((2, (2880, 2880)), (1, (2880, 2880)), (2, (40, 96))):
            for itemsize in (2, 4):
                for memory in memories:
                    launch = launch_config(m, n, k, num_weights, itemsize, 1, shared_memory=memory, mxfp4=True)
                    assert launch.block_k == 64
                    used = shared_memory_estimate(m, launch.block_n, 64, num_weights, itemsize, 1, launch.num_stages, mxfp4=True)
                    assert used <= memory * SHARED_MEMORY_MARGIN, (m, n, k, memory, launch)
    # per stage: x [m, 64] and per weight 32 code bytes + 2 scale bytes a column; once, the decoded [64, bn] blocks
    assert shared_memory_estimate(16, 64, 64, 2, 2, 1, 3, mxfp4=True) == 3 * (16 * 64 * 2 + 2 * (32 * 64 + 2 * 64)) + 2 * 64 * 64 * 2


# Lowering without the hardware, as the attention kernels' tests do: jax.export for "cuda" on the CPU.
_sd = jax.ShapeDtypeStruct


def _export(tokens, experts, top_k, d, f, dtype, act="silu", w_dtype=None, bias=False, shared_memory=None):
    w_dtype = w_dtype or dtype

    def leaf(shape):
        if w_dtype == "mxfp4":  # codes and scales in the packed layout
            padded = -(-shape[1] // 64) * 64
            out = {"kernel": _sd((experts, padded // 2, shape[2]), jnp.uint8),
                   "mx_scale": _sd((experts, padded // 32, shape[2]), jnp.uint8)}  # fmt: skip
            return out | ({"bias": _sd((experts, shape[2]), dtype)} if bias else {})
        out = {"kernel": _sd(shape, w_dtype)}
        if w_dtype != dtype:
            out["scale"] = _sd((experts, shape[2]), jnp.float32)
        return out | ({"bias": _sd((experts, shape[2]), dtype)} if bias else {})

    loop = GroupedGemmExperts(interpret=False, shared_memory=shared_memory)
    fn = jax.jit(lambda x, ids, w, g, u, dn: loop(x, ids, w, g, u, dn, first_expert=0, act=act))
    with lowering_for("cuda"):
        exported = export.export(fn, platforms=["cuda"], **export_checks("cuda"))(
            _sd((tokens, d), dtype), _sd((tokens, top_k), jnp.int32), _sd((tokens, top_k), jnp.float32),
            leaf((experts, d, f)), leaf((experts, d, f)), leaf((experts, f, d)),
        )  # fmt: skip
    return exported.mlir_module()


@pytest.mark.parametrize("tokens", [1, 64, 2048])  # decode at batch 1 and 64 (16-row tiles); a prefill (128-row tiles)
def test_lowers_for_cuda_at_qwen3_30b_a3b_shape(tokens):
    """128 experts of 768 over hidden 2048, top 8, bfloat16: one launch for gate/up and one for down, on an H100's
    shared memory and on the default's."""
    for memory in (227 * 1024, None):
        module = _export(tokens, 128, 8, 2048, 768, jnp.bfloat16, shared_memory=memory)
        assert len(kernel_calls(module, TRITON_CALLS)) == 2
        assert "stablehlo.while" not in module  # the routing's layout: no loop around the launches


@pytest.mark.parametrize("w_dtype,bias,act", [(None, True, CLAMPED), (jnp.int8, False, "silu"), (jnp.float8_e4m3fn, False, "silu")],
                         ids=["gpt-oss-biases-clamped", "int8", "fp8"])  # fmt: skip
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
def test_lowers_for_cuda_biased_and_quantized(dtype, w_dtype, bias, act):
    """GPT-OSS-20B's experts (32 of 2880 over 2880, top 4, biases, clamped SwiGLU: ragged 64-blocks), int8 and fp8."""
    module = _export(64, 32, 4, 2880, 2880, dtype, act=act, w_dtype=w_dtype, bias=bias)
    assert len(kernel_calls(module, TRITON_CALLS)) == 2


def test_exact_gelu_stays_on_the_static_tiles():
    """erf has no Triton lowering: an exact-GELU MoE runs StaticExpertTiles (no kernel, the same sums)."""
    module = _export(8, 8, 2, 64, 32, jnp.float32, act="gelu")
    assert not kernel_calls(module, TRITON_CALLS)


def test_experts_past_32_bit_offsets_stay_on_the_static_tiles():
    """DeepSeek-V3's experts on one device ([256, 7168, 2048]: 3.8G elements) would overflow the kernel's 32-bit
    offsets: the static tiles run them; split over 4 devices (expert parallelism), each shard's 940M take the kernel."""
    assert not kernel_calls(_export(8, 256, 8, 7168, 2048, jnp.bfloat16), TRITON_CALLS)
    assert len(kernel_calls(_export(8, 64, 8, 7168, 2048, jnp.bfloat16), TRITON_CALLS)) == 2


@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_lowers_for_cuda_with_mxfp4_experts(tokens):
    """GPT-OSS-20B's experts kept MXFP4 (32 of 2880 over 2880, top 4, biases, clamped SwiGLU): the decode (16-row
    tiles) and a prefill (128-row tiles) lower to the same two Triton launches a layer, in bfloat16 and float32, on
    an H100's shared memory and on the default's (each dtype on each memory over the three token counts)."""
    memories = (227 * 1024, None) if tokens != 64 else (None, 227 * 1024)
    for dtype, memory in zip((jnp.bfloat16, jnp.float32), memories):
        module = _export(tokens, 32, 4, 2880, 2880, dtype, act=CLAMPED, w_dtype="mxfp4", bias=True, shared_memory=memory)
        assert len(kernel_calls(module, TRITON_CALLS)) == 2
        assert "stablehlo.while" not in module

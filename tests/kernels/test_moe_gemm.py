"""The MoE grouped-GEMM kernel (pallas_kernels/moe_gemm.py, models/moe.py's grouped_expert_mlp_gemm): interpreted on
the CPU against the loop over the experts in use, the GPU's loop of static tiles and a per-token reference, for
random routings, empty experts, one expert taking every token, bucket padding, experts held elsewhere (expert
parallelism), float32 and bfloat16, shapes that are not multiples of the blocks, quantized experts and GPT-OSS's
biases with its clamped SwiGLU; its launches fit every GPU's shared memory; and it lowers (exported) for cuda at
Qwen3-30B-A3B's and GPT-OSS's shapes: two Triton calls a layer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jaxpaged.models.moe import (
    GroupedGemmExperts, gemm_tile_rows, grouped_expert_mlp, grouped_expert_mlp_gemm, grouped_expert_mlp_static, route,
)  # fmt: skip
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


# tokens, experts, top_k, d, f, first expert held, experts held, valid rows, routing
CASES = [
    (1, 8, 2, 80, 40, 0, 8, None, "random"),  # decode: one token; d and f not multiples of the blocks
    (37, 8, 2, 80, 40, 0, 8, None, "random"),  # two K blocks, a ragged N block
    (37, 8, 2, 64, 32, 0, 8, None, "empty_experts"),
    (24, 8, 2, 48, 24, 0, 8, None, "one_expert"),
    (37, 8, 2, 48, 24, 0, 8, 5, "random"),  # rows from 5 on are bucket padding: routed nowhere
    (37, 8, 2, 48, 24, 4, 4, None, "random"),  # experts 4..7 held here (expert parallelism), 0..3 elsewhere
    (300, 4, 2, 32, 48, 0, 4, None, "random"),  # 128-row tiles
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("tokens,experts,top_k,d,f,first,held,valid,routing", CASES)
def test_kernel_equals_the_loops_and_a_per_token_reference(tokens, experts, top_k, d, f, first, held, valid, routing, dtype):
    rng = np.random.default_rng(tokens * 7 + d + f + held)
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


# Lowering without the hardware, as the attention kernels' tests do: jax.export for "cuda" on the CPU.
_sd = jax.ShapeDtypeStruct


def _export(tokens, experts, top_k, d, f, dtype, act="silu", w_dtype=None, bias=False, shared_memory=None):
    w_dtype = w_dtype or dtype

    def leaf(shape):
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

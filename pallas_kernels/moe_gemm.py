"""A grouped GEMM for a MoE layer's experts on GPUs, in Pallas' Triton dialect (also run in interpret mode on CPU),
as vLLM's fused_moe and megablox's gmm do it: one launch per expert projection and layer.

The rows come sorted by expert and padded per expert to whole m-row tiles (models/moe.py lays them out), so tile i
is rows i*m .. i*m + m of one expert, `tile_expert[i]`. The grid is (tiles, output column blocks) over a static
bound of tiles (the most any routing needs); a program whose tile is past `num_live` (the tiles this routing uses)
returns at once and writes nothing. A live program reads its expert id, walks the inner dimension in bk-wide
blocks (x [m, bk] against the expert's kernel [bk, bn], masked past the array's edge), accumulates in float32 and
writes its [m, bn] block:

- `expert_glu_gemm`: gate and up in one program (two accumulators over the same x block), then the expert's
  activation (`glu(gate, up, dtype)`, GPT-OSS's clamped SwiGLU included), so the hidden [rows, F] is written once;
- `expert_gemm`: one projection (down), [rows, D] in x's dtype.

Each product is `models/moe.py`'s `_expert_matmul`: the kernel cast to x's dtype, a float32 sum (HIGHEST precision
for float32), times a per-expert, per-column scale when quantized (int8/fp8), plus a bias rounded as torch adds it
(the sum rounded to x's dtype first). Rows of live tiles past their expert's count read zero x rows; nothing reads
their outputs back, nor those of dead tiles (left unwritten).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_BLOCK = 16  # tl.dot's smallest M, N and K
DEFAULT_SHARED_MEMORY = 99 * 1024  # as gpu_attention's: sm_86/89/120; A100 163 KiB, H100/H200 227 KiB
SHARED_MEMORY_MARGIN = 0.85
MAX_ACCUMULATOR = 16 * 1024  # float32 accumulator elements per program (registers), as the attention kernel's


@dataclasses.dataclass(frozen=True)
class GemmLaunch:
    """How one projection's kernel is cut: output columns and inner-dimension elements a step, Triton's warps and
    pipeline stages. A program's rows are the tile's m (chosen with the layout)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def _pow2_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def shared_memory_estimate(m: int, block_n: int, block_k: int, num_weights: int, itemsize: int, w_itemsize: int,
                           num_stages: int) -> int:  # fmt: skip
    """Bytes a program's pipeline holds: per stage an x block and `num_weights` kernel blocks (as stored), plus the
    kernel blocks cast to x's dtype when they are stored narrower (int8/fp8)."""
    per_stage = m * block_k * itemsize + num_weights * block_k * block_n * w_itemsize
    cast = num_weights * block_k * block_n * itemsize if w_itemsize < itemsize else 0
    return num_stages * per_stage + cast


def launch_config(m: int, n: int, k: int, num_weights: int, itemsize: int, w_itemsize: int | None = None, *,
                  shared_memory: int = DEFAULT_SHARED_MEMORY) -> GemmLaunch:  # fmt: skip
    """A launch for m-row tiles of an [k, n] projection (num_weights 2: gate and up together). Small tiles (decode)
    take 64 columns, so a step with few tiles still has programs for every core; larger ones as many columns as
    MAX_ACCUMULATOR allows, up to 128. Blocks are powers of two from MIN_BLOCK, at most the dimension rounded up;
    the stages are the most (of 4, 3, 2, then a narrower K block) that fit the shared memory."""
    w_itemsize = itemsize if w_itemsize is None else w_itemsize
    block_n = 64 if m <= 16 else min(128, _pow2_at_most(MAX_ACCUMULATOR // (m * num_weights)))
    block_n = max(MIN_BLOCK, min(block_n, _pow2_at_least(n)))
    warps = 4 if m * block_n * num_weights <= 8192 else 8
    budget = shared_memory * SHARED_MEMORY_MARGIN
    for block_k in (64, 32, MIN_BLOCK):
        bk = max(MIN_BLOCK, min(block_k, _pow2_at_least(k)))
        for stages in (4, 3, 2):
            if shared_memory_estimate(m, block_n, bk, num_weights, itemsize, w_itemsize, stages) <= budget:
                return GemmLaunch(block_n, bk, warps, stages)
    return GemmLaunch(block_n, MIN_BLOCK, warps, 1)


def _kernel(live_ref, tile_expert_ref, x_ref, *refs, m, launch, n_dim, k_dim, num_weights, has_scale, has_bias, glu,
            precision):  # fmt: skip
    w_refs, refs = refs[:num_weights], refs[num_weights:]
    scale_refs, refs = (refs[:num_weights], refs[num_weights:]) if has_scale else ((), refs)
    bias_refs, refs = (refs[:num_weights], refs[num_weights:]) if has_bias else ((), refs)
    (o_ref,) = refs
    bn, bk = launch.block_n, launch.block_k
    tile, col = pl.program_id(0), pl.program_id(1)

    @pl.when(tile < live_ref[0])
    def _():
        expert = tile_expert_ref[tile]
        rows = pl.ds(tile * m, m)
        cols = pl.ds(col * bn, bn)
        col_ok = col * bn + jnp.arange(bn, dtype=jnp.int32) < n_dim
        ragged_n, ragged_k = n_dim % bn != 0, k_dim % bk != 0
        dtype = x_ref.dtype

        def step(kb, accs):
            inner = pl.ds(kb * bk, bk)
            k_ok = kb * bk + jnp.arange(bk, dtype=jnp.int32) < k_dim
            x_mask = jnp.broadcast_to(k_ok[None, :], (m, bk)) if ragged_k else None
            x = plgpu.load(x_ref.at[rows, inner], mask=x_mask, other=0 if ragged_k else None)
            w_mask = None
            if ragged_k or ragged_n:
                w_mask = jnp.broadcast_to(k_ok[:, None], (bk, bn)) & jnp.broadcast_to(col_ok[None, :], (bk, bn))
            out = []
            for acc, w_ref in zip(accs, w_refs):
                # masked lanes are left undefined (Triton cannot splat a 0 into fp8) and zeroed once cast: a NaN
                # there would survive a product with x's zeros
                w = plgpu.load(w_ref.at[expert, inner, cols], mask=w_mask).astype(dtype)
                if ragged_k:
                    w = jnp.where(w_mask, w, jnp.zeros((), dtype))
                out.append(acc + plgpu.dot(x, w, precision=precision))
            return tuple(out)

        accs = tuple(jnp.zeros((m, bn), jnp.float32) for _ in range(num_weights))
        accs = jax.lax.fori_loop(0, pl.cdiv(k_dim, bk), step, accs)
        vec_mask = col_ok if ragged_n else None
        vec_other = 0 if ragged_n else None
        if has_scale:
            accs = tuple(a * plgpu.load(s.at[expert, cols], mask=vec_mask, other=vec_other).astype(jnp.float32)[None, :]
                         for a, s in zip(accs, scale_refs))  # fmt: skip
        if has_bias:  # the sum rounded to x's dtype first, as torch adds a bias to a product in that dtype
            accs = tuple(a.astype(dtype).astype(jnp.float32)
                         + plgpu.load(b.at[expert, cols], mask=vec_mask, other=vec_other).astype(jnp.float32)[None, :]
                         for a, b in zip(accs, bias_refs))  # fmt: skip
        out = glu(*accs, dtype) if num_weights == 2 else accs[0]
        mask = jnp.broadcast_to(col_ok[None, :], (m, bn)) if ragged_n else None
        plgpu.store(o_ref.at[rows, cols], out.astype(o_ref.dtype), mask=mask)


def _grouped(x, weights, tile_expert, num_live, *, m: int, glu: Callable | None, interpret: bool,
             launch: GemmLaunch | None, shared_memory: int) -> jax.Array:  # fmt: skip
    """x [tiles * m, K] (tile i: rows of expert tile_expert[i]); weights: one or two projections' leaves
    ({"kernel" [E, K, N], "scale" [E, N]?, "bias" [E, N]?}) -> [tiles * m, N] in x's dtype."""
    rows, k_dim = x.shape
    n_dim = weights[0]["kernel"].shape[2]
    num_tiles = tile_expert.shape[0]
    if rows != num_tiles * m or m < MIN_BLOCK or m & (m - 1):
        raise ValueError(f"x has {rows} rows for {num_tiles} tiles of m={m} (a power of two, at least {MIN_BLOCK})")
    num_weights = len(weights)
    has_scale = "scale" in weights[0]
    has_bias = "bias" in weights[0]
    if launch is None:
        w_itemsize = weights[0]["kernel"].dtype.itemsize
        launch = launch_config(m, n_dim, k_dim, num_weights, x.dtype.itemsize, w_itemsize, shared_memory=shared_memory)
    operands = [w["kernel"] for w in weights]
    operands += [w["scale"] for w in weights] if has_scale else []
    operands += [w["bias"] for w in weights] if has_bias else []
    live = jnp.reshape(jnp.asarray(num_live, jnp.int32), (1,))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, n=a.ndim: (0,) * n)  # noqa: E731
    kernel = functools.partial(
        _kernel, m=m, launch=launch, n_dim=n_dim, k_dim=k_dim, num_weights=num_weights, has_scale=has_scale,
        has_bias=has_bias, glu=glu, precision=jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None,
    )  # fmt: skip
    name = f"moe_{'glu_' if num_weights == 2 else ''}gemm_m{m}_n{launch.block_n}_k{launch.block_k}"
    return pl.pallas_call(
        kernel,
        grid=(num_tiles, pl.cdiv(n_dim, launch.block_n)),
        in_specs=[whole(live), whole(tile_expert), whole(x), *(whole(a) for a in operands)],
        out_specs=pl.BlockSpec((rows, n_dim), lambda i, j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, n_dim), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages),
        interpret=interpret,
        name=name,
    )(live, tile_expert.astype(jnp.int32), x, *operands)


@functools.partial(jax.jit, static_argnames=("m", "glu", "interpret", "launch", "shared_memory"))
def expert_glu_gemm(x, gate, up, tile_expert, num_live, *, m: int, glu: Callable, interpret: bool = False,
                    launch: GemmLaunch | None = None, shared_memory: int = DEFAULT_SHARED_MEMORY) -> jax.Array:  # fmt: skip
    """glu(x @ gate[e], x @ up[e], x.dtype) for each m-row tile's expert e: [tiles * m, F] in x's dtype."""
    return _grouped(x, (gate, up), tile_expert, num_live, m=m, glu=glu, interpret=interpret, launch=launch,
                    shared_memory=shared_memory)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("m", "interpret", "launch", "shared_memory"))
def expert_gemm(x, proj, tile_expert, num_live, *, m: int, interpret: bool = False, launch: GemmLaunch | None = None,
                shared_memory: int = DEFAULT_SHARED_MEMORY) -> jax.Array:  # fmt: skip
    """x @ proj[e] for each m-row tile's expert e (times its scale, plus its bias): [tiles * m, N] in x's dtype."""
    return _grouped(x, (proj,), tile_expert, num_live, m=m, glu=None, interpret=interpret, launch=launch,
                    shared_memory=shared_memory)  # fmt: skip


__all__ = ["GemmLaunch", "expert_gemm", "expert_glu_gemm", "launch_config"]

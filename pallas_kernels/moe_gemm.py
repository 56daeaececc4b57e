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

MXFP4 kernels (GPT-OSS's experts kept 4-bit: a projection's leaves {"kernel": codes uint8, "mx_scale": uint8}) are
decoded in the program, block by block, and never exist in a wider dtype in memory: a memory-bound decode step reads
about a quarter of bf16's bytes (4.25 bits a value). The layout, made once on the host at load
(models/mxfp4.py's pack_mxfp4), is cut for a 64-deep inner block (block_k is always 64 for MXFP4):

- `kernel` uint8 [E, Kp / 2, N] (Kp: K rounded up to 64, the rows past K zero codes): byte row 32 * b + r of column
  n holds inner row 64 * b + r in its low nibble and inner row 64 * b + 32 + r in its high nibble, as 4-bit e2m1
  codes (bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives);
- `mx_scale` uint8 [E, Kp / 32, N]: row g is the power of two, biased by 127, of inner rows 32 * g .. 32 * g + 31
  of each column (OCP MX's E8M0: one scale per 32 consecutive inner values per output column).

So a program loads one [32, bn] byte block and two scale rows [bn] per 64 inner rows, decodes the low nibbles (inner
rows k .. k + 31) and the high ones (k + 32 .. k + 63) elementwise (the e2m1 value built as float32 bits, times
2^(scale - 127) built the same way, exact, then cast to x's dtype: both exact in bfloat16 and float32) and makes two
dots, x[:, k:k+32] against the low half and x[:, k+32:k+64] against the high half, into the float32 accumulator:
no nibble interleaving, reshape or concatenation in the kernel. A value under float32's normal range (a scale byte
of 0 or 1 with a small code; under 1e-37) flushes to zero, and a scale byte of 255 (NaN by the format) decodes as
infinity.
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
MXFP4_BLOCK_K = 64  # the packed layout's inner block: two 32-row halves, one scale row each
MXFP4_GROUP = 32  # inner values per MXFP4 scale


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
                           num_stages: int, mxfp4: bool = False) -> int:  # fmt: skip
    """Bytes a program's pipeline holds: per stage an x block and `num_weights` kernel blocks (as stored), plus the
    kernel blocks cast to x's dtype when they are stored narrower (int8/fp8). mxfp4: a kernel block is block_k / 2
    code bytes and block_k / 32 scale bytes a column, decoded to x's dtype (w_itemsize is not read)."""
    stored = block_k * block_n // 2 + block_k // MXFP4_GROUP * block_n if mxfp4 else block_k * block_n * w_itemsize
    per_stage = m * block_k * itemsize + num_weights * stored
    cast = num_weights * block_k * block_n * itemsize if mxfp4 or w_itemsize < itemsize else 0
    return num_stages * per_stage + cast


def launch_config(m: int, n: int, k: int, num_weights: int, itemsize: int, w_itemsize: int | None = None, *,
                  shared_memory: int = DEFAULT_SHARED_MEMORY, mxfp4: bool = False) -> GemmLaunch:  # fmt: skip
    """A launch for m-row tiles of an [k, n] projection (num_weights 2: gate and up together). Small tiles (decode)
    take 64 columns, so a step with few tiles still has programs for every core; larger ones as many columns as
    MAX_ACCUMULATOR allows, up to 128. Blocks are powers of two from MIN_BLOCK, at most the dimension rounded up;
    the stages are the most (of 4, 3, 2, then a narrower K block) that fit the shared memory. mxfp4: the K block is
    always 64 (the packed layout's), so the stages go down to 1, then the N block halves, to fit."""
    w_itemsize = itemsize if w_itemsize is None else w_itemsize
    block_n = 64 if m <= 16 else min(128, _pow2_at_most(MAX_ACCUMULATOR // (m * num_weights)))
    block_n = max(MIN_BLOCK, min(block_n, _pow2_at_least(n)))
    warps = 4 if m * block_n * num_weights <= 8192 else 8
    budget = shared_memory * SHARED_MEMORY_MARGIN
    if mxfp4:
        bn = block_n
        while True:
            for stages in (4, 3, 2, 1):
                used = shared_memory_estimate(m, bn, MXFP4_BLOCK_K, num_weights, itemsize, 1, stages, mxfp4=True)
                if used <= budget or (stages == 1 and bn == MIN_BLOCK):
                    return GemmLaunch(bn, MXFP4_BLOCK_K, warps, stages)
            bn //= 2
    for block_k in (64, 32, MIN_BLOCK):
        bk = max(MIN_BLOCK, min(block_k, _pow2_at_least(k)))
        for stages in (4, 3, 2):
            if shared_memory_estimate(m, block_n, bk, num_weights, itemsize, w_itemsize, stages) <= budget:
                return GemmLaunch(block_n, bk, warps, stages)
    return GemmLaunch(block_n, MIN_BLOCK, warps, 1)


def e2m1_values(codes: jax.Array) -> jax.Array:
    """4-bit e2m1 codes (int32, 0..15: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa) -> float32, built
    as float32 bits (elementwise integer ops and one bitcast, which Triton lowers): a normal code (exponent e > 0) is
    (1 + m / 2) * 2^(e - 1), float32 exponent field e + 126 and top mantissa bit m; a subnormal one m / 2."""
    e, m = (codes >> 1) & 3, codes & 1
    bits = jnp.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    magnitude = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where((codes & 8) != 0, -magnitude, magnitude)


def e8m0_values(scales: jax.Array) -> jax.Array:
    """MX scale bytes (int32, biased by 127) -> 2^(scale - 127) float32, exact for 1..254 (0 gives 0, 255 infinity)."""
    return jax.lax.bitcast_convert_type(scales << 23, jnp.float32)


def decode_mxfp4(codes: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """codes [r, n] (one nibble each, int32) and their scale row [n] (int32) -> the values [r, n] in dtype."""
    return (e2m1_values(codes) * e8m0_values(scale)[None, :]).astype(dtype)


def _kernel(live_ref, tile_expert_ref, x_ref, *refs, m, launch, n_dim, k_dim, num_weights, has_scale, has_bias, glu,
            precision, mxfp4=False):  # fmt: skip
    w_refs, refs = refs[:num_weights], refs[num_weights:]
    mx_refs, refs = (refs[:num_weights], refs[num_weights:]) if mxfp4 else ((), refs)
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

        def mxfp4_step(kb, accs):
            # 64 inner rows: codes [32, bn] (low nibbles rows k.., high nibbles rows k + 32..) and two scale rows
            half = MXFP4_BLOCK_K // 2
            xs = []
            for h in range(2):
                start = kb * MXFP4_BLOCK_K + h * half
                k_ok = start + jnp.arange(half, dtype=jnp.int32) < k_dim
                x_mask = jnp.broadcast_to(k_ok[None, :], (m, half)) if ragged_k else None
                xs.append(plgpu.load(x_ref.at[rows, pl.ds(start, half)], mask=x_mask, other=0 if ragged_k else None))
            # the packed rows past K hold zero codes (real memory, read as they are); masked columns are never stored
            w_mask = jnp.broadcast_to(col_ok[None, :], (half, bn)) if ragged_n else None
            out = []
            for acc, w_ref, s_ref in zip(accs, w_refs, mx_refs):
                codes = plgpu.load(w_ref.at[expert, pl.ds(kb * half, half), cols], mask=w_mask).astype(jnp.int32)
                for h, nibbles in enumerate((codes & 15, codes >> 4)):
                    scale = plgpu.load(s_ref.at[expert, 2 * kb + h, cols], mask=vec_mask).astype(jnp.int32)
                    acc = acc + plgpu.dot(xs[h], decode_mxfp4(nibbles, scale, dtype), precision=precision)
                out.append(acc)
            return tuple(out)

        vec_mask = col_ok if ragged_n else None
        accs = tuple(jnp.zeros((m, bn), jnp.float32) for _ in range(num_weights))
        accs = jax.lax.fori_loop(0, pl.cdiv(k_dim, bk), mxfp4_step if mxfp4 else step, accs)
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


def _check_mxfp4(weights, k_dim: int, n_dim: int) -> None:
    """MXFP4 leaves in the packed layout (the module docstring) for an inner dimension of k_dim."""
    padded = -(-k_dim // MXFP4_BLOCK_K) * MXFP4_BLOCK_K
    for w in weights:
        codes, scales = w["kernel"], w["mx_scale"]
        e = codes.shape[0]
        want = ((e, padded // 2, n_dim), (e, padded // MXFP4_GROUP, n_dim))
        if (codes.shape, scales.shape) != want or codes.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
            raise ValueError(f"MXFP4 kernel {codes.dtype}{list(codes.shape)} and scales {scales.dtype}{list(scales.shape)} do "
                             f"not fit x's {k_dim} inner values: expected uint8 {list(want[0])} and {list(want[1])}")  # fmt: skip
        if "scale" in w:
            raise ValueError("an MXFP4 projection has no per-column scale")


def _grouped(x, weights, tile_expert, num_live, *, m: int, glu: Callable | None, interpret: bool,
             launch: GemmLaunch | None, shared_memory: int) -> jax.Array:  # fmt: skip
    """x [tiles * m, K] (tile i: rows of expert tile_expert[i]); weights: one or two projections' leaves
    ({"kernel" [E, K, N], "scale" [E, N]?, "bias" [E, N]?}, or MXFP4's {"kernel" uint8 [E, Kp / 2, N], "mx_scale"
    uint8 [E, Kp / 32, N], "bias"?}) -> [tiles * m, N] in x's dtype."""
    rows, k_dim = x.shape
    n_dim = weights[0]["kernel"].shape[2]
    num_tiles = tile_expert.shape[0]
    if rows != num_tiles * m or m < MIN_BLOCK or m & (m - 1):
        raise ValueError(f"x has {rows} rows for {num_tiles} tiles of m={m} (a power of two, at least {MIN_BLOCK})")
    num_weights = len(weights)
    has_scale = "scale" in weights[0]
    has_bias = "bias" in weights[0]
    mxfp4 = "mx_scale" in weights[0]
    if mxfp4:
        _check_mxfp4(weights, k_dim, n_dim)
    if launch is None:
        w_itemsize = weights[0]["kernel"].dtype.itemsize
        launch = launch_config(m, n_dim, k_dim, num_weights, x.dtype.itemsize, w_itemsize, shared_memory=shared_memory,
                               mxfp4=mxfp4)  # fmt: skip
    elif mxfp4 and launch.block_k != MXFP4_BLOCK_K:
        raise ValueError(f"MXFP4 kernels are packed in {MXFP4_BLOCK_K}-deep inner blocks; launch.block_k is {launch.block_k}")
    operands = [w["kernel"] for w in weights]
    operands += [w["mx_scale"] for w in weights] if mxfp4 else []
    operands += [w["scale"] for w in weights] if has_scale else []
    operands += [w["bias"] for w in weights] if has_bias else []
    live = jnp.reshape(jnp.asarray(num_live, jnp.int32), (1,))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, n=a.ndim: (0,) * n)  # noqa: E731
    kernel = functools.partial(
        _kernel, m=m, launch=launch, n_dim=n_dim, k_dim=k_dim, num_weights=num_weights, has_scale=has_scale,
        has_bias=has_bias, glu=glu, precision=jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None, mxfp4=mxfp4,
    )  # fmt: skip
    name = f"moe_{'glu_' if num_weights == 2 else ''}gemm{'_mxfp4' if mxfp4 else ''}_m{m}_n{launch.block_n}_k{launch.block_k}"
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


__all__ = ["GemmLaunch", "decode_mxfp4", "expert_gemm", "expert_glu_gemm", "launch_config"]

"""The sparse mixture-of-experts MLP the MoE families share (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE).

Router: logits = x @ gate (float32), softmax, top-k, optionally renormalized (Mixtral always; the others per
`norm_topk_prob`). Experts: E gated MLPs stacked into [E, in, out] kernels. The grouped matmul runs in the jitted
step with fixed shapes: the T*k (token, expert) assignments are sorted by expert, so each expert's rows are one
run; a while loop over the experts in use (a traced trip count) slices that expert's kernels once and multiplies
its run in m-row tiles, the rest in at most one tile of each of m, m/2, .., m/8 rows, so an expert's rows are padded
by under m/8 (prefill steps, at about m rows an expert, padded half their rows to whole m-row tiles before).
Nothing is dropped and no shape depends on the routing; the bucket's padding rows (past the step's real token
count) go to no expert. jax.lax.ragged_dot would do the same sums, but off TPU it expands to a dense product
against every expert (E times the work).

Under a "model" mesh of N devices the experts split over it (expert parallelism) when N divides E, else each
expert's intermediate features split (tensor parallelism). Tokens are replicated there, so each device computes
its own share of every token's experts under shard_map and one psum adds the shares; no all-to-all is needed.

Checkpoints store experts one tensor per expert (`experts.N.{gate,up,down}_proj.weight`, Mixtral's
`block_sparse_moe.experts.N.w1/w3/w2.weight`) or fused as transformers 5 holds them in memory
(`experts.gate_up_proj` [E, 2I, D], `experts.down_proj` [E, D, I]); `regroup_expert_tensors` stacks either into the
port's `...mlp.experts.{gate,up,down}_proj.kernel` [E, in, out] before the loader sees them. GPT-OSS's MXFP4
experts may stay 4-bit (ExpertLinear.load_mxfp4: codes as `kernel`, `mx_scale`) where the expert loop reads them
(GroupedGemmExperts.reads_mxfp4: the kernel decodes them); the other loops decode them per expert or tile if given.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from jaxpaged.models.accounting import shown
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.layers import GatedMLP, Linear, _param, activation
from jaxpaged.models.weights import WeightSpec, projection_specs
from jaxpaged.pallas_kernels.attention import TP_AXIS, tp_size

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class MoeOptions:
    """The MoE knobs of a ModelConfig (kept in its `options`)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # top-k weights divided by their sum
    shared_expert_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    sparse_layers: tuple[int, ...] = ()  # layers with a MoE MLP; the others are dense GatedMLPs

    @staticmethod
    def of(cfg: ModelConfig) -> MoeOptions:
        return MoeOptions(**dict(cfg.option("moe")))

    def as_option(self) -> tuple[tuple[str, Any], ...]:
        return tuple(sorted(dataclasses.asdict(self).items()))


def moe_options_from_hf(hf_config, *, num_experts: int, renormalize: bool, intermediate_size: int,
                        shared_expert_size: int = 0) -> MoeOptions:  # fmt: skip
    """Which layers are sparse as Qwen2/3-MoE decide it (`mlp_only_layers`, `decoder_sparse_step`); all by default."""
    top_k = int(hf_config.num_experts_per_tok)
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({num_experts})")
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = int(getattr(hf_config, "decoder_sparse_step", None) or 1)
    layers = int(hf_config.num_hidden_layers)
    sparse = tuple(i for i in range(layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    return MoeOptions(num_experts, top_k, intermediate_size, renormalize, shared_expert_size, sparse)


# -- sharding: one rule, read by models/sharding.py and by the layer when it traces ----------------


def expert_parallel(num_experts: int, n: int) -> bool:
    """Experts split over the n devices of the model axis (else each expert's intermediate features split)."""
    return n > 1 and num_experts % n == 0


def expert_partition_spec(projection: str, leaf: str, shape: tuple[int, ...], n: int) -> P:
    """kernel [E, in, out] and scale [E, out] of `projection` (gate_proj, up_proj, down_proj) on n devices."""
    if n <= 1:
        return P()
    if expert_parallel(shape[0], n):
        return P(TP_AXIS, *(None,) * (len(shape) - 1))
    stacked = leaf in ("kernel", "mx_scale")  # [E, in, out]-shaped (MXFP4's codes and scales: [E, Kp / 2 or 32, out])
    if leaf == "mx_scale" and projection == "down_proj" and shape[1] % (2 * n):  # down's inner rows: whole 64-row blocks
        raise mxfp4_split_error(shape[1] * 32, shape[0], n)
    if projection == "down_proj":  # row-parallel: its input (intermediate) axis splits, its scale is whole
        return P(None, TP_AXIS, None) if stacked else P()
    return P(None, None, TP_AXIS) if stacked else P(None, TP_AXIS)


def mxfp4_split_error(features: int, num_experts: int, n: int) -> ValueError:
    """MXFP4 experts kept 4-bit split by feature: each device's share of down's inner rows must be whole 64-row
    blocks of the packed layout (pallas_kernels/moe_gemm.py)."""
    return ValueError(f"MXFP4 experts split by feature over {n} devices need {64 * n} to divide their {features} "
                      f"features (padded to whole 64-row blocks); load them dequantized (quantization='none') or use "
                      f"a tensor_parallel_size that divides the {num_experts} experts")  # fmt: skip


def check_experts_divisible(cfg: ModelConfig, n: int) -> None:
    moe = MoeOptions.of(cfg)
    if n > 1 and moe.num_experts % n and moe.intermediate_size % n:
        raise ValueError(
            f"tensor_parallel_size={n} divides neither this {cfg.architecture}'s num_experts={moe.num_experts} "
            f"(expert parallelism) nor its moe_intermediate_size={moe.intermediate_size} (tensor parallelism)"
        )


# -- layers ------------------------------------------------------------------------------------


class ExpertLinear(nnx.Module):
    """E stacked kernels [E, in, out] (and biases [E, out], GPT-OSS); quantized (`load_quantized`): int8/fp8 kernels
    with a scale [E, out] per expert and output channel, w = kernel * scale, as ChannelLinear holds a dense one."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, dtype, bias: bool = False):
        self.kernel = _param((num_experts, in_features, out_features), dtype)
        self.bias = _param((num_experts, out_features), dtype) if bias else None

    def load_quantized(self, weight: np.ndarray, kind: str) -> None:
        """A float [E, in, out] host array -> per expert, per output channel int8 or fp8 (quantize_channels)."""
        from jaxpaged.models.quantization import quantize_channels

        pairs = [quantize_channels(w, kind) for w in np.asarray(weight, np.float32)]
        self.kernel = nnx.Param(jax.device_put(np.stack([q for q, _ in pairs])))
        self.scale = nnx.Param(jax.device_put(np.stack([s for _, s in pairs])))

    def load_mxfp4(self, codes: np.ndarray, scales: np.ndarray, in_features: int) -> None:
        """MXFP4 kept 4-bit (models/mxfp4.py PackedMxfp4): kernel <- codes uint8 [E, Kp / 2, out] and mx_scale <-
        scales uint8 [E, Kp / 32, out], in the grouped GEMM's layout (pallas_kernels/moe_gemm.py); 4.25 bits a value."""
        e, k, n = self.kernel.shape
        padded = -(-k // 64) * 64
        want = ((e, padded // 2, n), (e, padded // 32, n))
        if in_features != k or (codes.shape, scales.shape) != want:
            raise ValueError(f"MXFP4 codes {codes.shape} and scales {scales.shape} of {in_features} inner values do not "
                             f"fit experts [{e}, {k}, {n}] (expected {want[0]} and {want[1]})")  # fmt: skip
        put = lambda a: nnx.Param(jax.device_put(np.require(a, np.uint8, ("C", "W"))))  # noqa: E731
        self.kernel, self.mx_scale = put(codes), put(scales)

    def arrays(self) -> dict[str, jax.Array]:
        """{"kernel", and "scale" when quantized (int8/fp8) or "mx_scale" when MXFP4 (kernel: the packed codes),
        "bias" when biased}: the leaves the expert loop reads."""
        out = {"kernel": self.kernel[...]}
        for leaf in ("scale", "mx_scale"):  # set by load_quantized, load_mxfp4
            if getattr(self, leaf, None) is not None:
                out[leaf] = getattr(self, leaf)[...]
        return out | ({} if self.bias is None else {"bias": self.bias[...]})


class Experts(nnx.Module):
    """act: an activation's name (act(gate) * up), or GPT-OSS's ("clamped_swiglu", alpha, limit) (expert_glu)."""

    def __init__(self, moe: MoeOptions, hidden_size: int, *, act, dtype, bias: bool = False):
        e, d, f = moe.num_experts, hidden_size, moe.intermediate_size
        self.gate_proj = ExpertLinear(e, d, f, dtype=dtype, bias=bias)
        self.up_proj = ExpertLinear(e, d, f, dtype=dtype, bias=bias)
        self.down_proj = ExpertLinear(e, f, d, dtype=dtype, bias=bias)
        self.act = act


def expert_glu(act, float32_ops: bool = False):
    """(gate, up [m, F] float32, dtype) -> the expert's hidden [m, F] in dtype: act(gate) * up, or GPT-OSS's clamped
    SwiGLU as transformers' GptOssExperts computes it: gate clamped above at limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate). float32_ops (the Triton kernel's: it has no 16-bit division): the clamped
    SwiGLU's ops in float32, each result (and alpha, limit) rounded to dtype as the op in dtype would round it."""
    if isinstance(act, tuple) and act[0] == "clamped_swiglu":
        _, alpha, limit = act

        def clamped(g, u, dtype):
            g, u = jnp.minimum(g.astype(dtype), limit), jnp.clip(u.astype(dtype), -limit, limit)
            return (u + 1) * (g * jax.nn.sigmoid(g * alpha))

        def clamped_float32(g, u, dtype):
            r = lambda v: v.astype(dtype).astype(jnp.float32)  # noqa: E731
            a, lim = (float(np.asarray(v, dtype=jnp.dtype(dtype)).astype(np.float32)) for v in (alpha, limit))
            g, u = jnp.minimum(r(g), lim), jnp.clip(r(u), -lim, lim)
            return (r(u + 1) * r(g * r(jax.nn.sigmoid(r(g * a))))).astype(dtype)

        return clamped_float32 if float32_ops else clamped
    fn = activation(act)
    return lambda g, u, dtype: fn(g).astype(dtype) * u.astype(dtype)


def _leaves(weights) -> dict[str, jax.Array]:
    """A projection's arrays as ExpertLinear.arrays gives them; a tuple (kernel[, scale]) is read as such."""
    return weights if isinstance(weights, dict) else dict(zip(("kernel", "scale"), weights))


def route(logits: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32), as transformers' TopKRouter."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class RouterOptions:
    """DeepSeek's router (grouped_route): how experts are scored, chosen by group, and weighted."""

    scoring: str = "softmax"  # "softmax" (V2) or "sigmoid" (V3)
    correction_bias: bool = False  # V3: e_score_correction_bias added to the scores for choosing only
    num_groups: int = 1  # n_group; 1: no group limit
    topk_groups: int = 1  # topk_group: the groups a token's experts may come from
    group_score: str = "max"  # a group's rank: its best score (V2) or its top-2 sum ("top2_sum", V3)
    renormalize: bool = False
    scaling: float = 1.0  # routed_scaling_factor, on the weights


def grouped_route(logits: jax.Array, top_k: int, opts: RouterOptions, bias: jax.Array | None = None):
    """Router logits [T, E] -> (weights [T, k] float32, ids [T, k] int32) as transformers' DeepseekV2/V3TopkRouter:
    scores (softmax or sigmoid), plus the correction bias for choosing; with groups, only the topk_groups best groups'
    experts may be chosen (the others' scores masked: -inf with a bias, 0 without, as each version does); the weights
    are the chosen experts' unbiased scores, renormalized (+1e-20) if asked, times the scaling factor."""
    logits = logits.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if opts.scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    t, e = choice.shape
    if opts.num_groups > 1:
        grouped = choice.reshape(t, opts.num_groups, e // opts.num_groups)
        if opts.group_score == "top2_sum":
            rank = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        else:
            rank = jnp.max(grouped, axis=-1)
        best = jax.lax.top_k(rank, opts.topk_groups)[1]
        keep = jnp.sum(jax.nn.one_hot(best, opts.num_groups, dtype=jnp.int32), axis=1) > 0  # [T, groups]
        keep = jnp.repeat(keep, e // opts.num_groups, axis=1)
        choice = jnp.where(keep, choice, -jnp.inf if bias is not None else 0.0)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores if bias is not None else choice, ids, axis=-1)
    if opts.renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * opts.scaling, ids.astype(jnp.int32)


def tile_rows(assignments: int, num_experts: int) -> int:
    """Rows per full tile: about assignments / experts (a power of two, 1 to 128), so tiles stay few."""
    per_expert = -(-assignments // num_experts)
    return min(128, 1 << max(0, per_expert - 1).bit_length())


def tail_sizes(m: int) -> tuple[int, ...]:
    """The tile sizes an expert's rows past its full m-row tiles run in (m, m/2, .. down to m/8): its last tile is
    then padded by less than m/8 rows, not up to m (half the rows at about m rows an expert, as prefill steps have)."""
    return tuple(m >> i for i in range(min(3, m.bit_length() - 1) + 1))


def dequantize_mxfp4_packed(codes: jax.Array, scales: jax.Array, in_features: int, dtype) -> jax.Array:
    """One expert's MXFP4 leaves in the grouped GEMM's layout (codes uint8 [Kp / 2, N], scales uint8 [Kp / 32, N])
    -> [in_features, N] in dtype, decoded as the kernel decodes them: for the loops that are not the kernel (a model
    kept 4-bit run by StaticExpertTiles or the loop over the experts in use: slower, the same sums)."""
    from jaxpaged.pallas_kernels.moe_gemm import e2m1_values, e8m0_values

    c = codes.astype(jnp.int32)
    half, n = c.shape
    c = c.reshape(half // 32, 32, n)
    values = e2m1_values(jnp.stack([c & 15, c >> 4], axis=1).reshape(2 * half, n))
    scale = jnp.repeat(e8m0_values(scales.astype(jnp.int32)), 32, axis=0)
    return (values * scale).astype(dtype)[:in_features]


def _expert_matmul(x: jax.Array, weights: dict[str, jax.Array]) -> jax.Array:
    """x [m, in] times one expert's kernel [in, out] (times its scale [out] when quantized, plus its bias [out]
    when biased; MXFP4 leaves decoded first) -> [m, out] f32."""
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = weights["kernel"]
    if "mx_scale" in weights:
        kernel = dequantize_mxfp4_packed(kernel, weights["mx_scale"], x.shape[1], x.dtype)
    y = jnp.dot(x, kernel.astype(x.dtype), precision=precision, preferred_element_type=jnp.float32)
    if "scale" in weights:
        y = y * weights["scale"].astype(jnp.float32)[None, :]
    if "bias" in weights:  # rounded to x's dtype first, as torch adds a bias to a product in that dtype
        y = y.astype(x.dtype).astype(jnp.float32) + weights["bias"].astype(jnp.float32)[None, :]
    return y


def _one_expert(arrays, expert: jax.Array):
    """Expert `expert`'s leaves (kernel, scale, bias) of gate, up and down, sliced once for all its tiles."""
    return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, expert, keepdims=False), arrays)


def _expert_rows(xs, y, start, count, kernels, m: int, act: str):
    """y's rows start .. start + count (expert-sorted, all one expert's) <- that expert's MLP of xs's: full m-row
    tiles in a loop, then at most one tile of each tail size (the last one masked past count)."""
    glu = expert_glu(act)
    gate, up, down = kernels

    def mlp(x):
        h = glu(_expert_matmul(x, gate), _expert_matmul(x, up), x.dtype)
        return _expert_matmul(h, down).astype(x.dtype)

    def full(i, y):
        at = start + i * m
        return jax.lax.dynamic_update_slice_in_dim(y, mlp(jax.lax.dynamic_slice_in_dim(xs, at, m)), at, 0)

    done = count // m * m
    y = jax.lax.fori_loop(0, count // m, full, y)
    sizes = tail_sizes(m)
    left = -(-(count - done) // sizes[-1]) * sizes[-1]  # the rest, rounded up to the smallest size: its bits
    for size in sizes:  # pick the tail tiles, each at the sum of the larger bits

        def tail(y, at=start + done + (left & ~(2 * size - 1)), size=size):
            rows = at + jnp.arange(size)[:, None]
            old = jax.lax.dynamic_slice_in_dim(y, at, size)
            new = jnp.where(rows < start + count, mlp(jax.lax.dynamic_slice_in_dim(xs, at, size)), old)
            return jax.lax.dynamic_update_slice_in_dim(y, new, at, 0)

        y = jax.lax.cond(left & size != 0, tail, lambda y: y, y)
    return y


def _held_experts(ids, e: int, first_expert, num_valid) -> jax.Array:
    """Each of the T*k assignments' local expert, e for those held elsewhere (or padding past num_valid)."""
    a, k = ids.size, ids.shape[1]
    expert = ids.reshape(a) - first_expert
    held = (expert >= 0) & (expert < e)
    if num_valid is not None:
        held = held & (jnp.arange(a, dtype=jnp.int32) // k < num_valid)
    return jnp.where(held, expert, e)


def _sorted_by_expert(ids, e: int, first_expert, num_valid) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The T*k assignments' order sorted by expert (those held elsewhere, or padding past num_valid, last), and each
    held expert's count and start in that order."""
    return _sort_held(_held_experts(ids, e, first_expert, num_valid), e)


def _sort_held(expert, e: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """_held_experts' vector -> its order by expert (e, held elsewhere or padding, sorted last, never run), and each
    held expert's count and start in that order."""
    order = jnp.argsort(expert, stable=True)
    counts = jnp.zeros(e + 1, jnp.int32).at[expert].add(1)[:e]
    return order, counts, jnp.cumsum(counts) - counts


def grouped_expert_mlp(x, ids, weights, gate, up, down, *, first_expert, act: str, num_valid=None) -> jax.Array:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) over the experts held here (ids first_expert.. + E_local);
    assignments to other experts add nothing. gate/up/down: (kernel [E_local, in, out], optional scale [E_local, out]).
    num_valid (traced scalar, optional): rows from it on are the bucket's padding; they are routed nowhere (their
    output is zero). The assignments sorted by expert lie in one run per expert; a while loop over the experts in
    use slices each one's kernels once and runs its rows (_expert_rows), so the cost follows the rows routed here,
    not a static bound, and a tile never copies a kernel."""
    gate, up, down = _leaves(gate), _leaves(up), _leaves(down)
    t, d = x.shape
    k, e = ids.shape[1], gate["kernel"].shape[0]
    a, m = t * k, tile_rows(t * k, e)
    order, counts, starts = _sorted_by_expert(ids, e, first_expert, num_valid)
    used = jnp.nonzero(counts, size=e, fill_value=0)[0].astype(jnp.int32)
    # m rows past the end: a tile that overruns its expert's run (masked, or the next expert's) stays in range
    xs = jnp.concatenate([x[order // k], jnp.zeros((m, d), x.dtype)])
    arrays = (gate, up, down)

    def run_expert(j, y):
        ex = used[j]
        return _expert_rows(xs, y, starts[ex], counts[ex], _one_expert(arrays, ex), m, act)

    # rows of assignments held elsewhere (sorted last) are never written: they stay zero
    y = jax.lax.fori_loop(0, jnp.sum(counts > 0), run_expert, jnp.zeros_like(xs))[:a]
    y = jnp.zeros((a, d), y.dtype).at[order].set(y).reshape(t, k, d)  # back to (token, slot) order
    return jnp.sum(y * weights.astype(x.dtype)[:, :, None], axis=1)


def grouped_expert_mlp_static(x, ids, weights, gate, up, down, *, first_expert, act: str, num_valid=None) -> jax.Array:
    """grouped_expert_mlp's sums with no traced trip count and no conditional: where XLA runs those by reading a
    predicate back to the host (a GPU: a round trip per expert per layer), every expert's run is cut into m-row tiles
    and a loop of a fixed count (ceil(T*k / m) + E, the most tiles any routing needs) runs one tile an iteration,
    tiles past the last used one masked out."""
    gate, up, down = _leaves(gate), _leaves(up), _leaves(down)
    t, d = x.shape
    k, e = ids.shape[1], gate["kernel"].shape[0]
    a, m = t * k, tile_rows(t * k, e)
    order, counts, starts = _sorted_by_expert(ids, e, first_expert, num_valid)
    tiles = -(-counts // m)
    tile_end = jnp.cumsum(tiles)  # tile i belongs to the first expert whose tile_end exceeds i (e: none)
    num_tiles = -(-a // m) + e  # sum of ceil(count / m) over the experts is at most a / m + e
    tile_expert = jnp.sum(tile_end[None, :] <= jnp.arange(num_tiles, dtype=jnp.int32)[:, None], axis=1, dtype=jnp.int32)
    xs = jnp.concatenate([x[order // k], jnp.zeros((m, d), x.dtype)])  # m zero rows: an empty tile reads those
    glu = expert_glu(act)
    arrays = (gate, up, down)

    def run_tile(i, y):
        ex = tile_expert[i]
        live = ex < e
        ex = jnp.minimum(ex, e - 1)
        local = i - (tile_end[ex] - tiles[ex])  # the tile's index within its expert's run
        at = jnp.where(live, starts[ex] + local * m, a)
        end = jnp.where(live, starts[ex] + counts[ex], a)
        g, u, dn = _one_expert(arrays, ex)
        rows = jax.lax.dynamic_slice_in_dim(xs, at, m)
        h = glu(_expert_matmul(rows, g), _expert_matmul(rows, u), x.dtype)
        new = _expert_matmul(h, dn).astype(x.dtype)
        old = jax.lax.dynamic_slice_in_dim(y, at, m)
        keep = (at + jnp.arange(m))[:, None] < end
        return jax.lax.dynamic_update_slice_in_dim(y, jnp.where(keep, new, old), at, 0)

    y = jax.lax.fori_loop(0, num_tiles, run_tile, jnp.zeros_like(xs))[:a]
    y = jnp.zeros((a, d), y.dtype).at[order].set(y).reshape(t, k, d)
    return jnp.sum(y * weights.astype(x.dtype)[:, :, None], axis=1)


@dataclasses.dataclass(frozen=True)
class ExpertLoop:
    """How a MoE layer loops over its experts: over the experts in use, each run's tiles (grouped_expert_mlp); a
    platform whose device cannot branch without the host swaps in StaticExpertTiles (prepare_model)."""

    # whether MXFP4 experts stay 4-bit for this loop (models/mxfp4.py); a loop without it runs them dequantized once
    # at load (it would decode them per expert or tile each step otherwise)
    reads_mxfp4: ClassVar[bool] = False

    def __call__(self, *args, **kwargs) -> jax.Array:
        return grouped_expert_mlp(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class StaticExpertTiles(ExpertLoop):
    def __call__(self, *args, **kwargs) -> jax.Array:
        return grouped_expert_mlp_static(*args, **kwargs)


# activations the Triton kernel lowers (no erf: exact GELU stays on StaticExpertTiles), and GPT-OSS's clamped SwiGLU
GEMM_ACTIVATIONS = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "quick_gelu", "relu", "relu2", "clamped_swiglu")


def gemm_tile_rows(assignments: int, num_experts: int) -> int:
    """The grouped GEMM's rows per tile: tile_rows, at least 16 (tl.dot's smallest M)."""
    return max(16, tile_rows(assignments, num_experts))


@functools.lru_cache(maxsize=None)
def _glu(act):
    return expert_glu(act, float32_ops=True)  # one function per act: the kernel's static argument, its trace reused


def grouped_expert_mlp_gemm(x, ids, weights, gate, up, down, *, first_expert, act, num_valid=None, interpret: bool = False,
                            shared_memory: int | None = None) -> jax.Array:  # fmt: skip
    """grouped_expert_mlp's sums in two kernel launches (pallas_kernels/moe_gemm.py): gate/up with the activation,
    then down. Each expert's rows, sorted by expert, are padded to whole m-row tiles (tile i: rows i*m.., of expert
    tile_expert[i]) over a static bound of tiles (min(T*k, (T*k + E*(m-1)) // m), the most any routing needs); the
    kernels skip the tiles past those in use, and each assignment's output row is read back from its tile."""
    from jaxpaged.pallas_kernels.moe_gemm import DEFAULT_SHARED_MEMORY, expert_gemm, expert_glu_gemm

    gate, up, down = _leaves(gate), _leaves(up), _leaves(down)
    t, d = x.shape
    k, e = ids.shape[1], gate["kernel"].shape[0]
    a, m = t * k, gemm_tile_rows(t * k, e)
    expert = _held_experts(ids, e, first_expert, num_valid)
    order, counts, starts = _sort_held(expert, e)
    tiles = -(-counts // m)
    tile_end = jnp.cumsum(tiles)
    tile_first = tile_end - tiles
    num_tiles = min(a, (a + e * (m - 1)) // m)  # sum of ceil(count / m) over the experts, at most
    tile_ids = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_expert = jnp.sum(tile_end[None, :] <= tile_ids[:, None], axis=1, dtype=jnp.int32)  # e: past those in use
    ex = jnp.minimum(tile_expert, e - 1)
    within = ((tile_ids - tile_first[ex]) * m)[:, None] + jnp.arange(m, dtype=jnp.int32)[None, :]  # [tiles, m]
    real = (tile_expert < e)[:, None] & (within < counts[ex][:, None])
    token = order[jnp.minimum(starts[ex][:, None] + within, a - 1)] // k
    xs = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])[jnp.where(real, token, t).reshape(-1)]  # t: a zero row
    live = tile_end[-1]
    memory = {"shared_memory": shared_memory or DEFAULT_SHARED_MEMORY}
    h = expert_glu_gemm(xs, gate, up, tile_expert, live, m=m, glu=_glu(act), interpret=interpret, **memory)
    out = expert_gemm(h, down, tile_expert, live, m=m, interpret=interpret, **memory)
    # each assignment's row: its rank within its expert's run -> that expert's tile and row
    rank = jnp.zeros(a, jnp.int32).at[order].set(jnp.arange(a, dtype=jnp.int32))
    held = expert < e
    mine = jnp.minimum(expert, e - 1)
    j = rank - starts[mine]
    at = jnp.where(held, (tile_first[mine] + j // m) * m + j % m, 0)
    y = jnp.where(held[:, None], out[at], jnp.zeros((), out.dtype)).reshape(t, k, d)
    return jnp.sum(y * weights.astype(x.dtype)[:, :, None], axis=1)


@dataclasses.dataclass(frozen=True)
class GroupedGemmExperts(ExpertLoop):
    """The experts as two grouped-GEMM kernel launches a layer (a GPU's Pallas Triton kernel; interpret: the same
    kernel interpreted, on a CPU, for tests). An activation the kernel does not lower, or expert kernels of 2^31
    elements or more (the kernel's offsets are 32-bit: DeepSeek-V3's [256, 7168, 2048] on one device), run
    StaticExpertTiles."""

    interpret: bool = False
    shared_memory: int | None = None  # bytes a block may use (the GPU's); None: the kernel's default
    reads_mxfp4: ClassVar[bool] = True  # decoded in the kernel's inner loop (pallas_kernels/moe_gemm.py)

    def __call__(self, x, ids, weights, *projections, **kwargs) -> jax.Array:
        act = kwargs["act"]
        args = (x, ids, weights, *projections)
        too_big = any(a.size >= 2**31 for p in projections for a in _leaves(p).values())
        if too_big or (act[0] if isinstance(act, tuple) else act) not in GEMM_ACTIVATIONS:
            return grouped_expert_mlp_static(*args, **kwargs)
        return grouped_expert_mlp_gemm(*args, interpret=self.interpret, shared_memory=self.shared_memory, **kwargs)


def use_expert_loop(model: nnx.Module, loop: ExpertLoop) -> int:
    """Every MoE layer of `model` runs its experts with `loop`; how many layers."""
    blocks = [m for _, m in nnx.iter_modules(model) if isinstance(m, SparseMoeBlock)]
    for block in blocks:
        block.expert_loop = loop
    return len(blocks)


def use_static_expert_tiles(model: nnx.Module) -> int:
    """Every MoE layer of `model` loops over a fixed count of tiles (a GPU: no traced trip count); how many."""
    return use_expert_loop(model, StaticExpertTiles())


class SparseMoeBlock(nnx.Module):
    """Router `gate`, `experts`, and Qwen2-MoE's `shared_expert` with its sigmoid `shared_expert_gate`."""

    def __init__(self, cfg: ModelConfig, moe: MoeOptions, *, dtype):
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False, dtype=dtype)
        self.gate.keep_float = True  # routing decides which weights run: never quantized (as vLLM's gates)
        self.experts = Experts(moe, cfg.hidden_size, act=cfg.hidden_act, dtype=dtype)
        if moe.shared_expert_size:
            shared = dataclasses.replace(cfg, intermediate_size=moe.shared_expert_size, mlp_bias=False)
            self.shared_expert = GatedMLP(shared, dtype=dtype)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False, dtype=dtype)
            self.shared_expert_gate.keep_float = True
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.expert_loop = ExpertLoop()

    def __call__(self, x: jax.Array, num_valid=None) -> jax.Array:
        """num_valid: the step's real token count (rows past it are bucket padding and go to no expert)."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts_output(x, ids, weights, num_valid)
        if self.shared_expert is not None:
            out = out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def experts_output(self, x, ids, weights, num_valid=None) -> jax.Array:
        """sum_k weights * expert(x); a down_proj bias (GPT-OSS) is added here, once, as sum_k weights * bias[id]
        (inside the loop a device holding part of each expert's features would add it once per device)."""
        ex = self.experts
        projections = tuple(getattr(ex, p).arrays() for p in EXPERT_PROJECTIONS)
        down_bias = projections[2].pop("bias", None)
        out = self._expert_sums(x, ids, weights, projections, num_valid)
        if down_bias is None:
            return out
        bias = jnp.take(down_bias, ids, axis=0).astype(jnp.float32)  # [T, k, D]
        return out + jnp.sum(bias * weights.astype(jnp.float32)[:, :, None], axis=1).astype(out.dtype)

    def _expert_sums(self, x, ids, weights, projections, num_valid) -> jax.Array:
        ex = self.experts
        n = tp_size()
        loop = self.expert_loop
        if n == 1:
            return loop(x, ids, weights, *projections, first_expert=0, act=ex.act, num_valid=num_valid)
        num_experts = projections[0]["kernel"].shape[0]
        ep = expert_parallel(num_experts, n)
        features = projections[0]["kernel"].shape[2]
        if not ep and "mx_scale" in projections[2] and features % (64 * n):  # down's inner rows: whole 64-row blocks
            raise mxfp4_split_error(features, num_experts, n)
        specs = tuple(
            {leaf: expert_partition_spec(p, leaf, a.shape, n) for leaf, a in arrays.items()}
            for p, arrays in zip(EXPERT_PROJECTIONS, projections)
        )

        valid = jnp.asarray(ids.shape[0] if num_valid is None else num_valid, jnp.int32)

        def local(x, ids, weights, valid, gate, up, down):
            first = jax.lax.axis_index(TP_AXIS) * gate["kernel"].shape[0] if ep else 0
            y = loop(x, ids, weights, gate, up, down, first_expert=first, act=ex.act, num_valid=valid)
            return jax.lax.psum(y, TP_AXIS)

        mapped = jax.shard_map(local, in_specs=(P(), P(), P(), P(), *specs), out_specs=P(), check_vma=False)
        return mapped(x, ids, weights, valid, *projections)


# -- checkpoint spellings ------------------------------------------------------------------------

_PER_EXPERT = re.compile(r"^(?P<layer>.*\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED = re.compile(r"^(?P<layer>.*\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def expert_kernel_name(layer: str, projection: str) -> str:
    """The name weight_specs gives a stacked expert kernel ([E, in, out], our layout)."""
    return f"{layer}.mlp.experts.{projection}.kernel"


def moe_mlp_specs(moe: MoeOptions | None, layer: int, hf: str, ours: str) -> dict[str, WeightSpec]:
    """Layer `layer`'s MLP tensors (hf, ours: the layer's prefixes) in the Mixtral / Qwen MoE layout: a gated MLP on
    a dense layer (or without `moe`); else the router `gate`, the stacked experts and an optional gated
    `shared_expert`."""
    mlp, mine = f"{hf}.mlp", f"{ours}.mlp"
    if moe is None or layer not in moe.sparse_layers:
        return projection_specs(mlp, mine, bias=False)
    specs = {f"{mlp}.gate.weight": WeightSpec(f"{mine}.gate.kernel", transpose=True)}
    for proj in EXPERT_PROJECTIONS:
        specs[expert_kernel_name(hf, proj)] = WeightSpec(f"{mine}.experts.{proj}.kernel")
    if moe.shared_expert_size:
        specs |= projection_specs(f"{mlp}.shared_expert", f"{mine}.shared_expert", bias=False)
        specs[f"{mlp}.shared_expert_gate.weight"] = WeightSpec(f"{mine}.shared_expert_gate.kernel", transpose=True)
    return specs


def regroup_expert_tensors(
    tensors: Iterable[tuple[str, Any, str]], num_experts: int, missing: Callable[[str, list[str]], None] | None = None,
) -> Iterator[tuple[str, Any, str]]:
    """(name, array, source) with every expert spelling stacked into expert_kernel_name's [E, in, out] tensors, and
    Mixtral's `block_sparse_moe.` read as `mlp.`; the rest passes through. A layer's experts are held on the host only
    until its last one arrives. A stack some experts lack is not yielded: missing(its name, the lacking experts'
    tensors) is told (the loader names them), or without `missing` it is a ValueError."""
    pending: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    spelled: dict[tuple[str, str], tuple[str, str]] = {}  # a stack's experts' names around the expert's number
    for name, array, source in tensors:
        per_expert, fused = _PER_EXPERT.match(name), _FUSED.match(name)
        if (per_expert or fused) and not isinstance(array, np.ndarray) and not hasattr(array, "__array__"):
            raise ValueError(f"tensor {name} in {source} is a pre-quantized expert weight; jaxpaged loads experts from floats only")
        if fused:
            w = np.asarray(array)  # torch layout [E, out, in]
            if fused["proj"] == "down_proj":
                yield expert_kernel_name(fused["layer"], "down_proj"), np.swapaxes(w, 1, 2), source
            else:
                gate, up = np.split(w, 2, axis=1)
                yield expert_kernel_name(fused["layer"], "gate_proj"), np.swapaxes(gate, 1, 2), source
                yield expert_kernel_name(fused["layer"], "up_proj"), np.swapaxes(up, 1, 2), source
            continue
        if per_expert:
            proj = _MIXTRAL_NAMES.get(per_expert["proj"], per_expert["proj"])
            if proj not in EXPERT_PROJECTIONS:
                raise ValueError(f"tensor {name} in {source}: unknown expert projection {per_expert['proj']!r}")
            if int(per_expert["e"]) >= num_experts:  # an expert the config does not have: the loader names it
                yield name, array, source
                continue
            key = (per_expert["layer"], proj)
            experts = pending.setdefault(key, {})
            spelled.setdefault(key, (name[: per_expert.start("e")], name[per_expert.end("e") :]))
            experts[int(per_expert["e"])] = np.asarray(array).T  # [in, out]
            if len(experts) == num_experts:
                del pending[key]
                yield expert_kernel_name(*key), np.stack([experts[i] for i in range(num_experts)]), source
            continue
        yield name.replace(".block_sparse_moe.", ".mlp."), array, source
    lacking = {
        expert_kernel_name(*key): [f"{spelled[key][0]}{e}{spelled[key][1]}" for e in range(num_experts) if e not in got]
        for key, got in pending.items()
    }
    if lacking and missing is None:
        names = [name for names in lacking.values() for name in names]
        raise ValueError(f"checkpoint lacks {len(names)} expert tensor(s) of {num_experts}-expert layers: {shown(names)}")
    for stack, names in lacking.items():
        missing(stack, names)

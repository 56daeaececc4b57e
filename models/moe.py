"""The sparse mixture-of-experts MLP the MoE families share (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE).

Router: logits = x @ gate (float32), softmax, top-k, optionally renormalized (Mixtral always; the others per
`norm_topk_prob`). Experts: E gated MLPs stacked into [E, in, out] kernels. The grouped matmul runs in the jitted
step with fixed shapes: the T*k (token, expert) assignments are sorted by expert and each expert's run is padded to
a whole number of m-row tiles; a while loop over the tiles in use (a traced trip count) multiplies each tile's rows
by its one expert's weights, read by a dynamic index. The tile count is bounded statically (T*k + E*(m-1) rows), so
nothing is dropped and no shape depends on the routing; unused tiles cost nothing and hold zero rows, and the
bucket's padding rows (past the step's real token count) go to no expert. jax.lax.ragged_dot would do the same sums,
but off TPU it expands to a dense product against every expert (E times the work).

Under a "model" mesh of N devices the experts split over it (expert parallelism) when N divides E, else each
expert's intermediate features split (tensor parallelism). Tokens are replicated there, so each device computes
its own share of every token's experts under shard_map and one psum adds the shares; no all-to-all is needed.

Checkpoints store experts one tensor per expert (`experts.N.{gate,up,down}_proj.weight`, Mixtral's
`block_sparse_moe.experts.N.w1/w3/w2.weight`) or fused as transformers 5 holds them in memory
(`experts.gate_up_proj` [E, 2I, D], `experts.down_proj` [E, D, I]); `regroup_expert_tensors` stacks either into the
port's `...mlp.experts.{gate,up,down}_proj.kernel` [E, in, out] before the loader sees them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.layers import GatedMLP, Linear, _param, activation
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
    if projection == "down_proj":  # row-parallel: its input (intermediate) axis splits, its scale is whole
        return P(None, TP_AXIS, None) if leaf == "kernel" else P()
    return P(None, None, TP_AXIS) if leaf == "kernel" else P(None, TP_AXIS)


def check_experts_divisible(cfg: ModelConfig, n: int) -> None:
    moe = MoeOptions.of(cfg)
    if n > 1 and moe.num_experts % n and moe.intermediate_size % n:
        raise ValueError(
            f"tensor_parallel_size={n} divides neither this {cfg.architecture}'s num_experts={moe.num_experts} "
            f"(expert parallelism) nor its moe_intermediate_size={moe.intermediate_size} (tensor parallelism)"
        )


# -- layers ------------------------------------------------------------------------------------


class ExpertLinear(nnx.Module):
    """E stacked kernels [E, in, out]; quantized (`load_quantized`): int8/fp8 kernels with a scale [E, out] per expert
    and output channel, w = kernel * scale, as ChannelLinear holds a dense one."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, dtype):
        self.kernel = _param((num_experts, in_features, out_features), dtype)

    def load_quantized(self, weight: np.ndarray, kind: str) -> None:
        """A float [E, in, out] host array -> per expert, per output channel int8 or fp8 (quantize_channels)."""
        from jaxpaged.models.quantization import quantize_channels

        pairs = [quantize_channels(w, kind) for w in np.asarray(weight, np.float32)]
        self.kernel = nnx.Param(jax.device_put(np.stack([q for q, _ in pairs])))
        self.scale = nnx.Param(jax.device_put(np.stack([s for _, s in pairs])))

    def arrays(self) -> tuple[jax.Array, ...]:
        scale = getattr(self, "scale", None)  # set by load_quantized
        return (self.kernel[...],) if scale is None else (self.kernel[...], scale[...])


class Experts(nnx.Module):
    def __init__(self, moe: MoeOptions, hidden_size: int, *, act: str, dtype):
        e, d, f = moe.num_experts, hidden_size, moe.intermediate_size
        self.gate_proj = ExpertLinear(e, d, f, dtype=dtype)
        self.up_proj = ExpertLinear(e, d, f, dtype=dtype)
        self.down_proj = ExpertLinear(e, f, d, dtype=dtype)
        self.act = act


def route(logits: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32), as transformers' TopKRouter."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def tile_rows(assignments: int, num_experts: int) -> int:
    """Rows per tile: about assignments / experts (a power of two, 1 to 128), so tiles stay few and little padded."""
    per_expert = -(-assignments // num_experts)
    return min(128, 1 << max(0, per_expert - 1).bit_length())


def _expert_matmul(x: jax.Array, weights: tuple[jax.Array, ...], expert: jax.Array) -> jax.Array:
    """x [m, in] times one expert's kernel [in, out] (times its scale when quantized) -> [m, out] f32. Only that
    expert's kernel is read (a dynamic index), never a copy per tile."""
    kernel = jax.lax.dynamic_index_in_dim(weights[0], expert, keepdims=False)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = jnp.dot(x, kernel.astype(x.dtype), precision=precision, preferred_element_type=jnp.float32)
    if len(weights) > 1:
        y = y * jax.lax.dynamic_index_in_dim(weights[1], expert, keepdims=False).astype(jnp.float32)[None, :]
    return y


def grouped_expert_mlp(x, ids, weights, gate, up, down, *, first_expert, act: str, num_valid=None) -> jax.Array:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) over the experts held here (ids first_expert.. + E_local);
    assignments to other experts add nothing. gate/up/down: (kernel [E_local, in, out], optional scale [E_local, out]).
    num_valid (traced scalar, optional): rows from it on are the bucket's padding; they are routed nowhere (their
    output is zero) so they create no tiles. Only the tiles in use run (a while loop with a traced trip count), so
    the cost follows the experts actually used, not the static tile bound."""
    t, d = x.shape
    k = ids.shape[1]
    a = t * k
    e = gate[0].shape[0]
    m = tile_rows(a, e)
    num_tiles = -(-(a + min(e, a) * (m - 1)) // m)
    rows = num_tiles * m
    expert = ids.reshape(a) - first_expert
    held = (expert >= 0) & (expert < e)
    if num_valid is not None:
        held = held & (jnp.arange(a, dtype=jnp.int32) // k < num_valid)
    expert = jnp.where(held, expert, e)  # e: held elsewhere (or padding), sorted last, never placed
    order = jnp.argsort(expert, stable=True)
    sorted_expert = expert[order]
    counts = jnp.zeros(e + 1, jnp.int32).at[expert].add(1)[:e]
    tiles = (counts + m - 1) // m
    tile_end = jnp.cumsum(tiles)
    row_start = jnp.append((tile_end - tiles) * m, rows)  # expert e's first row; the sentinel's lands out of range
    count_start = jnp.append(jnp.cumsum(counts) - counts, a)
    rank = jnp.arange(a, dtype=jnp.int32) - count_start[sorted_expert]
    dest = jnp.where(sorted_expert < e, row_start[sorted_expert] + rank, rows)
    row_assignment = jnp.full((rows,), a, jnp.int32).at[dest].set(order.astype(jnp.int32), mode="drop")
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(num_tiles), side="right"), e - 1).astype(jnp.int32)
    xs = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])[row_assignment // k].reshape(num_tiles, m, d)
    fn = activation(act)

    def tile(i, y):
        ex, xi = tile_expert[i], jax.lax.dynamic_index_in_dim(xs, i, keepdims=False)
        h = fn(_expert_matmul(xi, gate, ex)).astype(x.dtype) * _expert_matmul(xi, up, ex).astype(x.dtype)
        return jax.lax.dynamic_update_index_in_dim(y, _expert_matmul(h, down, ex).astype(x.dtype), i, 0)

    # unused tiles keep their zeros: nothing reads their weights; a traced bound makes this a while loop
    y = jax.lax.fori_loop(0, tile_end[-1], tile, jnp.zeros((num_tiles, m, d), x.dtype)).reshape(rows, d)
    # back to (token, slot) order: each assignment's row (the zero row past the end when held elsewhere)
    assignment_row = jnp.full((a,), rows, jnp.int32).at[order].set(dest.astype(jnp.int32))
    y = jnp.concatenate([y, jnp.zeros((1, d), y.dtype)])[assignment_row].reshape(t, k, d)
    return jnp.sum(y * weights.astype(x.dtype)[:, :, None], axis=1)


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

    def __call__(self, x: jax.Array, num_valid=None) -> jax.Array:
        """num_valid: the step's real token count (rows past it are bucket padding and go to no expert)."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts_output(x, ids, weights, num_valid)
        if self.shared_expert is not None:
            out = out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def experts_output(self, x, ids, weights, num_valid=None) -> jax.Array:
        ex = self.experts
        projections = tuple(getattr(ex, p).arrays() for p in EXPERT_PROJECTIONS)
        n = tp_size()
        if n == 1:
            return grouped_expert_mlp(x, ids, weights, *projections, first_expert=0, act=ex.act, num_valid=num_valid)
        num_experts = projections[0][0].shape[0]
        ep = expert_parallel(num_experts, n)
        specs = tuple(
            tuple(expert_partition_spec(p, leaf, a.shape, n) for leaf, a in zip(("kernel", "scale"), arrays))
            for p, arrays in zip(EXPERT_PROJECTIONS, projections)
        )

        valid = jnp.asarray(ids.shape[0] if num_valid is None else num_valid, jnp.int32)

        def local(x, ids, weights, valid, gate, up, down):
            first = jax.lax.axis_index(TP_AXIS) * gate[0].shape[0] if ep else 0
            y = grouped_expert_mlp(x, ids, weights, gate, up, down, first_expert=first, act=ex.act, num_valid=valid)
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


def regroup_expert_tensors(tensors: Iterable[tuple[str, Any, str]], num_experts: int) -> Iterator[tuple[str, Any, str]]:
    """(name, array, source) with every expert spelling stacked into expert_kernel_name's [E, in, out] tensors, and
    Mixtral's `block_sparse_moe.` read as `mlp.`; the rest passes through. A layer's experts are held on the host only
    until its last one arrives."""
    pending: dict[tuple[str, str], dict[int, np.ndarray]] = {}
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
            key = (per_expert["layer"], proj)
            experts = pending.setdefault(key, {})
            experts[int(per_expert["e"])] = np.asarray(array).T  # [in, out]
            if len(experts) == num_experts:
                del pending[key]
                if sorted(experts) != list(range(num_experts)):
                    raise ValueError(f"experts of {key[0]}.{proj} in {source} are numbered {sorted(experts)}, expected 0..{num_experts - 1}")
                yield expert_kernel_name(*key), np.stack([experts[i] for i in range(num_experts)]), source
            continue
        yield name.replace(".block_sparse_moe.", ".mlp."), array, source
    if pending:
        (layer, proj), got = next(iter(pending.items()))
        raise ValueError(f"checkpoint has {len(got)} of {num_experts} experts for {layer}.{proj}")

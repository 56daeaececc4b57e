"""fuse_projections (EngineConfig): each layer's q/k/v projections laid out once, at load, as one Linear, and its
gate/up as one, so a step runs one dot on one contiguous weight for each, as vLLM stores them (QKVParallelLinear,
MergedColumnParallelLinear). Left separate, XLA:GPU merges dots sharing an input by concatenating their weights at
run time, every step (issue 44: on an H200 the merged gate/up GEMM read its weights at 1.3 TB/s, or cuBLAS ran it
fast behind a concatenation kernel of its own).

Only the shared layers (models/layers.py) fuse: an `Attention` or `GatedMLP` whose __call__ is theirs, with plain
`Linear` projections of one method (dense, or quantized per channel or per group: every parameter of theirs has the
output on its last axis, so fusing is concatenating columns, and each output column is computed as before). Anything
else (MoE experts, MLA, ports with their own attention) stays as it is.

Tensor parallelism: the columns are grouped into `units` = tensor_parallel_size blocks, each one device's share:
its q heads, then its k and v heads (a KV head repeated as models/sharding.py's replicate_kv_heads would, where
there are fewer KV heads than devices), or its gate columns, then its up columns. The fused Linears are
column-parallel like the projections they replace, so splitting their last axis N ways gives each device its own.

Traceable: a weight update re-runs it on the new weights inside its program (worker/weight_update.py), which
then needs q, k and v (or gate and up) of a layer given together.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.layers import Attention, DenseLinear, GatedMLP, Linear
from jaxpaged.models.quantization import ChannelLinear, GroupLinear

logger = logging.getLogger("jaxpaged.models")

FUSIBLE_METHODS = (DenseLinear, ChannelLinear, GroupLinear)


def _variables(linear: Linear) -> dict[str, jax.Array]:
    """A Linear's arrays by attribute name (kernel, bias, scale, zero), each with the output on its last axis."""
    return {name: v[...] for name, v in vars(linear).items() if isinstance(v, nnx.Variable)}


def _fusible(linears: list[Linear]) -> bool:
    """Whether these Linears can become one: plain Linears of one method, same arrays, dtypes and inputs."""
    if any(type(m) is not Linear or type(m.method) not in FUSIBLE_METHODS for m in linears):
        return False
    if len({m.method for m in linears}) != 1:
        return False
    arrays = [_variables(m) for m in linears]
    names = set(arrays[0])
    for m, a in zip(linears, arrays):
        if set(a) != names or any(x.shape[-1] != m.out_features for x in a.values()):
            return False
    return all(len({(a[n].dtype, a[n].shape[:-1]) for a in arrays}) == 1 for n in names)


@functools.partial(jax.jit, static_argnames=("units", "heads", "kv_heads"))
def qkv_columns(q: jax.Array, k: jax.Array, v: jax.Array, *, units: int, heads: int, kv_heads: int) -> jax.Array:
    """[..., q], [..., k], [..., v] (heads x head_dim columns each) -> [..., units * (q + 2 k')]: per unit its q
    heads, then its k heads, then its v heads (k' = k repeated to one KV head per unit where there are fewer)."""
    lead = q.shape[:-1]
    factor = max(1, units // kv_heads)

    def per_unit(x, n, repeat):
        x = x.reshape(*lead, n, -1)
        if repeat > 1:
            x = jnp.repeat(x, repeat, axis=-2)
        return x.reshape(*lead, units, -1)

    parts = [per_unit(q, heads, 1), per_unit(k, kv_heads, factor), per_unit(v, kv_heads, factor)]
    return jnp.concatenate(parts, axis=-1).reshape(*lead, -1)


@functools.partial(jax.jit, static_argnames=("units",))
def gate_up_columns(gate: jax.Array, up: jax.Array, *, units: int) -> jax.Array:
    """[..., f] twice -> [..., units * 2 * f / units]: per unit its gate columns, then its up columns."""
    lead = gate.shape[:-1]
    stacked = jnp.stack([gate.reshape(*lead, units, -1), up.reshape(*lead, units, -1)], axis=-2)
    return stacked.reshape(*lead, -1)


def _fused_linear(parts: list[Linear], columns) -> Linear:
    """One Linear whose every array is `columns` of the parts' arrays, with their method."""
    first = parts[0]
    arrays = [_variables(m) for m in parts]
    fused = {name: columns(*(a[name] for a in arrays)) for name in arrays[0]}
    kernel = fused["kernel"]  # its shape, not the layer's (a packed 4-bit kernel's rows are half its inputs)
    linear = Linear(kernel.shape[-2], kernel.shape[-1], bias="bias" in fused, dtype=kernel.dtype)
    for name, value in fused.items():
        setattr(linear, name, nnx.Param(value))
    linear.method = first.method
    return linear


def _fuse_attention(attn: Attention, units: int) -> bool:
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    if any(p is None for p in parts) or not _fusible(parts):
        return False
    heads, head_dim = attn.shape
    kv_heads, rem = divmod(attn.k_proj.out_features, head_dim)
    if rem or attn.q_proj.out_features != heads * head_dim or attn.v_proj.out_features != attn.k_proj.out_features:
        return False
    if heads % units or (kv_heads % units and units % kv_heads):  # sizes tensor parallelism refuses anyway
        return False
    columns = functools.partial(qkv_columns, units=units, heads=heads, kv_heads=kv_heads)
    attn.qkv_proj = _fused_linear(parts, columns)
    per_unit_kv = max(kv_heads, units) // units * head_dim
    attn.qkv_layout = (units, heads // units * head_dim, per_unit_kv)
    attn.q_proj = attn.k_proj = attn.v_proj = None
    return True


def _fuse_mlp(mlp: GatedMLP, units: int) -> bool:
    parts = [mlp.gate_proj, mlp.up_proj]
    if any(p is None for p in parts) or not _fusible(parts) or parts[0].out_features != parts[1].out_features:
        return False
    if parts[0].out_features % units:
        return False
    mlp.gate_up_proj = _fused_linear(parts, functools.partial(gate_up_columns, units=units))
    mlp.gate_up_units = units
    mlp.gate_proj = mlp.up_proj = None
    return True


def _fits(module, cls, fused: str) -> bool:
    """A shared layer (its class's own __call__, which knows the fused form), not fused yet."""
    return isinstance(module, cls) and type(module).__call__ is cls.__call__ and getattr(module, fused) is None


def fuse_projections(model: nnx.Module, tensor_parallel_size: int = 1) -> tuple[int, int]:
    """Fuse, in place, every shared-layer attention's q/k/v and gated MLP's gate/up that fit (module docstring);
    -> (attention blocks fused, MLPs fused). Run before the platform lays the weights out (the CPU packs the fused
    kernels as any other) and before tensor parallelism places them."""
    attentions = mlps = 0
    modules = [m for _, m in nnx.iter_modules(model)]  # listed first: fusing changes the tree being walked
    for module in modules:
        if _fits(module, Attention, "qkv_proj"):
            attentions += _fuse_attention(module, tensor_parallel_size)
        elif _fits(module, GatedMLP, "gate_up_proj"):
            mlps += _fuse_mlp(module, tensor_parallel_size)
    # a weight update re-runs this, traced, on every update: logged at start-up only
    if not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(nnx.state(model))):
        logger.info("fuse_projections: q/k/v fused in %d attention blocks, gate/up in %d MLPs", attentions, mlps)
    return attentions, mlps

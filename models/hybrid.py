"""What the hybrid ports share (Qwen3-Next and Qwen3.5 in models/qwen3_next.py, Nemotron-H in models/nemotron_h.py):
layers of three kinds, and a forward that threads the paged KV and the per-sequence state cache through them.

- "attention" layers keep K/V in the paged cache, at their index among the attention layers (`kv_index`);
- "linear" layers (Gated DeltaNet, Mamba-2) keep a state per sequence in the state cache
  (pallas_kernels/state_cache.py), at their index among the linear layers (`state_index`);
- other layers (Nemotron-H's MLP blocks) keep nothing.

The cache is a HybridCache (the KV array of the attention layers, the state arrays of the linear layers); the
forward returns a StateUpdate (the attention layers' new K/V, the linear layers' new state per row, the rows' state
slots) that write_kv scatters into the donated cache. Every layer's __call__ is
`(x, rope, cache, attn_metadata, rows) -> (x, new K/V or None, new states or None)`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.layers import CausalLM, _param, rope_table
from jaxpaged.pallas_kernels import AttentionMetadata, stack_new_kv
from jaxpaged.pallas_kernels.state_cache import HybridCache, Rows, StateArray, StateSpec, StateUpdate


class ZeroCenteredRMSNorm(nnx.Module):
    """Qwen3-Next's and Qwen3.5's RMSNorm: the scale is stored centred on zero, x_normed * (1 + w), in float32."""

    def __init__(self, features: int, *, eps: float, dtype):
        self.scale = _param((features,), dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return (h * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """RMSNorm of a linear layer's output gated by silu(z). norm_before_gate (Gated DeltaNet): w * norm(x), then
    times silu(z); else (Mamba-2): norm(x * silu(z)) over groups of group_size features, times w."""

    def __init__(self, features: int, *, eps: float, dtype, norm_before_gate: bool = True, group_size: int | None = None):
        self.scale = _param((features,), dtype)
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.group_size = group_size or features

    def _norm(self, h: jax.Array) -> jax.Array:
        groups = h.reshape(*h.shape[:-1], -1, self.group_size)
        groups = groups * jax.lax.rsqrt(jnp.mean(groups * groups, axis=-1, keepdims=True) + self.eps)
        return groups.reshape(h.shape)

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        gate = jax.nn.silu(z.astype(jnp.float32))
        if self.norm_before_gate:
            h = (self.scale[...] * self._norm(x.astype(jnp.float32)).astype(x.dtype)).astype(jnp.float32)
            return (h * gate).astype(x.dtype)
        h = self._norm(x.astype(jnp.float32) * gate)
        return (self.scale[...].astype(jnp.float32) * h).astype(x.dtype)


class CausalConv1d(nnx.Module):
    """A depthwise causal convolution's weights: weight [K, C] (torch's [C, 1, K], transposed at load), bias [C]."""

    def __init__(self, kernel: int, channels: int, *, bias: bool, dtype):
        self.weight = _param((kernel, channels), dtype)
        self.bias = _param((channels,), dtype) if bias else None

    def arrays(self) -> tuple[jax.Array, jax.Array | None]:
        return self.weight[...], None if self.bias is None else self.bias[...]


@dataclasses.dataclass(frozen=True)
class ConcatSplit:
    """A fused checkpoint tensor whose last axis is parts of `sizes` one after another; a 3-D [K, 1, C] convolution
    weight (torch's [C, 1, K] transposed) comes out [K, C_i]."""

    sizes: tuple[int, ...]

    def __call__(self, x):
        if x.ndim == 3:
            x = x.reshape(x.shape[0], x.shape[-1])
        bounds = [0] + [sum(self.sizes[: i + 1]) for i in range(len(self.sizes))]
        return tuple(x[..., a:b] for a, b in zip(bounds, bounds[1:]))


@dataclasses.dataclass(frozen=True)
class GroupedSplit:
    """A fused tensor laid out per group (Qwen3-Next's in_proj_qkvz and in_proj_ba: per key head, its q, k, v, z):
    the last axis is `groups` runs of parts of `sizes`; part i comes out with every group's i-th run in group order."""

    groups: int
    sizes: tuple[int, ...]

    def __call__(self, x):
        y = x.reshape(*x.shape[:-1], self.groups, sum(self.sizes))
        bounds = [0] + [sum(self.sizes[: i + 1]) for i in range(len(self.sizes))]
        return tuple(y[..., a:b].reshape(*x.shape[:-1], self.groups * (b - a)) for a, b in zip(bounds, bounds[1:]))


class HybridCausalLM(CausalLM):
    """embed -> layers of three kinds (module docstring) -> final norm -> head, over a HybridCache."""

    def state_spec(self) -> StateSpec:
        """The state cache this model needs: every linear layer keeps the same arrays."""
        linear = [layer for layer in self.layers if layer.kind == "linear"]
        arrays: tuple[StateArray, ...] = linear[0].state_arrays() if linear else ()
        return StateSpec(len(linear), arrays)

    def rope(self, positions, attn_metadata):
        cfg = self.config
        if cfg.position_embedding != "rope":
            return None
        dim = cfg.rotary_dim or cfg.head_dim
        return self.shared(lambda: rope_table(cfg.rope, positions, dim, attn_metadata), positions)

    def run_layers(self, x, positions, kv_cache: HybridCache, attn_metadata: AttentionMetadata, layers, rope=None):
        """x [T, D] through `layers` -> (x, StateUpdate): the attention layers' K/V, the linear layers' states.
        rope: the step's (cos, sin) where the port computes its own (Qwen3.5's M-RoPE), else the config's."""
        if attn_metadata.state_slots is None:
            raise ValueError(f"a {self.config.architecture} step needs AttentionMetadata.state_slots (its rows' state slots)")
        rope = self.rope(positions, attn_metadata) if rope is None else rope
        rows = Rows.of(attn_metadata.query_start_loc, attn_metadata.seq_lens, attn_metadata.state_slots, x.shape[0])
        new_kv, new_states = [], []
        for layer in layers:
            x, layer_kv, layer_states = layer(x, rope, kv_cache, attn_metadata, rows)
            if layer_kv is not None:
                new_kv.append(layer_kv)
            if layer_states is not None:
                new_states.append(layer_states)
        states = {name: jnp.stack([s[name] for s in new_states]) for name in (new_states[0] if new_states else {})}
        return x, StateUpdate(stack_new_kv(new_kv), states, attn_metadata.state_slots)

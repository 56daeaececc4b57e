"""The per-sequence state cache of hybrid models' linear layers (Gated DeltaNet, Mamba-2), beside the paged KV.

A linear layer keeps no K/V per token; it keeps a fixed-size state per sequence: the last K - 1 inputs of its causal
convolution and a recurrent matrix per head. Each sequence holds a slot in preallocated arrays, one per state kind,
`[linear layers, slots, ...]`; the scheduler's HybridKVCacheManager hands out the slots (jaxpaged/core/state_slots.py)
and each step names every row's slot in `AttentionMetadata.state_slots`.

The step treats the states as it treats K/V: the forward gathers its rows' states from the cache and only reads it
(a row with no context starts from zeros, whatever its slot holds), and returns each row's new state; the runner's
write scatters them into the cache, which it donates, so a decode step updates the states in place. `HybridCache`
(the paged KV and the state arrays) and `StateUpdate` (a step's new K/V and states) travel as one pytree through the
jitted step, the donation and the executable cache, as QuantizedKV does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class StateArray:
    """One kind of state a linear layer keeps per sequence: its shape per slot, dtype and the axis tensor
    parallelism splits (heads or channels; None: replicated)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    split_axis: int | None = None


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """A hybrid model's state cache: `num_layers` linear layers, each with the same `arrays`."""

    num_layers: int
    arrays: tuple[StateArray, ...]

    @property
    def slot_bytes(self) -> int:
        """One sequence's state over every linear layer."""
        return self.num_layers * sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in self.arrays)

    def empty(self, num_slots: int) -> dict[str, jax.Array]:
        return {a.name: jnp.zeros((self.num_layers, num_slots, *a.shape), a.dtype) for a in self.arrays}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache:
    """A hybrid model's cache: the paged KV array of its attention layers (or a QuantizedKV) and its state arrays."""

    kv: Any
    states: dict[str, jax.Array]  # name -> [linear layers, slots, ...]

    @property
    def num_slots(self) -> int:
        return next(iter(self.states.values())).shape[1]

    # the KV array's shape, as the runner and the kernels read it from the cache
    @property
    def shape(self) -> tuple[int, ...]:
        return self.kv.shape


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateUpdate:
    """What a hybrid model's forward returns for the write: the attention layers' new K/V ([T, L_attn, 2, H_kv, D])
    and every linear layer's new state per row ([L_lin, S, ...]), with the rows' slots ([S], out of range: none)."""

    kv: jax.Array
    states: dict[str, jax.Array]
    slots: jax.Array


def write_states(cache: HybridCache, update: StateUpdate, write_kv_fn) -> HybridCache:
    """The step's K/V through write_kv_fn(kv, new_kv) and each row's new state into its slot (padding rows, whose
    slot is out of range, are dropped)."""
    states = {
        name: array.at[:, update.slots].set(update.states[name].astype(array.dtype), mode="drop")
        for name, array in cache.states.items()
    }
    return HybridCache(write_kv_fn(cache.kv, update.kv), states)


def copy_states(cache: HybridCache, src: jax.Array, dst: jax.Array) -> HybridCache:
    """Slot src[i]'s state -> slot dst[i] in every linear layer (a fork: n > 1 samples, beams); pairs whose dst is out
    of range are dropped. Every source is read before any destination is written."""
    states = {name: a.at[:, dst].set(a[:, jnp.clip(src, 0, a.shape[1] - 1)], mode="drop") for name, a in cache.states.items()}
    return HybridCache(cache.kv, states)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
    """A step's ragged rows as the linear layers need them (computed once per forward, inside the trace).

    T tokens (padded), S rows: row r owns tokens [start[r], start[r] + q_len[r]); padded rows have q_len 0. A row's
    initial state is its slot's when it has context (tokens before this step), else zeros."""

    token_row: jax.Array  # [T] the row of each token (padding: clamped, masked by token_valid)
    token_offset: jax.Array  # [T] its index within its row's tokens of this step
    token_valid: jax.Array  # [T] bool
    start: jax.Array  # [S]
    q_len: jax.Array  # [S]
    has_context: jax.Array  # [S] bool
    slots: jax.Array  # [S] state slots (padding: out of range)

    @staticmethod
    def of(query_start_loc: jax.Array, seq_lens: jax.Array, slots: jax.Array, num_tokens: int) -> Rows:
        start = query_start_loc[:-1]
        q_len = query_start_loc[1:] - start
        t = jnp.arange(num_tokens, dtype=query_start_loc.dtype)
        row = jnp.clip(jnp.searchsorted(query_start_loc, t, side="right") - 1, 0, start.shape[0] - 1)
        return Rows(row, t - start[row], t < query_start_loc[-1], start, q_len, seq_lens - q_len > 0, slots)

    def initial(self, array: jax.Array) -> jax.Array:
        """[S, ...] the rows' states from one layer's slot array [slots, ...]: zeros for rows without context."""
        got = jnp.asarray(array)[jnp.clip(self.slots, 0, array.shape[0] - 1)]
        keep = self.has_context.reshape(-1, *(1,) * (got.ndim - 1))
        return jnp.where(keep, got, jnp.zeros((), got.dtype))


def causal_conv(x: jax.Array, weight: jax.Array, bias: jax.Array | None, state: jax.Array, rows: Rows, activation=None):
    """A depthwise causal convolution over each row's tokens, continuing from its state.

    x [T, C], weight [K, C], bias [C] or None, state [S, K - 1, C] (each row's last K - 1 inputs before this step,
    oldest first) -> (y [T, C], the new state [S, K - 1, C]): y[t] = act(sum_k weight[k] * in[t - (K - 1) + k] + bias),
    inputs before the row's first token of this step read from its state. Computed in the weight's dtype, as torch's
    conv1d is, and returned in x's."""
    k = weight.shape[0]
    t = x.shape[0]
    xw = x.astype(weight.dtype)
    stw = state.astype(weight.dtype)
    padded = jnp.concatenate([jnp.zeros((k - 1, x.shape[1]), xw.dtype), xw])
    y = jnp.zeros(x.shape, jnp.float32)
    off = rows.token_offset
    for j in range(k):
        back = k - 1 - j  # this tap reads the input `back` tokens before the output's
        from_x = padded[k - 1 - back : k - 1 - back + t]
        from_state = stw[rows.token_row, jnp.clip(k - 1 - back + off, 0, k - 2)]
        tap = jnp.where((off >= back)[:, None], from_x, from_state)
        y = y + tap.astype(jnp.float32) * weight[j].astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if activation is not None:
        y = activation(y)
    y = y.astype(weight.dtype).astype(x.dtype)
    # the new state: the last K - 1 inputs of (state, this step's tokens)
    o = rows.q_len[:, None] - (k - 1) + jnp.arange(k - 1)[None, :]  # [S, K-1] offsets in this step's tokens
    from_x = xw[jnp.clip(rows.start[:, None] + o, 0, t - 1)]
    from_state = jnp.take_along_axis(stw, jnp.clip(k - 1 + o, 0, k - 2)[:, :, None], axis=1)
    new_state = jnp.where((o >= 0)[:, :, None], from_x, from_state)
    return y, new_state.astype(state.dtype)

"""How a linear layer's recurrence runs over a step's ragged rows, in fixed shapes: the driver both kernels share
(the gated delta rule, gated_delta.py; Mamba-2's SSD, ssd.py).

Rows with one token this step (decode) take one step of the recurrence together, vectorized over the rows. Rows with
more (prefill chunks) are cut into chunks of C tokens aligned to their first token; a loop runs the chunks in order,
each through the kernel's chunked form (its intra-chunk matrices, then the state carried to the next chunk), its
state carried in a per-row array. The chunk list is computed on the device from query_start_loc: at most
ceil(T / C) + S chunks, a static bound; the loop's trip count is the number of live chunks, so a decode step runs
none and no shape depends on the mix.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from jaxpaged.pallas_kernels.attention import TP_AXIS, tp_size
from jaxpaged.pallas_kernels.state_cache import Rows


def chunk_list(rows: Rows, num_tokens: int, chunk: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(row [NC], first token [NC], length [NC], live count) of the prefill rows' chunks, in token order."""
    s = rows.q_len.shape[0]
    n = jnp.where(rows.q_len >= 2, -(-rows.q_len // chunk), 0)
    ends = jnp.cumsum(n)
    bound = -(-num_tokens // chunk) + s
    c = jnp.arange(bound, dtype=ends.dtype)
    row = jnp.minimum(jnp.searchsorted(ends, c, side="right"), s - 1)
    j = c - (ends[row] - n[row])
    start = rows.start[row] + j * chunk
    length = jnp.clip(rows.q_len[row] - j * chunk, 0, chunk)
    return row, start, length, ends[-1]


def run_rows(
    chunk_fn: Callable, step_fn: Callable, tokens: tuple[jax.Array, ...], init, rows: Rows, *, chunk: int,
) -> tuple[tuple[jax.Array, ...], object]:  # fmt: skip
    """Run a recurrence over every row: -> (outputs per token, each [T, ...] float32; the rows' final states).

    tokens: per-token inputs, each [T, ...]. init: the rows' initial states, a pytree of [S, ...] arrays.
    chunk_fn(tokens_c, state) -> (outputs_c, state): one chunk of C tokens of one row (positions past its length
    zeroed), state a pytree of that row's arrays. step_fn(tokens_r, states) -> (outputs_r, states): one token of every
    row at once ([S, ...] each)."""
    t = tokens[0].shape[0]
    pad = lambda x: jnp.concatenate([x, jnp.zeros((chunk, *x.shape[1:]), x.dtype)])  # noqa: E731 (a chunk may overrun T)
    padded = tuple(pad(x) for x in tokens)
    row, start, length, live = chunk_list(rows, t, chunk)

    def first_outputs():  # the outputs' shapes and dtypes, from the step function
        probe = tuple(x[rows.start] for x in tokens)
        return jax.eval_shape(step_fn, probe, init)[0]

    outs = tuple(jnp.zeros((t + chunk, *o.shape[1:]), o.dtype) for o in first_outputs())

    def body(c, carry):
        outs, states = carry
        r, at, n = row[c], start[c], length[c]
        valid = jnp.arange(chunk) < n
        xs = tuple(
            jnp.where(valid.reshape(-1, *(1,) * (x.ndim - 1)), jax.lax.dynamic_slice_in_dim(x, at, chunk), 0) for x in padded
        )
        state = jax.tree.map(lambda s: jax.lax.dynamic_index_in_dim(s, r, keepdims=False), states)
        ys, state = chunk_fn(xs, state)
        outs = tuple(
            jax.lax.dynamic_update_slice_in_dim(
                o, jnp.where(valid.reshape(-1, *(1,) * (y.ndim - 1)), y.astype(o.dtype), jax.lax.dynamic_slice_in_dim(o, at, chunk)),
                at, 0,
            )
            for o, y in zip(outs, ys)
        )  # fmt: skip
        states = jax.tree.map(lambda s, new: jax.lax.dynamic_update_index_in_dim(s, new.astype(s.dtype), r, 0), states, state)
        return outs, states

    outs, states = jax.lax.fori_loop(0, live, body, (outs, init))
    # decode rows: one step each, all at once, from their initial states
    decode = rows.q_len == 1
    ys, stepped = step_fn(tuple(x[jnp.minimum(rows.start, t - 1)] for x in tokens), init)
    where = jnp.where(decode, rows.start, t + chunk)  # other rows' outputs dropped
    outs = tuple(o.at[where].set(y.astype(o.dtype), mode="drop")[:t] for o, y in zip(outs, ys))
    states = jax.tree.map(lambda s, new: jnp.where(decode.reshape(-1, *(1,) * (s.ndim - 1)), new.astype(s.dtype), s), states, stepped)
    return outs, states


def per_device_heads(fn: Callable, args: tuple, head_axes: tuple[int | None, ...]):
    """fn(*args), under a tensor-parallel mesh run per device on its own heads (shard_map): each arg is split on its
    head axis (None: whole, e.g. Rows), every output on axis 1 ([T, H, ...] or [S, H, ...]). Heads never meet in the
    recurrence, so no communication; GSPMD left to itself would partition the chunk loop's dynamic slices poorly."""
    if tp_size() == 1:
        return fn(*args)

    def spec(arg, axis):
        return P() if axis is None else P(*(TP_AXIS if i == axis else None for i in range(jnp.ndim(arg))))

    outs = jax.eval_shape(fn, *args)
    out_specs = jax.tree.map(lambda o: P(None, TP_AXIS, *(None,) * (o.ndim - 2)), outs)
    in_specs = tuple(spec(a, ax) for a, ax in zip(args, head_axes))
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

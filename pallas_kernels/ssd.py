"""Mamba-2's state space duality (SSD) scan over a step's ragged rows, in pure JAX.

Per head, with state h [P, N] (head dim x state size), for each token: h <- exp(dt A) h + dt x B^T; y = h C + D x.
Prefill chunks use the chunked form (as transformers' torch path and mamba_ssm's chunk scan): within a chunk the
outputs are a masked (C B^T)-weighted sum of the chunk's inputs plus the decayed read of the incoming state, then the
state carries to the next chunk. Decode rows take the one-step update. Both in float32; the caller has already applied
softplus, the bias and the limits to dt and repeated the groups' B and C to the heads. D x is the caller's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.pallas_kernels.linear_scan import per_device_heads, run_rows
from jaxpaged.pallas_kernels.state_cache import Rows

CHUNK = 64
_HI = jax.lax.Precision.HIGHEST


def chunk_step(x, dt, b, c, a_log_decay, state):
    """One chunk of one sequence: x [C, H, P], dt [C, H], b, c [C, H, N], a_log_decay [H] (A, negative), state
    [H, P, N] -> (y [C, H, P] without D x, the state after the chunk). Positions past the end must be zeros."""
    n = x.shape[0]
    acs = jnp.cumsum((dt * a_log_decay[None, :]).T, axis=-1)  # [H, C]
    lower = jnp.tril(jnp.ones((n, n), bool))
    decay = jnp.exp(jnp.where(lower, acs[:, :, None] - acs[:, None, :], -jnp.inf))  # [H, C, C]
    xdt = x * dt[..., None]
    scores = jnp.einsum("ihn,jhn->hij", c, b, precision=_HI) * decay
    y = jnp.einsum("hij,jhp->ihp", scores, xdt, precision=_HI)
    y = y + jnp.einsum("ihn,hpn->ihp", c, state, precision=_HI) * jnp.exp(acs).T[..., None]
    last = acs[:, -1:]
    state = state * jnp.exp(last)[..., None] + jnp.einsum("jhn,hj,jhp->hpn", b, jnp.exp(last - acs), xdt, precision=_HI)
    return y, state


def one_step(x, dt, b, c, a_log_decay, state):
    """One token of every row: x [S, H, P], dt [S, H], b, c [S, H, N], state [S, H, P, N] -> (y [S, H, P], state)."""
    state = state * jnp.exp(dt * a_log_decay[None, :])[..., None, None] + (x * dt[..., None])[..., None] * b[:, :, None, :]
    return jnp.einsum("shpn,shn->shp", state, c, precision=_HI), state


def ssd_scan(x, dt, b, c, a_log_decay, initial, rows: Rows, *, chunk: int = CHUNK):
    """A step's tokens through the SSD recurrence: x [T, H, P], dt [T, H], b, c [T, H, N], a_log_decay [H] (A),
    initial [S, H, P, N] -> (y [T, H, P] float32 without D x, final states [S, H, P, N] float32)."""
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731

    def run(x, dt, b, c, a, initial, rows):
        def chunk_fn(xs, state):
            y, state = chunk_step(*xs, a, state)
            return (y,), state

        def step_fn(xs, states):
            y, states = one_step(*xs, a, states)
            return (y,), states

        (y,), final = run_rows(chunk_fn, step_fn, (x, dt, b, c), initial, rows, chunk=chunk)
        return y, final

    args = (*(f32(v) for v in (x, dt, b, c)), f32(a_log_decay), f32(initial), rows)
    return per_device_heads(run, args, (1, 1, 1, 1, 0, 1, None))

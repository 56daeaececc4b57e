"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) over a step's ragged rows, in pure JAX.

Per head, with state S [d_k, d_v], for each token: S <- exp(g) S; S <- S + k (beta (v - k^T S))^T; o = S^T q.
Prefill chunks use the chunked form (the DeltaNet paper's UT transform, as transformers' torch_chunk_gated_delta_rule
and FLA's kernels compute it): within a chunk the delta updates become one unit-triangular inverse and a few matmuls,
then the state carries to the next chunk. Decode rows take the one-step update. Both in float32; the caller has already
L2-normalized q and k, scaled q by d_k^-1/2 and repeated the key heads to the value heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.pallas_kernels.linear_scan import per_device_heads, run_rows
from jaxpaged.pallas_kernels.state_cache import Rows

CHUNK = 64  # transformers' and FLA's chunk size
_HI = jax.lax.Precision.HIGHEST


def _mm(a, b):
    return jnp.matmul(a, b, precision=_HI)


def unit_lower_inverse(a):
    """(I + a)^-1 for strictly lower-triangular a [..., C, C]: a is nilpotent, so the inverse is the finite series
    I - a + a^2 - ..., which (I - a)(I + a^2)(I + a^4)... gives in 2 log2(C) matmuls. Not lax.linalg.triangular_solve:
    on the CPU that is a LAPACK call whose function pointers jaxlib fills in while lowering it, so an executable loaded
    from disk (worker/executable_cache.py) by a process that never lowered one crashed calling it."""
    n = a.shape[-1]
    eye = jnp.eye(n, dtype=a.dtype)
    inverse, power, covered = eye - a, a, 2
    while covered < n:
        power = _mm(power, power)
        inverse = _mm(inverse, eye + power)
        covered *= 2
    return inverse


def chunk_step(q, k, v, g, beta, state):
    """One chunk of one sequence: q, k [C, H, dk], v [C, H, dv], g, beta [C, H], state [H, dk, dv] -> (o [C, H, dv],
    the state after the chunk). Positions past the chunk's end must be zeros (then they change nothing)."""
    c = q.shape[0]
    q, k, v = (x.transpose(1, 0, 2) for x in (q, k, v))  # [H, C, d]
    g, beta = g.T, beta.T  # [H, C]
    gc = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.exp(jnp.where(lower, gc[:, :, None] - gc[:, None, :], -jnp.inf))  # [H, C, C], exp(gc_i - gc_j), i >= j
    kb = k * beta[..., None]
    a = _mm(kb, k.swapaxes(1, 2)) * decay
    rhs = jnp.concatenate([v * beta[..., None], kb * jnp.exp(gc)[..., None]], axis=-1)
    solved = _mm(unit_lower_inverse(jnp.where(jnp.tril(lower, -1), a, 0.0)), rhs)
    u, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
    v_new = u - _mm(w, state)  # what the state does not already predict
    o = _mm(q * jnp.exp(gc)[..., None], state) + _mm(_mm(q, k.swapaxes(1, 2)) * decay, v_new)
    last = gc[:, -1:]
    state = state * jnp.exp(last)[..., None] + _mm((k * jnp.exp(last - gc)[..., None]).swapaxes(1, 2), v_new)
    return o.transpose(1, 0, 2), state


def one_step(q, k, v, g, beta, state):
    """One token of every row: q, k [S, H, dk], v [S, H, dv], g, beta [S, H], state [S, H, dk, dv] -> (o [S, H, dv],
    state)."""
    state = state * jnp.exp(g)[..., None, None]
    predicted = jnp.einsum("shkv,shk->shv", state, k, precision=_HI)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("shkv,shk->shv", state, q, precision=_HI), state


def gated_delta_rule(q, k, v, g, beta, initial, rows: Rows, *, chunk: int = CHUNK):
    """A step's tokens through the gated delta rule: q, k [T, H, dk], v [T, H, dv], g (log decay), beta [T, H],
    initial [S, H, dk, dv] (each row's state) -> (o [T, H, dv] float32, final states [S, H, dk, dv] float32). Under a
    tensor-parallel mesh each device runs its own heads."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    tokens = tuple(f32(x) for x in (q, k, v, g, beta))

    def chunk_fn(xs, state):
        o, state = chunk_step(*xs, state)
        return (o,), state

    def step_fn(xs, states):
        o, states = one_step(*xs, states)
        return (o,), states

    def run(q, k, v, g, beta, initial, rows):
        (o,), final = run_rows(chunk_fn, step_fn, (q, k, v, g, beta), initial, rows, chunk=chunk)
        return o, final

    return per_device_heads(run, (*tokens, f32(initial), rows), (1, 1, 1, 1, 1, 1, None))

"""The definitions the linear-layer kernels are checked against: one sequence, one token at a time, in float64 numpy
(tests only). gated_delta.py and ssd.py compute the same in chunks and over ragged rows."""

from __future__ import annotations

import numpy as np


def naive_gated_delta(q, k, v, g, beta, state):
    """q, k [L, H, dk], v [L, H, dv], g, beta [L, H], state [H, dk, dv] -> (o [L, H, dv], final state)."""
    state = np.array(state, np.float64)
    out = np.zeros((q.shape[0], v.shape[1], v.shape[2]))
    for t in range(q.shape[0]):
        state = state * np.exp(g[t])[:, None, None]
        predicted = np.einsum("hkv,hk->hv", state, k[t])
        delta = (v[t] - predicted) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", state, q[t])
    return out, state


def naive_ssd(x, dt, b, c, a, state):
    """x [L, H, P], dt [L, H], b, c [L, H, N], a [H], state [H, P, N] -> (y [L, H, P] without D x, final state)."""
    state = np.array(state, np.float64)
    out = np.zeros(x.shape)
    for t in range(x.shape[0]):
        state = state * np.exp(dt[t] * a)[:, None, None] + (x[t] * dt[t][:, None])[:, :, None] * b[t][:, None, :]
        out[t] = np.einsum("hpn,hn->hp", state, c[t])
    return out, state


def naive_causal_conv(x, weight, bias, state):
    """x [L, C], weight [K, C], bias [C] or None, state [K - 1, C] -> (pre-activation y [L, C], the last K - 1 inputs)."""
    full = np.concatenate([np.asarray(state, np.float64), np.asarray(x, np.float64)])
    k = weight.shape[0]
    y = np.stack([(full[t : t + k] * weight).sum(0) for t in range(x.shape[0])])
    if bias is not None:
        y = y + bias
    return y, full[-(k - 1) :]

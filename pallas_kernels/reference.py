"""Pure-JAX paged attention: the definition every kernel is checked against, and the CPU default.

Each flattened token finds its sequence from query_start_loc, its absolute position from
seq_lens, and gathers that sequence's context through its block-table row. Memory is
O(T * W * block_size * head_dim) per layer, fine for decode (T == S) and bucketed prefill.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.metadata import AttentionMetadata


def token_layout(md: AttentionMetadata, num_tokens: int):
    """Per flattened row: its sequence slot, absolute position, and whether it is a real token."""
    num_seqs = md.block_tables.shape[0]
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(md.query_start_loc[1:], rows, side="right").astype(jnp.int32)
    valid = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    pos = md.seq_lens[seq] - (md.query_start_loc[seq + 1] - rows)
    return seq, jnp.where(valid, pos, 0), valid


def reference_paged_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    layer: int,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """q: [T, H, D] -> [T, H, D]; causal attention over each token's paged context."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    width = md.block_tables.shape[1]
    ctx = width * block_size

    seq, pos, valid = token_layout(md, num_tokens)
    tables = md.block_tables[seq]  # [T, W]
    k = kv_cache[layer, 0][:, tables].reshape(num_kv_heads, num_tokens, ctx, head_dim)
    v = kv_cache[layer, 1][:, tables].reshape(num_kv_heads, num_tokens, ctx, head_dim)

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    scores = jnp.einsum(
        "tkgd,ktcd->tkgc", qg, k, preferred_element_type=jnp.float32, precision=precision
    ) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)

    c = jnp.arange(ctx, dtype=jnp.int32)[None, :]
    mask = (c <= pos[:, None]) & valid[:, None]
    if sliding_window is not None:
        mask &= c > pos[:, None] - sliding_window
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)

    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    probs = jnp.exp(scores - peak)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom == 0.0, 1.0, denom)
    out = jnp.einsum(
        "tkgc,ktcd->tkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision
    )
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)

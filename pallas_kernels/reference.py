"""Pure-JAX paged attention: the fallback where no kernel runs, and the definition every kernel is checked against.

`naive_paged_attention` is the definition: each flattened token gathers its sequence's whole
context through the block table and attends with a causal mask. It materialises
T x W x block_size x head_dim per layer, so it is for tests only.

`reference_paged_attention` computes the same thing the way a kernel would: an online softmax
over chunks of block-table columns, with a trip count of the longest live context, so padded
table width costs nothing and nothing larger than one chunk is materialised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxpaged.pallas_kernels.kv_quant import QuantizedKV, dequantize_kv
from jaxpaged.pallas_kernels.metadata import AttentionMetadata, AttentionSpec

CHUNK_TOKENS = 128  # context positions per loop iteration


def token_layout(attn_metadata: AttentionMetadata, num_tokens: int):
    """Per flattened row: its sequence slot, absolute position, and whether it is a real token."""
    num_seqs = attn_metadata.block_tables.shape[0]
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(attn_metadata.query_start_loc[1:], rows, side="right").astype(jnp.int32)
    valid = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    pos = attn_metadata.seq_lens[seq] - (attn_metadata.query_start_loc[seq + 1] - rows)
    return seq, jnp.where(valid, pos, 0), valid


def key_limits(attn_metadata: AttentionMetadata, pos: jax.Array) -> jax.Array:
    """[T] the last position each row may see: its own (causal), or past it where key_ends says so (an image's
    tokens attending to each other both ways, Gemma 3)."""
    return pos if attn_metadata.key_ends is None else jnp.maximum(pos, attn_metadata.key_ends)


def local_mask(mask, key_pos, query_pos, spec: AttentionSpec):
    """mask [rows, keys] less the keys outside each row's sliding window or its chunk (chunked local attention)."""
    if spec.sliding_window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - spec.sliding_window
    if spec.chunk_size is not None:
        mask &= key_pos[None, :] >= query_pos[:, None] // spec.chunk_size * spec.chunk_size
    return mask


def _mask(ctx_pos, pos, valid, spec: AttentionSpec, limit=None):
    """[T, C] which context positions each token may see (up to `limit`, default its own position)."""
    mask = (ctx_pos[None, :] <= (pos if limit is None else limit)[:, None]) & valid[:, None]
    return local_mask(mask, ctx_pos, pos, spec)


def cached_blocks(kv_cache, layer: int, kv: int, blocks: jax.Array, dtype) -> jax.Array:
    """K (kv=0) or V (kv=1) blocks of one layer, as `dtype`: a uint16 cache holds 16-bit floats' bits
    (see kv_storage_dtype), reinterpreted here on the gathered blocks only; a QuantizedKV's gathered blocks are
    dequantized."""
    if isinstance(kv_cache, QuantizedKV):
        return dequantize_kv(kv_cache.data[layer, kv][blocks], kv_cache.scale[layer, kv][blocks], dtype, kv_cache.kind)
    gathered = kv_cache[layer, kv][blocks]
    return jax.lax.bitcast_convert_type(gathered, dtype) if gathered.dtype == jnp.uint16 else gathered


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def alibi_bias(slopes: jax.Array, key_pos: jax.Array, query_pos: jax.Array, num_kv_heads: int) -> jax.Array:
    """ALiBi: slope * (key_pos - query_pos), [T, H_kv, G, K] for slopes [H], key_pos [K], query_pos [T].

    BLOOM adds slope * key_pos and MPT slope * (key_pos - last_pos); under softmax a per-row constant
    does not matter, so all of them equal this relative form.
    """
    group = slopes.shape[0] // num_kv_heads
    rel = key_pos[None, :] - query_pos[:, None]
    return slopes.astype(jnp.float32).reshape(1, num_kv_heads, group, 1) * rel[:, None, None, :].astype(jnp.float32)


def naive_paged_attention(q, kv_cache, layer: int, attn_metadata: AttentionMetadata, spec: AttentionSpec, alibi_slopes=None,
                          sinks=None):  # fmt: skip
    """The definition: q [T, H, D] -> [T, H, D], causal attention over each token's paged context (this step's K/V
    already written); alibi_slopes [H] float32 adds slope * (key_pos - query_pos) to each score; sinks [H] float32
    (GPT-OSS's learned attention sinks) join each head's softmax denominator as exp(sink - max), with no value."""
    scale, soft_cap = spec.scale, spec.soft_cap
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    ctx = attn_metadata.block_tables.shape[1] * block_size

    seq, pos, valid = token_layout(attn_metadata, num_tokens)
    tables = attn_metadata.block_tables[seq]  # [T, W]
    # [T, W, H_kv, bs, D] -> [H_kv, T, W * bs, D]
    k = cached_blocks(kv_cache, layer, 0, tables, q.dtype).transpose(2, 0, 1, 3, 4).reshape(num_kv_heads, num_tokens, ctx, head_dim)
    v = cached_blocks(kv_cache, layer, 1, tables, q.dtype).transpose(2, 0, 1, 3, 4).reshape(num_kv_heads, num_tokens, ctx, head_dim)

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    prec = _precision(q.dtype)
    scores = jnp.einsum("tkgd,ktcd->tkgc", qg, k, preferred_element_type=jnp.float32, precision=prec) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    ctx_pos = jnp.arange(ctx, dtype=jnp.int32)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, ctx_pos, pos, num_kv_heads)
    mask = _mask(ctx_pos, pos, valid, spec, key_limits(attn_metadata, pos))
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)

    peak = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, 1)
        peak = jnp.maximum(peak, sink)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    probs = jnp.exp(scores - peak)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.where(valid[:, None, None, None], jnp.exp(sink - peak), 0.0)
    probs = probs / jnp.where(denom == 0.0, 1.0, denom)
    out = jnp.einsum("tkgc,ktcd->tkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=prec)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def reference_paged_attention(q, k, v, kv_cache, layer: int, attn_metadata: AttentionMetadata, spec: AttentionSpec,
                              alibi_slopes=None, sinks=None, *, batch_invariant: bool = False) -> jax.Array:  # fmt: skip
    """naive_paged_attention's result, with this step's K/V (k, v: [T, H_kv, D]) not yet in the cache.

    Keys come from two places: this step's own tokens, taken from k/v directly (a [T, T] mask keeps
    each token to its own sequence, causally), and positions cached before this step, read a chunk
    of blocks at a time with an online softmax. The cached part runs as two loops, rows [0, S) and
    [S, T) (S = sequence slots), each with the trip count of its own longest cached context: the
    engine packs decode tokens first, so the fresh-prompt rows of a mixed step, which have nothing
    cached, do not pay for the decode rows' long contexts.
    """
    if batch_invariant:
        return batch_invariant_attention(q, k, v, kv_cache, layer, attn_metadata, spec, alibi_slopes, sinks)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    cols = max(1, CHUNK_TOKENS // block_size)  # block-table columns per iteration
    chunk = cols * block_size
    width = attn_metadata.block_tables.shape[1]
    prec = _precision(q.dtype)
    kw = {"spec": spec, "alibi_slopes": alibi_slopes, "num_kv_heads": num_kv_heads, "prec": prec}

    seq, pos, valid = token_layout(attn_metadata, num_tokens)
    q_lens = attn_metadata.query_start_loc[seq + 1] - attn_metadata.query_start_loc[seq]
    cached = jnp.where(valid, attn_metadata.seq_lens[seq] - q_lens, 0)  # positions this token reads from the cache
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    carry = fresh_token_softmax(q, k, v, attn_metadata, spec, alibi_slopes, sinks)

    tables = jnp.pad(attn_metadata.block_tables, ((0, 0), (0, -(-width // cols) * cols - width)))[seq]  # [T, W']

    def cached_part(rows: slice, carry):
        q_rows, tables_rows, cached_rows, pos_rows = qg[rows], tables[rows], cached[rows], pos[rows]
        n = q_rows.shape[0]

        def body(i, carry):
            blocks = jax.lax.dynamic_slice_in_dim(tables_rows, i * cols, cols, axis=1)  # [n, cols]
            # Whole blocks, [n, cols, H_kv, bs, D], used as gathered: transposing to [n, H_kv, cols * bs, D]
            # first costs a copy.
            kc = cached_blocks(kv_cache, layer, 0, blocks, q.dtype)
            vc = cached_blocks(kv_cache, layer, 1, blocks, q.dtype)
            ctx_pos = i * chunk + jnp.arange(chunk, dtype=jnp.int32)
            mask = local_mask(ctx_pos[None, :] < cached_rows[:, None], ctx_pos, pos_rows, spec)
            s = _scores("tkgd,tckbd->tkgcb", q_rows, kc, None, ctx_pos, pos_rows, **kw).reshape(n, num_kv_heads, group, chunk)
            s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
            return _fold(carry, s.reshape(n, num_kv_heads, group, cols, block_size), "tkgcb,tckbd->tkgd", vc, prec)

        trips = (jnp.max(cached_rows) + chunk - 1) // chunk
        return jax.lax.fori_loop(0, trips, body, carry)

    split = min(attn_metadata.block_tables.shape[0], num_tokens)
    groups = [slice(0, split)] + ([slice(split, num_tokens)] if split < num_tokens else [])
    parts = [cached_part(rows, tuple(c[rows] for c in carry)) for rows in groups]
    return normalized(tuple(jnp.concatenate(xs) for xs in zip(*parts)), q.dtype)


def _scores(equation, q_rows, keys, mask, key_pos, query_pos, *, spec, alibi_slopes, num_kv_heads, prec):
    s = jnp.einsum(equation, q_rows, keys, preferred_element_type=jnp.float32, precision=prec) * spec.scale
    if spec.soft_cap is not None:
        s = spec.soft_cap * jnp.tanh(s / spec.soft_cap)
    if alibi_slopes is not None:
        bias = alibi_bias(alibi_slopes, key_pos, query_pos, num_kv_heads)
        s = s + bias.reshape(bias.shape[:3] + s.shape[3:])
    return s if mask is None else jnp.where(mask[:, None, None, :], s, -jnp.inf)


def _fold(carry, s, equation, values, prec):
    """Online softmax: fold scores s [n, H_kv, G, keys...] over `values` into (peak, denom, acc)."""
    peak, denom, acc = carry
    key_axes = tuple(range(3, s.ndim))
    new_peak = jnp.maximum(peak, jnp.max(s, axis=key_axes))
    safe = jnp.where(jnp.isfinite(new_peak), new_peak, 0.0)
    p = jnp.exp(s - safe.reshape(safe.shape + (1,) * len(key_axes)))
    correction = jnp.exp(peak - safe)
    pv = jnp.einsum(equation, p.astype(values.dtype), values, preferred_element_type=jnp.float32, precision=prec)
    return new_peak, denom * correction + jnp.sum(p, axis=key_axes), acc * correction[..., None] + pv


def _empty_softmax(num_tokens: int, num_kv_heads: int, group: int, head_dim: int, sinks=None, valid=None):
    """(peak, denom, acc) of rows that have seen no key yet; with sinks [H], each valid row starts as having seen one
    key of score `sink` and value 0 (so the sink joins the denominator only)."""
    if sinks is not None:
        peak = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, num_kv_heads, group), (num_tokens, num_kv_heads, group))
        live = valid[:, None, None]
        return (
            jnp.where(live, peak, -jnp.inf),
            jnp.where(live, 1.0, 0.0) * jnp.ones((num_tokens, num_kv_heads, group), jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
        )
    return (
        jnp.full((num_tokens, num_kv_heads, group), -jnp.inf, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )


def fresh_token_softmax(q, k, v, attn_metadata: AttentionMetadata, spec: AttentionSpec, alibi_slopes=None, sinks=None):
    """The partial softmax (peak, denom, acc), [T, H_kv, G] and [T, H_kv, G, D] float32, of each row over
    this step's own keys (and its head's sink): same sequence, not in the future; one [T, T] product."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    prec = _precision(q.dtype)
    seq, pos, valid = token_layout(attn_metadata, num_tokens)
    init = _empty_softmax(num_tokens, num_kv_heads, group, head_dim, sinks, valid)
    limit = key_limits(attn_metadata, pos)
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= limit[:, None]) & valid[:, None] & valid[None, :]
    mask = local_mask(mask, pos, pos, spec)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    kw = {"spec": spec, "alibi_slopes": alibi_slopes, "num_kv_heads": num_kv_heads, "prec": prec}
    return _fold(init, _scores("tkgd,ukd->tkgu", qg, k, mask, pos, pos, **kw), "tkgu,ukd->tkgd", v, prec)


def normalized(carry, dtype) -> jax.Array:
    """(peak, denom, acc) -> attention output [T, H, D]; rows that saw nothing are 0."""
    _, denom, acc = carry
    out = acc / jnp.where(denom == 0.0, 1.0, denom)[..., None]
    return out.reshape(out.shape[0], -1, out.shape[-1]).astype(dtype)


def batch_invariant_attention(q, k, v, kv_cache, layer: int, attn_metadata: AttentionMetadata, spec: AttentionSpec,
                              alibi_slopes=None, sinks=None) -> jax.Array:  # fmt: skip
    """reference_paged_attention's result, with every row's arithmetic fixed by its own context alone.

    The fast path folds this step's keys in first and the cached ones after, so a key's place in a
    row's sums depends on how the prompt was cut into chunks, which depends on the rest of the batch.
    Here one loop walks absolute positions [iC, (i + 1)C) of each row's context, taking each position
    from the cache or, if it is one of this step's tokens, from k/v: the same folds in the same order
    whatever the batch. Costs a gather of the whole chunk per row; used by LLM(batch_invariant=True).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    cols = max(1, CHUNK_TOKENS // block_size)
    chunk = cols * block_size
    width = attn_metadata.block_tables.shape[1]
    prec = _precision(q.dtype)

    seq, pos, valid = token_layout(attn_metadata, num_tokens)
    q_start = attn_metadata.query_start_loc[seq]
    cached = attn_metadata.seq_lens[seq] - (attn_metadata.query_start_loc[seq + 1] - q_start)  # positions before this step's tokens
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    tables = jnp.pad(attn_metadata.block_tables, ((0, 0), (0, -(-width // cols) * cols - width)))[seq]
    k_new, v_new = (jnp.pad(x, ((0, chunk), (0, 0), (0, 0))) for x in (k, v))

    def keys(i, kv: int, new):
        blocks = jax.lax.dynamic_slice_in_dim(tables, i * cols, cols, axis=1)
        from_cache = cached_blocks(kv_cache, layer, kv, blocks, q.dtype).transpose(0, 1, 3, 2, 4).reshape(num_tokens, chunk, num_kv_heads, head_dim)
        ctx_pos = i * chunk + jnp.arange(chunk, dtype=jnp.int32)
        idx = jnp.clip(q_start[:, None] + ctx_pos[None, :] - cached[:, None], 0, new.shape[0] - 1)
        is_new = (ctx_pos[None, :] >= cached[:, None])[..., None, None]
        return jnp.where(is_new, new[idx].astype(from_cache.dtype), from_cache)

    kw = {"spec": spec, "alibi_slopes": alibi_slopes, "num_kv_heads": num_kv_heads, "prec": prec}

    limit = key_limits(attn_metadata, pos)

    def body(i, carry):
        ctx_pos = i * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = local_mask((ctx_pos[None, :] <= limit[:, None]) & valid[:, None], ctx_pos, pos, spec)
        kc, vc = keys(i, 0, k_new), keys(i, 1, v_new)
        s = _scores("tkgd,tckd->tkgc", qg, kc, mask, ctx_pos, pos, **kw)
        return _fold(carry, s, "tkgc,tckd->tkgd", vc, prec)

    trips = (jnp.max(jnp.where(valid, limit, -1)) + chunk) // chunk
    carry = jax.lax.fori_loop(0, trips, body, _empty_softmax(num_tokens, num_kv_heads, group, head_dim, sinks, valid))
    return normalized(carry, q.dtype)

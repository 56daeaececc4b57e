"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight) over a paged latent cache, in pure JAX.

MLA caches, per token and layer, one compressed latent c (kv_lora_rank wide, after kv_a_layernorm) and one RoPE'd
key k_pe (qk_rope_head_dim) shared by every head; a head's key is [c @ W_UK[h], k_pe] and its value c @ W_UV[h]
(W_UK, W_UV: kv_b_proj's two halves). The cache row [c, k_pe] (R + P values) lives in the ordinary KV-block array as
one KV head whose K plane holds the row's first half and V plane its second (head_dim (R + P) / 2), so blocks,
tables, the write, copies, prefix caching, 16-bit and 8-bit storage are the engine's unchanged, and a token costs
R + P values a layer instead of H * (qk_head_dim + v_head_dim).

The attention splits as the reference's does (pallas_kernels/reference.py):
- this step's own keys in the expanded form (prefill's): its latents up-projected to per-head K and V, one [T, T]
  product per head;
- the cached context in the absorbed form (decode's): W_UK folded into the query (q_nope @ W_UK[h]^T, R wide), so
  each head scores the cached rows directly ([q_lat, q_pe] . [c, k_pe]) and sums latents; W_UV is applied once to
  that sum. It is MQA with one KV head R + P wide and values R wide, read a chunk of blocks at a time.
The two partial softmaxes merge in value space (the latent sum projected by W_UV first: a linear map commutes with
the merge's rescaling).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxpaged.pallas_kernels.metadata import AttentionMetadata
from jaxpaged.pallas_kernels.reference import CHUNK_TOKENS, _empty_softmax, _fold, cached_blocks, token_layout


def latent_planes(c_kv: jax.Array, k_pe: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A step's new latents c [T, R] and k_pe [T, P] -> (K plane, V plane) [T, 1, (R + P) / 2]: the cache row
    [c, k_pe] cut in two halves, write_kv's one-KV-head layout."""
    row = jnp.concatenate([c_kv, k_pe.astype(c_kv.dtype)], axis=-1)
    half = row.shape[-1] // 2
    return row[:, None, :half], row[:, None, half:]


def cached_latents(kv_cache, layer: int, blocks: jax.Array, dtype) -> jax.Array:
    """The cache rows [c, k_pe] of `blocks` [...]: [..., block_size, R + P] (the K and V planes joined)."""
    k = cached_blocks(kv_cache, layer, 0, blocks, dtype)
    v = cached_blocks(kv_cache, layer, 1, blocks, dtype)
    return jnp.concatenate([k, v], axis=-1)[..., 0, :, :]  # one KV head


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _einsum(equation, *operands, prec):
    return jnp.einsum(equation, *operands, preferred_element_type=jnp.float32, precision=prec)


def naive_mla_attention(q_nope, q_pe, w_uk, w_uv, kv_cache, layer: int, attn_metadata: AttentionMetadata,
                        scale: float) -> jax.Array:  # fmt: skip
    """The definition (tests only): every row gathers its sequence's whole cached context (this step's latents already
    written), up-projects it to per-head K/V as transformers does, and attends causally. -> [T, H, V]."""
    num_tokens = q_nope.shape[0]
    rank = w_uk.shape[0]
    prec = _precision(q_nope.dtype)
    seq, pos, valid = token_layout(attn_metadata, num_tokens)
    rows = cached_latents(kv_cache, layer, attn_metadata.block_tables[seq], q_nope.dtype)  # [T, W, bs, R + P]
    rows = rows.reshape(num_tokens, -1, rows.shape[-1])
    c, k_pe = rows[..., :rank], rows[..., rank:]
    k_nope = _einsum("tcr,rhn->tchn", c, w_uk, prec=prec)
    values = _einsum("tcr,rhv->tchv", c, w_uv, prec=prec)
    scores = (_einsum("thn,tchn->thc", q_nope, k_nope, prec=prec) + _einsum("thp,tcp->thc", q_pe, k_pe, prec=prec)) * scale
    ctx_pos = jnp.arange(rows.shape[1], dtype=jnp.int32)
    mask = (ctx_pos[None, :] <= pos[:, None]) & valid[:, None]
    probs = jax.nn.softmax(jnp.where(mask[:, None, :], scores, -jnp.inf), axis=-1)
    probs = jnp.where(valid[:, None, None], probs, 0.0)
    return _einsum("thc,tchv->thv", probs, values, prec=prec).astype(q_nope.dtype)


def mla_reference(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, kv_cache, layer: int, attn_metadata: AttentionMetadata,
                  scale: float, absorbed=None) -> jax.Array:  # fmt: skip
    """naive_mla_attention's result with this step's latents (c_kv [T, R], k_pe [T, P], RoPE'd) not yet in the cache.
    q_nope [T, H, N], q_pe [T, H, P] (RoPE'd), w_uk [R, H, N], w_uv [R, H, V] -> [T, H, V]. absorbed: a kernel for
    the cached part (mla_gpu.gpu_mla_cached's contract); None: the pure-JAX loop below."""
    num_tokens, num_heads, _ = q_nope.shape
    rank = w_uk.shape[0]
    dtype, prec = q_nope.dtype, _precision(q_nope.dtype)
    seq, pos, valid = token_layout(attn_metadata, num_tokens)

    # this step's keys, expanded: [T, T] per head, same sequence, causal
    k_nope = _einsum("tr,rhn->thn", c_kv, w_uk, prec=prec).astype(dtype)
    v_new = _einsum("tr,rhv->thv", c_kv, w_uv, prec=prec).astype(dtype)
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None]) & valid[:, None] & valid[None, :]
    s = _einsum("thn,uhn->thu", q_nope, k_nope, prec=prec) + _einsum("thp,up->thu", q_pe, k_pe.astype(dtype), prec=prec)
    s = jnp.where(mask[:, None, :], s * scale, -jnp.inf)[:, None]  # [T, 1, H, T]: one KV head, H query heads
    fresh = _fold(_empty_softmax(num_tokens, 1, num_heads, v_new.shape[-1]), s, "tkgu,ugd->tkgd", v_new, prec)

    # the cached context, absorbed: W_UK folded into the query, latents summed, W_UV applied to the sum
    q_lat = _einsum("thn,rhn->thr", q_nope, w_uk, prec=prec).astype(dtype)
    q_abs = jnp.concatenate([q_lat, q_pe], axis=-1)[:, None]  # [T, 1, H, R + P]
    block_size = kv_cache.shape[4]
    cols = max(1, CHUNK_TOKENS // block_size)
    chunk = cols * block_size
    width = attn_metadata.block_tables.shape[1]
    q_lens = attn_metadata.query_start_loc[seq + 1] - attn_metadata.query_start_loc[seq]
    cached = jnp.where(valid, attn_metadata.seq_lens[seq] - q_lens, 0)
    tables = jnp.pad(attn_metadata.block_tables, ((0, 0), (0, -(-width // cols) * cols - width)))[seq]

    def cached_part(rows: slice):
        q_rows, tables_rows, cached_rows = q_abs[rows], tables[rows], cached[rows]
        n = q_rows.shape[0]

        def body(i, carry):
            blocks = jax.lax.dynamic_slice_in_dim(tables_rows, i * cols, cols, axis=1)
            latents = cached_latents(kv_cache, layer, blocks, dtype)  # [n, cols, bs, R + P]
            ctx_pos = i * chunk + jnp.arange(chunk, dtype=jnp.int32)
            live = (ctx_pos[None, :] < cached_rows[:, None]).reshape(n, 1, 1, cols, block_size)
            s = _einsum("tkgd,tcbd->tkgcb", q_rows, latents, prec=prec) * scale
            return _fold(carry, jnp.where(live, s, -jnp.inf), "tkgcb,tcbr->tkgr", latents[..., :rank], prec)

        trips = (jnp.max(cached_rows) + chunk - 1) // chunk
        return jax.lax.fori_loop(0, trips, body, _empty_softmax(n, 1, num_heads, rank))

    if absorbed is not None:
        peak, denom, acc = absorbed(q_abs[:, 0], kv_cache, layer, attn_metadata, scale)
        acc_lat = acc[..., :rank]
    else:
        # decode rows come first in a step ([0, S)): the prompt rows after them do not pay for their long contexts
        split = min(attn_metadata.block_tables.shape[0], num_tokens)
        groups = [slice(0, split)] + ([slice(split, num_tokens)] if split < num_tokens else [])
        peak, denom, acc_lat = (jnp.concatenate(xs) for xs in zip(*[cached_part(rows) for rows in groups]))
    acc = _einsum("tkgr,rgv->tkgv", acc_lat, w_uv, prec=prec)
    return _normalized(_merge(fresh, (peak, denom, acc)), dtype)


def _merge(a, b):
    """Two partial softmaxes (peak, denom, acc) over disjoint keys -> one."""
    peak = jnp.maximum(a[0], b[0])
    safe = jnp.where(jnp.isfinite(peak), peak, 0.0)
    ca, cb = jnp.exp(a[0] - safe), jnp.exp(b[0] - safe)
    return peak, a[1] * ca + b[1] * cb, a[2] * ca[..., None] + b[2] * cb[..., None]


def _normalized(carry, dtype) -> jax.Array:
    _, denom, acc = carry
    out = acc / jnp.where(denom == 0.0, 1.0, denom)[..., None]
    return out[:, 0].astype(dtype)  # [T, H, V]


def mla_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, kv_cache, layer: int, attn_metadata: AttentionMetadata,
                  scale: float, *, tp: int = 1, tp_axis: str = "model", absorbed=None) -> jax.Array:  # fmt: skip
    """mla_reference for a model layer: its group's tables (KV cache groups), and under a tensor-parallel mesh of tp
    devices, per device under shard_map: each device's query heads, W_UK/W_UV slices and its own copy of the latent
    cache (the cache's KV-head axis holds one copy per device); no communication."""
    layer, attn_metadata = attn_metadata.for_layer(layer)
    attend = functools.partial(mla_reference, layer=layer, scale=scale, absorbed=absorbed)
    if tp > 1:
        heads, weights = P(None, tp_axis, None), P(None, tp_axis, None)
        cache = jax.tree.map(lambda _: P(None, None, None, tp_axis), kv_cache)
        in_specs = (heads, heads, P(), P(), weights, weights, cache, P())
        attend = jax.shard_map(lambda *a: mla_reference(*a[:7], layer, a[7], scale, absorbed), in_specs=in_specs, out_specs=heads,
                               check_vma=False)  # fmt: skip
        return attend(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, kv_cache, attn_metadata)
    return attend(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, kv_cache, attn_metadata=attn_metadata)

"""Random ragged attention steps over a paged KV cache: the cases kernels and references are checked on."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jaxpaged.pallas_kernels import AttentionMetadata, AttentionSpec, kv_cache_shape


@dataclasses.dataclass
class Case:
    q: jnp.ndarray  # [T, H, D]
    k: jnp.ndarray  # [T, H_kv, D] this step's keys
    v: jnp.ndarray
    kv_cache: jnp.ndarray  # one layer, kv_cache_shape(1, ...), this step's K/V not yet written
    attn_metadata: AttentionMetadata
    num_real_tokens: int


def attention_args(scale, sliding_window=None, soft_cap=None, alibi_slopes=None):
    """The kernels' trailing arguments, (AttentionSpec, alibi_slopes), from keywords."""
    return AttentionSpec(scale, sliding_window, soft_cap), alibi_slopes


def random_case(
    rng: np.random.Generator,
    *,
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    padded_seqs: int = 2,
    padded_tokens: int = 5,
    extra_width: int = 3,
    dtype=jnp.float32,
) -> Case:
    """Sequences with context seq_lens[i], of which the last q_lens[i] tokens are this step's."""
    num_seqs = len(seq_lens) + padded_seqs
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_needed) + extra_width
    num_blocks = sum(blocks_needed) + 4
    ids = rng.permutation(num_blocks)
    tables = np.zeros((num_seqs, width), np.int32)
    start = 0
    for i, nb in enumerate(blocks_needed):
        tables[i, :nb] = ids[start : start + nb]
        start += nb
    query_start_loc = np.zeros(num_seqs + 1, np.int32)
    query_start_loc[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    query_start_loc[len(q_lens) + 1 :] = query_start_loc[len(q_lens)]
    real = int(query_start_loc[-1])
    total = real + padded_tokens
    slots = np.full(total, -1, np.int32)
    for i, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        for j in range(ql):
            p = n - ql + j
            slots[query_start_loc[i] + j] = tables[i, p // block_size] * block_size + p % block_size
    lens = np.zeros(num_seqs, np.int32)
    lens[: len(seq_lens)] = seq_lens
    shape = kv_cache_shape(1, num_kv_heads, num_blocks, block_size, head_dim)
    return Case(
        q=jnp.asarray(rng.normal(size=(total, num_heads, head_dim)), dtype),
        k=jnp.asarray(rng.normal(size=(total, num_kv_heads, head_dim)), dtype),
        v=jnp.asarray(rng.normal(size=(total, num_kv_heads, head_dim)), dtype),
        kv_cache=jnp.asarray(rng.normal(size=shape), dtype),
        attn_metadata=AttentionMetadata(jnp.asarray(slots), jnp.asarray(tables), jnp.asarray(lens), jnp.asarray(query_start_loc)),
        num_real_tokens=real,
    )

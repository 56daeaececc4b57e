"""What one step's attention needs to find each token's context in the paged KV array.

Raggedness lives in small int32 arrays, never in a shape: a step's tokens are flattened
(T rows, padded to a bucket), sequences occupy slots 0..S-1 (padded slots have q_len 0 and
seq_len 0), and each slot has a row in the block table (padded to a bucketed width W).

KV layout (fixed here; the Pallas kernel reads the same array):
    kv_cache[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
index 0 of axis 1 holds K, index 1 holds V. A block id names the same slot in every layer. With KV cache groups
(hybrid models: some layers windowed, some global; jaxpaged/core/kv_cache_coordinator.py) axis 0 is a layer's index
within its group instead, each group has its own block tables and slots ([G, S, W] and [G, T]), and a block id
names the same slot in the layers of the one group that holds it.
Within a layer a block is one contiguous [num_kv_heads, block_size, head_dim] run (so gathering
a sequence's blocks copies whole rows, twice as fast on XLA:CPU as head-major tiles), and a
(block, head) pair is a contiguous block_size x head_dim tile for kernels.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    # [T] flat KV slot (block_id * block_size + offset) each new token is written to; -1 for padding rows.
    slot_mapping: jax.Array
    # [S, W] physical block ids of each sequence's context, in order; unused entries may hold any valid id.
    block_tables: jax.Array
    # [S] context length of each sequence after this step's tokens are written; 0 for padded slots.
    seq_lens: jax.Array
    # [S + 1] start of each sequence's tokens in the flattened rows; q_len = diff; padded slots add 0.
    query_start_loc: jax.Array
    # [S] length-dependent RoPE only (longrope, dynamic): each token's frequencies are decided from max(its position
    # + 1, its sequence's entry) (jaxpaged/core/rope_regime.py); None: from its sequence's seq_len.
    rope_lens: jax.Array | None = None
    # KV cache groups only: each layer's (group, index within the group); static, so part of the compiled step
    layer_groups: tuple[tuple[int, int], ...] | None = dataclasses.field(default=None, metadata={"static": True})
    # [S] hybrid models only: each row's slot in the state cache of the linear layers (pallas_kernels/state_cache.py);
    # padded rows hold an out-of-range slot, so their writes are dropped
    state_slots: jax.Array | None = None
    # [T] vision-language models whose image tokens attend to each other both ways in prefill (Gemma 3): the last
    # position among this step's keys each row may see, inclusive (its own for a text token, its image's last for an
    # image token; the image's whole span is in the step). None: causal, each row its own position
    key_ends: jax.Array | None = None

    def for_layer(self, layer: int) -> tuple[int, AttentionMetadata]:
        """(the cache index of `layer`, the metadata its attention reads): with groups, its group's tables and slots."""
        if self.layer_groups is None:
            return layer, self
        group, index = self.layer_groups[layer]
        return index, dataclasses.replace(self, slot_mapping=self.slot_mapping[group],
                                          block_tables=self.block_tables[group], layer_groups=None)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """How one layer attends, fixed when the model is built (a static argument of the kernels)."""

    scale: float  # on q.k
    sliding_window: int | None = None  # a query sees the keys at most this many positions back, itself included
    soft_cap: float | None = None  # scores -> soft_cap * tanh(scores / soft_cap), before ALiBi and the mask
    # chunked local attention (Llama 4's RoPE layers): a query sees only the keys of its own chunk, positions
    # [pos // chunk_size * chunk_size, pos]; only backends with supports_chunks take it (pallas_kernels/attention.py)
    chunk_size: int | None = None


def kv_cache_shape(num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int):
    return (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)

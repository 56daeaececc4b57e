"""KV cache groups over one pool (vLLM V1's KVCacheCoordinator): hybrid models whose local layers forget what their
window (or, chunked local attention, their chunk) no longer sees while their global layers keep everything.

Layers are split into groups of equally many layers of one attention type (layer_groups); each group has its own
KVCacheManager, so its own block table per sequence, and all of them draw on one BlockPool, so blocks a local group
releases serve the global group's growth. A block id then means one layer of each group (docs/design.md, "Stage 2").
The coordinator answers the scheduler with the KVCacheManager's methods; a block table is a tuple, one per group.
KVGroups is what the device side needs: the cache laid out by index within group, and each layer's group, whose
tables and slots its attention and KV write use (pallas_kernels/metadata.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jaxpaged.core.block_pool import BlockPool
from jaxpaged.core.kv_cache_manager import Chunked, HashedSequence, KVCacheManager, max_blocks_held

Local = int | Chunked | None  # what a layer's attention reads back: a window, a chunk, or everything (None)


def layer_localities(model_config) -> tuple[Local, ...]:
    """Per layer, how far back its attention reads: its sliding window, Chunked(size) for a layer of chunked local
    attention (the options "chunked_layers" and "chunk_size": Llama 4), or None; () when every layer reads all."""
    chunk, chunked = model_config.option("chunk_size"), model_config.option("chunked_layers", ())
    if not chunk or not chunked:
        return tuple(model_config.sliding_windows)
    windows = list(model_config.sliding_windows) or [None] * model_config.num_layers
    return tuple(Chunked(int(chunk)) if layer in chunked else w for layer, w in enumerate(windows))


def layer_groups(sliding_windows: Sequence[Local], num_layers: int) -> list[tuple[Local, tuple[int, ...]]]:
    """(window, layers) of each group: layers of one window (a Chunked: a chunk; None: global) in runs of g, g the
    gcd of the types' layer counts, so every group has g layers (Gemma 3's 40 local and 8 global layers: 5 local
    groups and 1 global of 8 each)."""
    windows = list(sliding_windows) or [None] * num_layers
    by_type: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_type.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_type.values()))
    return [(w, tuple(layers[i : i + size])) for w, layers in by_type.items() for i in range(0, len(layers), size)]


@dataclasses.dataclass(frozen=True)
class KVGroups:
    """A hybrid model's KV cache groups, as the runner lays out its cache."""

    windows: tuple[Local, ...]  # per group (a Chunked: chunked local attention; None: global)
    layers: tuple[tuple[int, ...], ...]  # per group, g layers each

    @property
    def size(self) -> int:
        """Layers per group: the cache's first axis."""
        return len(self.layers[0])

    @property
    def layer_groups(self) -> tuple[tuple[int, int], ...]:
        """Each layer's (group, index within it), in layer order: AttentionMetadata.layer_groups."""
        where = {layer: (g, i) for g, layers in enumerate(self.layers) for i, layer in enumerate(layers)}
        return tuple(where[layer] for layer in range(len(where)))

    def blocks_held(self, num_tokens: int, block_size: int, step_tokens: int) -> int:
        """The most blocks a sequence of num_tokens holds at once, over all groups (a local group: its window's or
        its chunk's)."""
        return sum(max_blocks_held(num_tokens, block_size, w, step_tokens) for w in self.windows)


def kv_groups(sliding_windows: Sequence[Local], num_layers: int) -> KVGroups | None:
    """The groups of a hybrid model (windowed or chunked layers and global ones, or several windows; per layer, as
    layer_localities gives them); None when one window (or none) covers every layer, which one table per sequence
    serves (stage 1)."""
    if len(set(sliding_windows or [None])) < 2:
        return None
    groups = layer_groups(sliding_windows, num_layers)
    return KVGroups(tuple(w for w, _ in groups), tuple(layers for _, layers in groups))


class KVCacheCoordinator:
    def __init__(self, pool: BlockPool, block_size: int, group_windows: Sequence[Local]):
        self.pool = pool
        self.block_size = block_size
        self.groups = [KVCacheManager(pool, block_size, w, hash_salt=i.to_bytes(2, "little")) for i, w in enumerate(group_windows)]
        self.sliding_window = None  # no single window: admission counts blocks by group (max_blocks_held per group)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def block_table(self, seq_id: str) -> tuple[list[int], ...]:
        """One table per group; () when seq_id has none (the scheduler tests a table's truth: holds blocks?)."""
        tables = tuple(g.block_table(seq_id) for g in self.groups)
        return tables if any(tables) else ()

    def held_blocks(self, seq_id: str) -> list[int]:
        return [b for g in self.groups for b in g.held_blocks(seq_id)]

    def num_released(self, seq_id: str) -> int:
        """Released entries over all groups, in tokens' blocks per group (for kv_stats' token utilization)."""
        return sum(g.num_released(seq_id) for g in self.groups) // len(self.groups)

    def allocate_slots(self, seq_id: str, num_computed: int, num_new_tokens: int) -> bool:
        """Every group's blocks for the tokens, or nothing: windows release first, then the groups' needs together
        must fit the pool before any group allocates."""
        for g in self.groups:
            g.release_behind_window(seq_id, num_computed)
        need = sum(g.blocks_needed(seq_id, num_computed, num_new_tokens) for g in self.groups)
        if need > self.pool.num_free:
            return False
        return all([g.allocate_slots(seq_id, num_computed, num_new_tokens) for g in self.groups])

    def take_changed(self) -> set[str]:
        return set().union(*[g.take_changed() for g in self.groups])

    def take_copies(self) -> list[tuple[int, int]]:
        return [c for g in self.groups for c in g.take_copies()]

    def fork(self, parent_id: str, child_id: str) -> None:
        for g in self.groups:
            g.fork(parent_id, child_id)

    def free(self, seq_id: str) -> None:
        for g in self.groups:
            g.free(seq_id)

    def take_cached_prefix(self, seq: HashedSequence) -> int:
        """The longest hit every group accepts (global: all its blocks cached; local: its first new token's window or
        chunk),
        shortened until they agree, as vLLM's coordinator does; each group then holds what it needs."""
        if not self.pool.enable_caching or any(g.block_table(seq.seq_id) for g in self.groups):
            return 0
        hashes = seq.block_hashes(self.block_size, (seq.num_tokens - 1) // self.block_size)
        k = len(hashes)
        while True:
            shortest = min(g.longest_hit(hashes[:k]) for g in self.groups)
            if shortest == k:
                break
            k = shortest
        for g in self.groups:
            g.take_hit(seq.seq_id, hashes, k)
        return k * self.block_size

    def count_prefix_query(self, num_tokens: int, num_hit: int) -> None:
        if self.pool.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit

    def register_full_blocks(self, seq: HashedSequence, num_known: int | None = None) -> None:
        for g in self.groups:
            g.register_full_blocks(seq, num_known)

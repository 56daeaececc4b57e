"""Physical KV blocks: who may use which, counted by reference, and which hold a known prefix.

Block ids index axis 2 of the KV array in every layer. A block is free exactly when its
reference count is zero; forking a sequence (parallel sampling, beams) shares blocks by
raising counts instead of copying.

Prefix caching (vLLM's scheme): a full block can be registered under the hash of its tokens
chained with its predecessor's hash. When its last holder lets go, a registered block keeps
its contents and its hash but joins the free queue, which is least-recently-freed first; a
later request with the same prefix takes it back out (`acquire`), and `allocate` evicts the
hash of whatever cached block it reuses. Free cached blocks count as free.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (got {num_blocks})")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = evicted first
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks (reference count 1), or None, taking nothing, if too few are free."""
        if count > len(self._free):
            return None
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """One more holder for each (already allocated) block."""
        for b in blocks:
            if self._ref_counts[b] < 1:
                raise ValueError(f"cannot share block {b}: it is free")
            self._ref_counts[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one holder of each block; a block nobody holds joins the free queue at once.

        Pass a sequence's blocks last-first: its tail, the least likely to be shared, is then evicted first.
        """
        for b in blocks:
            if self._ref_counts[b] < 1:
                raise ValueError(f"double free of block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    # -- prefix caching -------------------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def acquire(self, block: int) -> None:
        """Hold a cached block found by lookup, taking it off the free queue if nobody held it."""
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """A full block's contents are final: let later requests with the same prefix find it."""
        if not self.enable_caching or self._hash_of[block] is not None or block_hash in self._cached:
            return  # an identical block is already findable; this one stays private
        self._hash_of[block] = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (their K/V came from weights being replaced, or from a KV pool being freed);
        -> how many. Only when no block is held: a running sequence's blocks are its own context, not a cache."""
        if self.num_used:
            raise RuntimeError(f"reset_prefix_cache: {self.num_used} blocks are still held by sequences")
        count = len(self._cached)
        self._cached.clear()
        self._hash_of = [None] * self.num_blocks
        return count

    def _forget(self, block: int) -> None:
        block_hash = self._hash_of[block]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hash_of[block] = None

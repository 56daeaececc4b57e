"""Physical KV blocks: who may use which, counted by reference. Pure Python, no device work.

Block ids index axis 3 of the KV array in every layer. A block is free exactly when its
reference count is zero; forking a sequence (parallel sampling, beams) shares blocks by
raising counts instead of copying.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (got {num_blocks})")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks (reference count 1), or None, taking nothing, if too few are free."""
        if count > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """One more holder for each (already allocated) block."""
        for b in blocks:
            if self._ref_counts[b] < 1:
                raise ValueError(f"cannot share block {b}: it is free")
            self._ref_counts[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one holder of each block; a block nobody holds goes back to the free queue at once."""
        for b in blocks:
            if self._ref_counts[b] < 1:
                raise ValueError(f"double free of block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

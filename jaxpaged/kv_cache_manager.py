"""Per-request block tables over the BlockPool: allocate on demand, fork by sharing, free at once."""

from __future__ import annotations

import numpy as np

from jaxpaged.block_pool import BlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self._tables: dict[str, list[int]] = {}

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def allocate_slots(self, seq_id: str, num_computed: int, num_new_tokens: int) -> bool:
        """Make room for tokens [num_computed, num_computed + num_new_tokens); False (and nothing taken) if the pool can't."""
        table = self._tables.setdefault(seq_id, [])
        missing = blocks_for(num_computed + num_new_tokens, self.block_size) - len(table)
        if missing <= 0:
            return True
        blocks = self.pool.allocate(missing)
        if blocks is None:
            return False
        table.extend(blocks)
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child starts with the parent's blocks, shared (reference counts go up, nothing is copied)."""
        table = list(self._tables.get(parent_id, []))
        self.pool.share(table)
        self._tables[child_id] = table

    def free(self, seq_id: str) -> None:
        self.pool.free(self._tables.pop(seq_id, []))

    def slots(self, seq_id: str, start: int, count: int) -> np.ndarray:
        """Flat slots (block_id * block_size + offset) of positions [start, start + count)."""
        positions = np.arange(start, start + count, dtype=np.int32)
        table = np.asarray(self._tables[seq_id], np.int32)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

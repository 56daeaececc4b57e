"""Per-sequence block tables over the BlockPool: allocate on demand, share by fork, copy on write, free at once.

Sharing rules. Forked sequences (n > 1, beams) share every block of the parent; a full block
is never written again, so sharing it is free. The first write into a shared, partly filled
block gives the writer a fresh block and queues a copy of the old one (`take_copies`; the
runner copies on device before the step reads the cache); the last holder writes in place.

Prefix caching: once a block's tokens are all computed it is registered under a SHA-256 hash
chained over the sequence's blocks, so equal hashes mean equal token prefixes. A sequence
admitted with nothing computed first takes every cached block matching its tokens.

Sliding windows (every layer windowed): a block whose last position lies before the window of the
sequence's earliest query of a step is never read again, so it goes back to the pool when the
sequence crosses into a new block, and its table entry becomes NULL_BLOCK. Released entries are
always a prefix of the table (the window only moves forward), so one count per sequence says which
entries are placeholders; shapes, and the kernels' indexing, do not change. Chunked local attention
(Chunked: Llama 4's RoPE layers, in a KV cache group of their own) frees the same way, from the first
position of the earliest query's chunk instead of its window.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from typing import Protocol

import numpy as np

from jaxpaged.core.block_pool import BlockPool


def slot_mapping(block_table: list[int], start: int, count: int, block_size: int) -> np.ndarray:
    """Flat KV slots (block_id * block_size + offset) of positions [start, start + count) through a block table."""
    positions = np.arange(start, start + count, dtype=np.int32)
    return np.asarray(block_table, np.int32)[positions // block_size] * block_size + positions % block_size


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# What a released table entry holds: any valid id would do, since every position in it is outside every query's
# window and masked to an exact zero weight; 0 is also what the input batch pads tables with.
NULL_BLOCK = 0
NEVER = 1 << 62  # a token count no sequence reaches


@dataclasses.dataclass(frozen=True)
class Chunked:
    """Chunked local attention, where a KVCacheManager takes a sliding window: a query at position p sees the keys
    [p // size * size, p] (Llama 4's `attention_chunk_size`)."""

    size: int


def first_needed(local: int | Chunked | None, pos: int) -> int:
    """The first position a query at `pos` reads: 0 (global), its sliding window's first, or its chunk's first."""
    if local is None:
        return 0
    if isinstance(local, Chunked):
        return pos // local.size * local.size
    return max(0, pos - local + 1)


def freeing_window(sliding_windows) -> int | None:
    """The window beyond which no layer looks, when every layer has one (models/config.py's per-layer windows);
    None when any layer is global: one pool shared by all layers cannot free a block for some layers only."""
    if not sliding_windows or any(w is None for w in sliding_windows):
        return None
    return max(sliding_windows)


def max_blocks_held(num_tokens: int, block_size: int, window: int | Chunked | None, step_tokens: int) -> int:
    """The most blocks a sequence of num_tokens holds at once: all of them, or with a window those a step of up
    to step_tokens tokens reads (window - 1 positions before its first query, and its own), plus one for alignment;
    a chunk as a window of its size (its first query sees at most size - 1 positions back)."""
    full = blocks_for(num_tokens, block_size)
    if window is None:
        return full
    span = window.size if isinstance(window, Chunked) else window
    return min(full, blocks_for(span - 1 + step_tokens, block_size) + 1)


def hash_block(parent: bytes | None, tokens) -> bytes:
    """The identity of a full block: its tokens and, through the parent's hash, everything before them."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", tokens).tobytes())  # int64s, as np.asarray(tokens, np.int64) gives them, at half the cost
    return digest.digest()


class HashedSequence(Protocol):
    seq_id: str
    num_tokens: int
    num_computed_tokens: int

    def block_hashes(self, block_size: int, count: int) -> list[bytes]: ...


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, sliding_window: int | Chunked | None = None, *,
                 hash_salt: bytes = b""):  # fmt: skip
        """hash_salt lets several managers share one pool (kv_cache_coordinator.py): a salt per manager, so that
        equal prefixes in different layer groups are different blocks. sliding_window may be a Chunked (chunked
        local attention), freed the same way."""
        self.pool = pool
        self.block_size = block_size
        # set: blocks before every query's window (or chunk) go back to the pool
        self.sliding_window = sliding_window
        self._tables: dict[str, list[int]] = {}
        self._released: dict[str, int] = {}  # leading entries of each table given back (now NULL_BLOCK)
        self._num_registered: dict[str, int] = {}  # leading blocks of each table already registered
        # seq_id -> computed and known tokens at which its next block could be registered (never later than that):
        # register_full_blocks, called for every sequence every step, passes over the others with one lookup each
        self._register_due: dict[str, int] = {}
        self._copies: list[tuple[int, int]] = []  # (src, dst) block copies the next step needs first
        # seq_ids whose table changed since take_changed(): the runner keeps each table on the host between steps
        # and copies it again only then
        self._changed: set[str] = set()
        self._appended: list[tuple[str, int, int]] = []  # append_blocks' (seq_id, index, block) since take_appended()
        # seq_id -> the tokens [0, n) it can write without allocating or copying (it alone holds its blocks from its
        # first unwritten one on), kept without a window: the scheduler's decode rows pass allocate_slots with a
        # lookup while their tokens fit (with a window, blocks are released on the way, so every step asks)
        self.writable: dict[str, int] = {}
        self._salt = hash_salt
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def held_blocks(self, seq_id: str) -> list[int]:
        """The blocks seq_id holds: its table less the placeholders of released blocks."""
        return self._tables.get(seq_id, [])[self._released.get(seq_id, 0) :]

    def num_released(self, seq_id: str) -> int:
        return self._released.get(seq_id, 0)

    def allocate_slots(self, seq_id: str, num_computed: int, num_new_tokens: int) -> bool:
        """Make tokens [num_computed, num_computed + num_new_tokens) writable; False (nothing taken) if the pool can't."""
        table = self._tables.setdefault(seq_id, [])
        bs = self.block_size
        # the step's earliest query sees positions from num_computed - window + 1 (or its chunk's first): blocks
        # wholly before it go back (an O(1) test; it passes once per block_size tokens)
        if self.sliding_window is not None:
            upto = first_needed(self.sliding_window, num_computed) // bs
            if upto > self._released.get(seq_id, 0):
                self._release(seq_id, table, upto)
        last = len(table) - 1
        # the usual decode step: its token goes in the table's last block, which it alone holds
        if num_computed // bs == last and num_computed + num_new_tokens <= len(table) * bs:
            if self.pool.ref_count(table[last]) == 1:
                if self.sliding_window is None:
                    self.writable[seq_id] = len(table) * bs
                return True
        shared = [i for i in range(num_computed // bs, len(table)) if self.pool.ref_count(table[i]) > 1]
        missing = max(0, blocks_for(num_computed + num_new_tokens, bs) - len(table))
        if missing + len(shared) > self.pool.num_free:
            return False
        if missing or shared:
            self._changed.add(seq_id)
        for i, fresh in zip(shared, self.pool.allocate(len(shared)) or []):
            if i * bs < num_computed:  # holds computed tokens: they move with it
                self._copies.append((table[i], fresh))
            self.pool.free([table[i]])
            table[i] = fresh
        if missing:
            table.extend(self.pool.allocate(missing))
        if self.sliding_window is None:
            self.writable[seq_id] = len(table) * bs
        return True

    def append_blocks(self, seq_ids: list[str]) -> bool:
        """allocate_slots for sequences whose blocks are full and theirs alone (`writable` reached), each writing one
        token more: a fresh block each, in one pool call. False (nothing taken) if the pool has too few."""
        blocks = self.pool.allocate(len(seq_ids))
        if blocks is None:
            return False
        tables, writable, bs = self._tables, self.writable, self.block_size
        appended = self._appended
        for seq_id, block in zip(seq_ids, blocks):
            table = tables[seq_id]
            if writable.get(seq_id) != len(table) * bs:  # (its last block partly written, or shared: a caller's bug)
                raise RuntimeError(f"append_blocks: {seq_id}'s blocks are not full and its own")
            appended.append((seq_id, len(table), block))
            table.append(block)
            writable[seq_id] = len(table) * bs
        return True

    def take_appended(self) -> list[tuple[str, int, int]]:
        """What append_blocks added since the last call, (seq_id, index, block): a table entry each for the runner
        to write, in place of copying those tables again (take_changed leaves them out)."""
        appended, self._appended = self._appended, []
        return appended

    def release_behind_window(self, seq_id: str, num_computed: int) -> None:
        """What allocate_slots releases first, alone: so a coordinator can count the blocks every group still needs."""
        if self.sliding_window is not None and seq_id in self._tables:
            upto = first_needed(self.sliding_window, num_computed) // self.block_size
            if upto > self._released.get(seq_id, 0):
                self._release(seq_id, self._tables[seq_id], upto)

    def blocks_needed(self, seq_id: str, num_computed: int, num_new_tokens: int) -> int:
        """Fresh blocks allocate_slots would take now (missing ones and copies on write)."""
        table, bs = self._tables.get(seq_id, []), self.block_size
        shared = sum(1 for i in range(num_computed // bs, len(table)) if self.pool.ref_count(table[i]) > 1)
        return shared + max(0, blocks_for(num_computed + num_new_tokens, bs) - len(table))

    def _release(self, seq_id: str, table: list[int], upto: int) -> None:
        """Give back table[released:upto] (one holder each: a block shared by a fork stays with the others)."""
        done = self._released.get(seq_id, 0)
        self.pool.free(reversed(table[done:upto]))
        table[done:upto] = [NULL_BLOCK] * (upto - done)
        self._released[seq_id] = upto
        self._changed.add(seq_id)

    def take_changed(self) -> set[str]:
        """The sequences whose block table changed since the last call (blocks added or replaced, a fork, a prefix
        hit, a release): the runner keeps tables on the host between steps and copies only these again."""
        changed, self._changed = self._changed, set()
        return changed

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child starts with the parent's blocks, shared (reference counts go up, nothing is copied)."""
        table = list(self._tables.get(parent_id, []))
        released = self._released.get(parent_id, 0)
        self.pool.share(table[released:])
        self._tables[child_id] = table
        self.writable.pop(parent_id, None)  # its blocks are shared now
        self.writable.pop(child_id, None)
        if released:
            self._released[child_id] = released
        self._changed.add(child_id)
        self._num_registered[child_id] = self._num_registered.get(parent_id, 0)
        self._register_due.pop(child_id, None)

    def free(self, seq_id: str) -> None:
        self.pool.free(reversed(self._tables.pop(seq_id, [])[self._released.pop(seq_id, 0) :]))
        self.writable.pop(seq_id, None)
        self._num_registered.pop(seq_id, None)
        self._register_due.pop(seq_id, None)
        self._changed.add(seq_id)

    # -- prefix caching -------------------------------------------------------------------------

    def take_cached_prefix(self, seq: HashedSequence) -> int:
        """Hold the cached blocks that match seq's leading tokens; returns how many tokens they cover.

        At least one token is always left to compute, since the step must produce the next token's logits.
        """
        if not self.pool.enable_caching or self._tables.get(seq.seq_id):
            return 0
        hashes = seq.block_hashes(self.block_size, (seq.num_tokens - 1) // self.block_size)
        return self.take_hit(seq.seq_id, hashes, self.longest_hit(hashes)) * self.block_size

    def _first_needed(self, k: int) -> int:
        """The first block a hit of k blocks must hold: the first new token's (at k * block_size) window's or
        chunk's."""
        return first_needed(self.sliding_window, k * self.block_size) // self.block_size

    def longest_hit(self, hashes: list[bytes]) -> int:
        """The most leading blocks k a hit can cover: every block cached, or with a window only those from
        _first_needed(k) on (vLLM's SlidingWindowManager.find_longest_cache_hit)."""
        found = [self.pool.lookup(self._salt + h) is not None for h in hashes]
        if self.sliding_window is None:
            return found.index(False) if False in found else len(found)
        run, runs = 0, []  # cached blocks in a row ending at each index
        for hit in found:
            run = run + 1 if hit else 0
            runs.append(run)
        for k in range(len(found), 0, -1):
            if runs[k - 1] >= k - self._first_needed(k):
                return k
        return 0

    def take_hit(self, seq_id: str, hashes: list[bytes], k: int) -> int:
        """Hold the cached blocks a hit of k blocks needs (longest_hit(hashes[:k]) == k); the rest are placeholders."""
        first = self._first_needed(k)
        blocks = [self.pool.lookup(self._salt + h) for h in hashes[first:k]]
        for block in blocks:
            self.pool.acquire(block)
        self._tables[seq_id] = [NULL_BLOCK] * first + blocks
        self.writable.pop(seq_id, None)
        if first:
            self._released[seq_id] = first
        self._changed.add(seq_id)
        self._num_registered[seq_id] = k
        self._register_due.pop(seq_id, None)
        return k

    def count_prefix_query(self, num_tokens: int, num_hit: int) -> None:
        if self.pool.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit

    def register_known_blocks(self, seqs: list[HashedSequence], num_known: list[int]) -> None:
        """register_full_blocks(seq, known) for sequences that have computed at least `known` tokens each (the
        scheduler's lanes, where a block fills once per block_size steps), in one loop."""
        for seq, known in zip(seqs, num_known):
            self._register_upto(seq, known)

    def register_full_blocks(self, seq: HashedSequence, num_known: int | None = None) -> None:
        """Blocks whose tokens are all computed (and, of those, the first `num_known`: a token still on the
        device has no value to hash yet) become findable by later requests."""
        self._register_upto(seq, seq.num_computed_tokens if num_known is None else min(seq.num_computed_tokens, num_known))

    def _register_upto(self, seq: HashedSequence, computed: int) -> None:
        """The full blocks among seq's first `computed` tokens, all computed and known, made findable."""
        if computed < self._register_due.get(seq.seq_id, self.block_size):  # no block filled since the last call
            return
        if not self.pool.enable_caching:
            self._register_due[seq.seq_id] = NEVER
            return
        table = self._tables.get(seq.seq_id, [])
        done = self._num_registered.get(seq.seq_id, 0)
        full = min(computed // self.block_size, len(table))
        done = max(done, self._released.get(seq.seq_id, 0))  # a block released before it was registered is gone
        self._register_due[seq.seq_id] = (max(full, done) + 1) * self.block_size
        if full <= done:
            return
        for block, block_hash in zip(table[done:full], seq.block_hashes(self.block_size, full)[done:]):
            self.pool.register(block, self._salt + block_hash)
        self._num_registered[seq.seq_id] = full

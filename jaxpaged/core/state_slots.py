"""A hybrid model's cache manager: the attention layers' blocks as KVCacheManager keeps them, and for the linear layers
(Gated DeltaNet, Mamba-2) one state slot per sequence, in the runner's preallocated state arrays
(pallas_kernels/state_cache.py).

A sequence takes a slot when it is first given tokens to compute (allocate_slots, which fails, taking nothing, when
no slot is free: the scheduler then releases an idle holder or preempts, as for blocks) and gives it back with its
blocks (free: finished, aborted, preempted, released while waiting). A fork (n > 1 samples, beams) gives the child a
slot of its own and queues a copy of the parent's state into it, made on the device before the next step
(take_state_copies); with no slot free the fork is refused and the child computes its tokens from scratch.

Prefix caching is off for these models: a cached block holds the attention layers' K/V but no linear layer's state at
its boundary, so a hit would skip the recurrence over the cached tokens.

Speculative decoding: a verifying row runs its last token and k guesses through the linear layers, whose state then
includes every guess; a rejected guess cannot be taken out of it. So before such a step the sequence's state is
copied into a spare slot (snapshot, queued with the step's other copies), and once the step is verified (settle) a
sequence that rejected a guess has the spare copied back into its slot before its next step, the state before the
row, and computes the row's kept tokens again then (spec_decode/decoder.py). The spare is free again at once: copies
are made in the order queued, each batch reading before it writes, so a later snapshot into it reads nothing stale.
Spares: one for each sequence that may verify at once (`spare_state_slots`).
"""

from __future__ import annotations

from jaxpaged.core.block_pool import BlockPool
from jaxpaged.core.kv_cache_manager import HashedSequence, KVCacheManager


def spare_state_slots(config) -> int:
    """Spare slots for speculative decoding's snapshots: one per sequence that may verify in a step (fewer than
    disable_by_batch_size run then); 0 without speculative_config."""
    spec = config.speculative_config
    return 0 if spec is None else max(1, min(config.max_num_seqs, spec.disable_by_batch_size - 1))


class HybridKVCacheManager(KVCacheManager):
    def __init__(self, pool: BlockPool, block_size: int, num_state_slots: int, num_spare_slots: int = 0):
        """num_state_slots for the sequences, then num_spare_slots for snapshots (the state arrays hold both)."""
        if num_state_slots < 1:
            raise ValueError(f"num_state_slots must be >= 1 (got {num_state_slots})")
        super().__init__(pool, block_size)
        self.num_state_slots = num_state_slots
        self._free_states = list(range(num_state_slots - 1, -1, -1))
        self._spares = list(range(num_state_slots + num_spare_slots - 1, num_state_slots - 1, -1))
        self._snapshots: dict[str, int] = {}  # seq_id -> the spare holding its state before its verifying row
        self._state_of: dict[str, int] = {}
        self._state_copies: list[tuple[int, int]] = []  # (src, dst) slot copies the next step needs first

    @property
    def num_free_states(self) -> int:
        return len(self._free_states)

    def state_slot(self, seq_id: str) -> int:
        """seq_id's state slot, -1 when it holds none."""
        return self._state_of.get(seq_id, -1)

    def allocate_slots(self, seq_id: str, num_computed: int, num_new_tokens: int) -> bool:
        """KVCacheManager's, plus a state slot for a sequence that has none; False (nothing taken) if either is short."""
        fresh = seq_id not in self._state_of
        if fresh and not self._free_states:
            return False
        if not super().allocate_slots(seq_id, num_computed, num_new_tokens):
            return False
        if fresh:
            self._state_of[seq_id] = self._free_states.pop()
        return True

    def fork(self, parent_id: str, child_id: str) -> bool:
        """The child shares the parent's blocks and gets a copy of its state; False (nothing done) when no slot is free
        or the parent holds none: the child then starts from scratch."""
        src = self._state_of.get(parent_id)
        if src is None or not self._free_states:
            return False
        super().fork(parent_id, child_id)
        dst = self._state_of[child_id] = self._free_states.pop()
        # a parent whose own state is a copy still to be made reads from that copy's source
        src = next((s for s, d in reversed(self._state_copies) if d == src), src)
        self._state_copies.append((src, dst))
        return True

    def snapshot(self, seq_id: str) -> bool:
        """Before seq_id's verifying step: its state copied into a spare (queued); False (nothing done) when it holds
        no slot or no spare is free: it must not verify then."""
        slot = self._state_of.get(seq_id)
        if slot is None or not self._spares or seq_id in self._snapshots:
            return False
        spare = self._snapshots[seq_id] = self._spares.pop()
        src = next((s for s, d in reversed(self._state_copies) if d == slot), slot)  # (a fork's copy still queued)
        self._state_copies.append((src, spare))
        return True

    def settle(self, seq_id: str, restore: bool) -> None:
        """After the verifying step: restore, its snapshot (the state before the row) copied back into its slot before
        its next step; the spare goes back either way."""
        spare = self._snapshots.pop(seq_id, None)
        if spare is None:
            return
        if restore and seq_id in self._state_of:
            self._state_copies.append((spare, self._state_of[seq_id]))
        self._spares.append(spare)

    def free(self, seq_id: str) -> None:
        self.settle(seq_id, restore=False)
        super().free(seq_id)
        slot = self._state_of.pop(seq_id, None)
        if slot is not None:
            # a copy into it still queued is void (its next holder starts from its own state); one out of it still
            # reads it first, as every copy is made before the step that follows
            self._state_copies = [(s, d) for s, d in self._state_copies if d != slot]
            self._free_states.append(slot)

    def take_state_copies(self) -> list[tuple[int, int]]:
        copies, self._state_copies = self._state_copies, []
        return copies

    def take_cached_prefix(self, seq: HashedSequence) -> int:
        """Never a hit (prefix caching is off for hybrid models; module docstring)."""
        return 0

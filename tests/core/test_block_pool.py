"""Block pool and KV cache manager invariants under random add / grow / fork / finish / abort / preempt."""

from __future__ import annotations

import random

import pytest

from jaxpaged.core.block_pool import BlockPool
from jaxpaged.core.kv_cache_manager import KVCacheManager, blocks_for, slot_mapping


def check_invariants(pool: BlockPool, kv: KVCacheManager, live: dict[str, int]) -> None:
    assert pool.num_free + pool.num_used == pool.num_blocks
    holders: dict[int, int] = {}
    for seq_id in live:
        for b in kv.block_table(seq_id):
            holders[b] = holders.get(b, 0) + 1
    for b in range(pool.num_blocks):
        assert pool.ref_count(b) == holders.get(b, 0), f"block {b}"
    assert pool.num_used == len(holders)
    for seq_id, tokens in live.items():
        assert len(kv.block_table(seq_id)) >= blocks_for(tokens, kv.block_size)


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_every_block_accounted_for(seed):
    rng = random.Random(seed)
    pool = BlockPool(64)
    kv = KVCacheManager(pool, block_size=4)
    live: dict[str, int] = {}  # seq_id -> tokens it holds slots for
    next_id = 0
    for _ in range(500):
        op = rng.choice(["add", "grow", "grow", "fork", "finish", "abort", "preempt"])
        if op == "add" or not live:
            seq_id, next_id = f"s{next_id}", next_id + 1
            n = rng.randint(1, 40)
            if kv.allocate_slots(seq_id, 0, n):
                live[seq_id] = n
            else:
                assert kv.block_table(seq_id) == []  # a refusal takes nothing
                kv.free(seq_id)
        elif op == "grow":
            seq_id = rng.choice(list(live))
            before = pool.num_free
            n = rng.randint(1, 12)
            if kv.allocate_slots(seq_id, live[seq_id], n):
                live[seq_id] += n
            else:
                assert pool.num_free == before
        elif op == "fork":
            parent = rng.choice(list(live))
            child, next_id = f"s{next_id}", next_id + 1
            kv.fork(parent, child)
            live[child] = live[parent]
        else:  # finish, abort and preempt all hand the blocks back at once
            seq_id = rng.choice(list(live))
            kv.free(seq_id)
            del live[seq_id]
        check_invariants(pool, kv, live)
    for seq_id in list(live):
        kv.free(seq_id)
    assert pool.num_free == pool.num_blocks
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))


def test_double_free_and_sharing_a_free_block_are_refused():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        pool.free(blocks[:1])
    with pytest.raises(ValueError, match="free"):
        pool.share(blocks[:1])
    assert pool.allocate(5) is None and pool.num_free == 4


def test_shared_block_returns_only_when_last_holder_frees():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, block_size=4)
    assert kv.allocate_slots("a", 0, 10)
    kv.fork("a", "b")
    assert pool.num_used == 3
    kv.free("a")
    assert pool.num_used == 3
    kv.free("b")
    assert pool.num_used == 0


def test_slots_follow_the_block_table():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, block_size=4)
    assert kv.allocate_slots("a", 0, 3)
    assert kv.allocate_slots("b", 0, 2)
    assert kv.allocate_slots("a", 3, 6)  # grows into two more blocks
    table = kv.block_table("a")
    want = [table[p // 4] * 4 + p % 4 for p in range(2, 9)]
    assert slot_mapping(kv.block_table("a"), 2, 7, 4).tolist() == want


def test_first_write_into_a_shared_partial_block_copies_it():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, block_size=4)
    assert kv.allocate_slots("p", 0, 6)  # blocks [a, b], b holds positions 4-5
    a, b = kv.block_table("p")
    kv.fork("p", "c")
    assert pool.ref_count(b) == 2
    assert kv.allocate_slots("c", 6, 1)  # c writes position 6, inside the shared block b
    c_table = kv.block_table("c")
    assert c_table[0] == a and c_table[1] != b
    assert kv.take_copies() == [(b, c_table[1])]  # b's computed positions move with it
    assert pool.ref_count(b) == 1 and pool.ref_count(a) == 2
    assert kv.allocate_slots("p", 6, 1)  # the last holder writes in place
    assert kv.block_table("p") == [a, b] and kv.take_copies() == []


def test_take_changed_names_a_table_after_every_change_and_only_then():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, block_size=4)
    assert kv.take_changed() == set()
    assert kv.allocate_slots("p", 0, 6) and kv.take_changed() == {"p"}
    assert kv.allocate_slots("p", 6, 1) and kv.take_changed() == set()  # room left in its last block: no change
    assert kv.allocate_slots("p", 7, 2) and kv.take_changed() == {"p"}  # a new block
    kv.fork("p", "c")
    assert kv.take_changed() == {"c"}
    before = list(kv.block_table("c"))
    assert kv.allocate_slots("c", 9, 1)  # writes into the shared partial block: copy-on-write replaces it in place
    assert kv.block_table("c") != before and len(kv.block_table("c")) == len(before)
    assert kv.take_changed() == {"c"}
    kv.free("c")
    assert kv.take_changed() == {"c"}
    assert kv.allocate_slots("c", 0, 1) and kv.take_changed() == {"c"}  # a new table


def test_prefix_cache_lookup_register_and_eviction():
    class Seq:
        def __init__(self, seq_id, tokens):
            self.seq_id, self.tokens, self.num_computed_tokens = seq_id, tokens, 0
            self.num_tokens = len(tokens)

        def block_hashes(self, block_size, count):
            from jaxpaged.core.kv_cache_manager import hash_block

            hashes = []
            for i in range(count):
                hashes.append(hash_block(hashes[-1] if hashes else None, self.tokens[i * block_size : (i + 1) * block_size]))
            return hashes

    pool = BlockPool(6)
    kv = KVCacheManager(pool, block_size=2)
    first = Seq("x", [1, 2, 3, 4, 5])
    assert kv.take_cached_prefix(first) == 0
    assert kv.allocate_slots("x", 0, 5)
    first.num_computed_tokens = 5
    kv.register_full_blocks(first)  # blocks [1,2] and [3,4] are full; [5] is not
    assert pool.num_cached == 2
    kv.free("x")
    assert pool.num_free == 6  # cached blocks count as free
    same_prefix = Seq("y", [1, 2, 3, 4, 9])
    assert kv.take_cached_prefix(same_prefix) == 4
    assert len(kv.block_table("y")) == 2 and pool.num_free == 4
    other = Seq("z", [1, 7, 3, 4, 5])  # differs in the first block, so the chain breaks at once
    assert kv.take_cached_prefix(other) == 0
    kv.free("y")
    kv.free("z")
    assert kv.allocate_slots("w", 0, 12)  # takes every block: the cache is evicted
    assert pool.num_cached == 0
    kv.free("w")
    assert kv.take_cached_prefix(Seq("v", [1, 2, 3, 4, 5])) == 0


@pytest.mark.parametrize("window", [None, 6])
def test_the_registration_shortcut_skips_no_full_block(window):
    """register_full_blocks passes over a sequence that has filled no block since its last call (one lookup, as the
    scheduler calls it for every sequence every step). After every step of growing, lagging (async: known tokens
    behind computed ones), preemptions and restarts, a manager with the shortcut and one without it
    hold the same cached blocks."""
    from jaxpaged.core.kv_cache_manager import hash_block

    class Seq:
        def __init__(self, seq_id, tokens):
            self.seq_id, self.tokens, self.num_computed_tokens = seq_id, tokens, 0

        def block_hashes(self, block_size, count):
            hashes = []
            for i in range(count):
                hashes.append(hash_block(hashes[-1] if hashes else None, self.tokens[i * block_size : (i + 1) * block_size]))
            return hashes

    class AlwaysDue(dict):  # the shortcut's memory, answering "due now" for every sequence
        def get(self, key, default=None):
            return 0

    rng = random.Random(0)
    pools = [BlockPool(400), BlockPool(400)]
    fast, full = (KVCacheManager(pool, block_size=4, sliding_window=window) for pool in pools)
    full._register_due = AlwaysDue()
    seqs = [Seq(f"s{i}", [rng.randrange(50) for _ in range(120)]) for i in range(6)]
    skipped = 0
    for step in range(300):
        seq = rng.choice(seqs)
        n = rng.choice([1, 1, 1, 3, 7])
        if seq.num_computed_tokens + n > len(seq.tokens) or rng.random() < 0.03:  # preempted, or done: start over
            fast.free(seq.seq_id), full.free(seq.seq_id)
            seq.num_computed_tokens = 0
            continue
        assert fast.allocate_slots(seq.seq_id, seq.num_computed_tokens, n)
        assert full.allocate_slots(seq.seq_id, seq.num_computed_tokens, n)
        seq.num_computed_tokens += n
        for other in seqs:  # every scheduled sequence, each step: most have nothing new
            if other.num_computed_tokens:
                known = max(0, other.num_computed_tokens - rng.choice([0, 0, 1]))
                skipped += min(other.num_computed_tokens, known) < fast._register_due.get(other.seq_id, 4)
                fast.register_full_blocks(other, known)
                full.register_full_blocks(other, known)
        assert pools[0].num_cached == pools[1].num_cached, step
        for other in seqs:
            assert fast.block_table(other.seq_id) == full.block_table(other.seq_id)
    assert skipped > 1000  # the shortcut was taken

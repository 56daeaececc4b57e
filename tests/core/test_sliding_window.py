"""Sliding-window freeing in the KV cache manager: blocks go back exactly when they leave the earliest query's
window, released entries hold NULL_BLOCK, forks keep shared blocks by reference count, the prefix cache never
serves a released block, and every block comes back; chunked local attention (Llama 4) frees the same way from its
chunk's first position. Then the attention implementations: a placeholder's contents never change a result. Last,
KV cache groups over one pool (kv_cache_coordinator.py)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.core.block_pool import BlockPool
from jaxpaged.core.kv_cache_coordinator import KVCacheCoordinator, kv_groups, layer_groups, layer_localities
from jaxpaged.core.kv_cache_manager import (
    NULL_BLOCK, Chunked, KVCacheManager, first_needed, freeing_window, hash_block, max_blocks_held,
)  # fmt: skip
from jaxpaged.core.request import ParentRequest, Request, RequestStatus
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.pallas_kernels import AttentionMetadata, AttentionSpec, stack_new_kv, write_kv
from jaxpaged.pallas_kernels.reference import naive_paged_attention, reference_paged_attention
from jaxpaged.sampling_params import SamplingParams
from tests.attention_cases import random_case

BS = 4


class Seq:
    def __init__(self, seq_id: str, tokens: list[int]):
        self.seq_id, self.tokens, self.num_computed_tokens = seq_id, tokens, 0
        self.num_tokens = len(tokens)

    def block_hashes(self, block_size: int, count: int) -> list[bytes]:
        hashes: list[bytes] = []
        for i in range(count):
            hashes.append(hash_block(hashes[-1] if hashes else None, self.tokens[i * block_size : (i + 1) * block_size]))
        return hashes


def _check_table(kv: KVCacheManager, seq_id: str, first_query: int, window: int) -> None:
    """Every block a query from first_query on can see is held; every one before that window is a placeholder."""
    table, released = kv.block_table(seq_id), kv.num_released(seq_id)
    assert released == max(0, (first_query - window + 1) // BS)
    assert table[:released] == [NULL_BLOCK] * released
    lowest_seen = max(0, first_query - window + 1)  # the earliest position the earliest query sees
    assert released <= lowest_seen // BS
    assert all(kv.pool.ref_count(b) >= 1 for b in table[released:])


def test_freeing_window_needs_every_layer_windowed():
    assert freeing_window(()) is None
    assert freeing_window((8, None, 8)) is None  # a global layer reads every block
    assert freeing_window((8, 8, 8)) == 8
    assert freeing_window((4, 16)) == 16  # what no layer sees any more


@pytest.mark.parametrize("window", [1, 4, 6, 9])
def test_decode_releases_blocks_exactly_as_they_leave_the_window(window):
    pool = BlockPool(64, enable_caching=False)
    kv = KVCacheManager(pool, BS, window)
    for c in range(60):
        before = kv.num_released("s")
        assert kv.allocate_slots("s", c, 1)
        _check_table(kv, "s", c, window)
        moved = kv.take_changed() == {"s"} and c > 0
        # the table changes only when a block is added or released: once per block_size tokens each
        assert moved == (c % BS == 0 and c > 0 or kv.num_released("s") != before)
        assert pool.num_used == len(kv.held_blocks("s")) <= max_blocks_held(c + 1, BS, window, 1)
    assert len(kv.held_blocks("s")) <= -(-window // BS) + 1
    kv.free("s")
    assert pool.num_free == pool.num_blocks


def test_a_chunked_prefill_keeps_what_its_earliest_query_sees():
    window = 10
    pool = BlockPool(64, enable_caching=False)
    kv = KVCacheManager(pool, BS, window)
    c = 0
    for n in [7, 13, 1, 20, 3, 1, 1, 30]:
        assert kv.allocate_slots("s", c, n)
        _check_table(kv, "s", c, window)
        assert len(kv.block_table("s")) * BS >= c + n
        assert len(kv.held_blocks("s")) <= max_blocks_held(c + n, BS, window, n)
        c += n
    kv.free("s")
    assert pool.num_free == pool.num_blocks


def test_forked_blocks_go_back_when_the_last_holder_lets_go():
    window = 6
    pool = BlockPool(64, enable_caching=False)
    kv = KVCacheManager(pool, BS, window)
    for c in range(14):
        kv.allocate_slots("p", c, 1)
    parent_before = list(kv.block_table("p"))
    kv.fork("p", "c")
    assert kv.block_table("c") == parent_before and kv.num_released("c") == kv.num_released("p")
    assert all(pool.ref_count(b) == 2 for b in kv.held_blocks("p"))
    used = pool.num_used
    for c in range(14, 30):  # the parent moves on: the child still holds what the parent releases
        kv.allocate_slots("p", c, 1)
    for b in parent_before[kv.num_released("c") :]:
        assert pool.ref_count(b) >= 1
    shared_left = [b for b in kv.held_blocks("c") if b in kv.held_blocks("p")]
    assert not shared_left  # the parent wrote into a copy of the shared partial block and released the rest
    assert pool.num_used > used
    for c in range(14, 40):  # now the child: its old blocks reach zero holders and go back
        kv.allocate_slots("c", c, 1)
    assert all(pool.ref_count(b) == 1 for b in kv.held_blocks("c") + kv.held_blocks("p"))
    assert pool.num_used == len(kv.held_blocks("c")) + len(kv.held_blocks("p"))
    kv.free("p")
    kv.free("c")
    assert pool.num_free == pool.num_blocks


def test_a_block_released_before_it_was_registered_is_never_cached():
    """Async scheduling registers a step's blocks after the next step is formed, which may already release them."""
    window = 5
    pool = BlockPool(32)
    kv = KVCacheManager(pool, BS, window)
    seq = Seq("a", list(range(100, 140)))
    assert kv.allocate_slots("a", 0, 24)
    seq.num_computed_tokens = 24
    assert kv.allocate_slots("a", 24, 8)  # releases blocks 0..4 (24 - 5 + 1 = 20) before they are registered
    assert kv.num_released("a") == 5
    kv.register_full_blocks(seq, 24)
    assert pool.num_cached == 1  # block 5 alone: no placeholder, no released block was registered
    assert pool.lookup(seq.block_hashes(BS, 6)[5]) == kv.block_table("a")[5]
    kv.free("a")
    assert pool.num_free == pool.num_blocks


def test_the_prefix_cache_serves_only_the_window_of_the_first_new_token():
    window = 6
    pool = BlockPool(12)
    kv = KVCacheManager(pool, BS, window)
    tokens = list(range(1, 34))  # 33 tokens: 8 full blocks
    a = Seq("a", tokens)
    for c in range(len(tokens)):  # decode-like, registering as it goes (so released blocks were registered first)
        assert kv.allocate_slots("a", c, 1)
        a.num_computed_tokens = c + 1
        kv.register_full_blocks(a)
    kv.free("a")
    assert pool.num_free == pool.num_blocks and pool.num_cached == 8
    # Evict the oldest cached blocks: the first new token still finds the blocks its window needs.
    assert kv.allocate_slots("filler", 0, 4 * BS)
    kv.free("filler")
    b = Seq("b", tokens)
    hit = kv.take_cached_prefix(b)
    assert hit == 8 * BS
    first = (hit - window + 1) // BS
    assert kv.num_released("b") == first and kv.block_table("b")[:first] == [NULL_BLOCK] * first
    for i, block in enumerate(kv.held_blocks("b"), start=first):  # the blocks served hold b's tokens
        assert pool.lookup(b.block_hashes(BS, i + 1)[i]) == block and pool.ref_count(block) == 1
    assert kv.allocate_slots("b", hit, 1) and kv.num_released("b") == first
    kv.free("b")
    # Evict everything: nothing is served any more.
    assert kv.allocate_slots("filler", 0, pool.num_blocks * BS)
    kv.free("filler")
    assert kv.take_cached_prefix(Seq("c", tokens)) == 0
    kv.free("c")
    assert pool.num_free == pool.num_blocks


def test_a_hit_needs_every_block_inside_the_window():
    window = 9
    pool = BlockPool(16)
    kv = KVCacheManager(pool, BS, window)
    tokens = list(range(50, 75))  # 25 tokens: 6 full blocks
    a = Seq("a", tokens)
    assert kv.allocate_slots("a", 0, len(tokens))
    a.num_computed_tokens = len(tokens)
    kv.register_full_blocks(a)
    hashes = a.block_hashes(BS, 6)
    table = list(kv.block_table("a"))
    kv.free("a")
    # block 4 evicted: hits at 6 and 5 blocks need it (their first queries see from 16 and 12); one at 4 needs 2..3
    pool._free.move_to_end(table[4], last=False)
    assert kv.allocate_slots("x", 0, 1)
    assert pool.lookup(hashes[4]) is None
    b = Seq("b", tokens)
    assert kv.take_cached_prefix(b) == 4 * BS
    assert kv.num_released("b") == (4 * BS - window + 1) // BS == 2
    kv.free("b")
    kv.free("x")
    assert pool.num_free == pool.num_blocks


def test_a_chunk_frees_what_its_earliest_query_no_longer_sees():
    """Chunked local attention (10-position chunks, not whole blocks): decode and chunked prefill release exactly the
    blocks wholly before the earliest query's chunk, and hold at most a chunk's blocks plus a step's."""
    chunk = Chunked(10)
    pool = BlockPool(64, enable_caching=False)
    kv = KVCacheManager(pool, BS, chunk)
    c = 0
    for n in [1] * 25 + [7, 13, 1, 20, 3, 1, 1, 30]:
        assert kv.allocate_slots("s", c, n)
        released = kv.num_released("s")
        assert released == c // 10 * 10 // BS  # the earliest query sees from its chunk's first position on
        assert kv.block_table("s")[:released] == [NULL_BLOCK] * released
        assert len(kv.block_table("s")) * BS >= c + n
        assert pool.num_used == len(kv.held_blocks("s")) <= max_blocks_held(c + n, BS, chunk, n)
        c += n
    assert max_blocks_held(1000, BS, chunk, 16) == max_blocks_held(1000, BS, 10, 16)  # a chunk reads back as a window
    kv.free("s")
    assert pool.num_free == pool.num_blocks


def test_a_chunked_group_takes_a_prefix_hit_from_its_chunk_on():
    """Beside a global group, a chunked one holds a hit's blocks from the first new token's chunk on only."""
    pool = BlockPool(40)
    kv = KVCacheCoordinator(pool, BS, [None, Chunked(12)])
    tokens = list(range(1, 34))  # 8 full blocks
    a = Seq("a", tokens)
    for c in range(len(tokens)):
        assert kv.allocate_slots("a", c, 1)
        assert kv.groups[1].num_released("a") == c // 12 * 12 // BS
        a.num_computed_tokens = c + 1
        kv.register_full_blocks(a)
    kv.free("a")
    b = Seq("b", tokens)
    assert kv.take_cached_prefix(b) == 8 * BS
    assert kv.groups[1].num_released("b") == 6  # the first new token (32) is in the chunk from 24: block 6 on
    assert len(kv.groups[0].held_blocks("b")) == 8 and len(kv.groups[1].held_blocks("b")) == 2
    kv.free("b")
    assert pool.num_free == pool.num_blocks


def test_llama4_layers_make_a_chunked_group():
    """layer_localities: Llama 4's chunked layers (options "chunked_layers", "chunk_size") beside its global ones."""

    class Config:  # what layer_localities reads of a ModelConfig
        num_layers, sliding_windows = 4, ()

        def __init__(self, **options):
            self.option = lambda name, default=None: options.get(name, default)

    llama4 = Config(chunk_size=12, chunked_layers=(0, 1, 3))
    assert layer_localities(llama4) == (Chunked(12), Chunked(12), None, Chunked(12))
    groups = kv_groups(layer_localities(llama4), 4)
    assert groups.windows == (Chunked(12),) * 3 + (None,) and groups.layers == ((0,), (1,), (3,), (2,))
    assert layer_localities(Config()) == () and kv_groups((), 4) is None


def _request(name: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    group = ParentRequest(name, None, prompt, params)
    req = Request(name, group, 0, prompt, params, max_tokens, seed=0)
    group.sequences.append(req)
    return req


@pytest.mark.parametrize("caching", [False, True])
def test_scheduler_with_a_small_pool_preempts_and_gets_every_block_back(caching):
    """Long windowed sequences in a pool far smaller than their histories: each step's tables hold every block its
    queries see, preemption recomputes, and the pool is full again at the end."""
    window, budget = 9, 12
    pool = BlockPool(8, enable_caching=caching)  # 4 prompts of 6 fit; decoding, each grows to 4 blocks
    kv = KVCacheManager(pool, BS, window)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget)
    rng = np.random.default_rng(0)
    reqs = [_request(f"r{i}", [int(t) for t in rng.integers(0, 5, 6)], 50) for i in range(4)]
    for r in reqs:
        sched.add(r)
    for _ in range(600):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        for item in out.scheduled:
            table = kv.block_table(item.request.seq_id)
            lowest = max(0, item.start - window + 1)
            visible = table[lowest // BS : -(-(item.start + item.num_tokens) // BS)]
            assert all(pool.ref_count(b) >= 1 for b in visible)
        held = [b for r in sched.running for b in kv.held_blocks(r.seq_id)]
        assert pool.num_used == len(set(held))
        sched.update(out, [3] * len(out.scheduled), {})
    assert all(r.status == RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 50 for r in reqs)
    assert sched.num_preemptions > 0  # 4 sequences of 56 tokens: 56 blocks without freeing
    assert pool.num_free == pool.num_blocks


# -- attention: placeholders' contents never matter ----------------------------------------------------------------


def _with_placeholders(case, window, block_size, poison):
    """The case's tables with every block wholly before each sequence's earliest query's window (a Chunked: its
    chunk) replaced by NULL_BLOCK, as the manager releases them, and that block filled with `poison` (another
    sequence's data would be any finite values)."""
    tables = np.asarray(case.attn_metadata.block_tables).copy()
    seq_lens = np.asarray(case.attn_metadata.seq_lens)
    qsl = np.asarray(case.attn_metadata.query_start_loc)
    replaced = 0
    for i, n in enumerate(seq_lens):
        q_len = qsl[i + 1] - qsl[i]
        if n == 0:
            continue
        gone = first_needed(window, int(n - q_len)) // block_size
        tables[i, :gone] = NULL_BLOCK
        replaced += gone
    cache = case.kv_cache.at[:, :, NULL_BLOCK].set(poison)
    md = AttentionMetadata(case.attn_metadata.slot_mapping, jnp.asarray(tables), case.attn_metadata.seq_lens,
                           case.attn_metadata.query_start_loc)  # fmt: skip
    return cache, md, replaced


def _placeholder_case(seed: int, spec=AttentionSpec(0.25, 11)):
    rng = np.random.default_rng(seed)
    case = random_case(rng, seq_lens=[120, 9, 70, 40], q_lens=[1, 9, 13, 1], num_heads=4, num_kv_heads=2, head_dim=16,
                       block_size=8)  # fmt: skip
    written = write_kv(case.kv_cache, stack_new_kv([(case.k, case.v)]), case.attn_metadata.slot_mapping)
    return case, np.asarray(naive_paged_attention(case.q, written, 0, case.attn_metadata, spec))


@pytest.mark.parametrize("poison", [1e4, -3e4, 3e38])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_placeholder_contents_never_change_the_reference(poison, batch_invariant):
    """The reference reads every block up to the longest context and masks: a masked score is -inf before the
    softmax, so another sequence's (finite) data in a placeholder weighs exactly zero, bit for bit."""
    case, want = _placeholder_case(5)
    spec = AttentionSpec(0.25, 11)
    cache, md, replaced = _with_placeholders(case, 11, 8, poison)
    assert replaced > 0
    n = case.num_real_tokens
    attend = lambda cache, md: np.asarray(  # noqa: E731
        reference_paged_attention(case.q, case.k, case.v, cache, 0, md, spec, batch_invariant=batch_invariant)
    )
    got = attend(cache, md)
    np.testing.assert_array_equal(got[:n], attend(case.kv_cache, case.attn_metadata)[:n])
    np.testing.assert_allclose(got[:n], want[:n], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kernel", ["native", "gpu", "tpu"])
def test_placeholder_contents_never_change_the_kernels(kernel):
    """Finite contents (another sequence's K/V) weigh exactly zero in every kernel; the CPU and TPU kernels start
    each sequence at the first block its earliest query's window reaches, so not even inf/NaN there matters (the
    GPU kernel reads whole key tiles and masks, like the reference). The same with 20-position chunks (chunked local
    attention) and the blocks a chunked group releases."""
    from jaxpaged.pallas_kernels.gpu_attention import gpu_paged_attention
    from jaxpaged.pallas_kernels.tpu_attention import tpu_paged_attention
    from jaxpaged.platforms.cpu import attention as cpu_attention

    if kernel == "native" and not cpu_attention.available():
        pytest.skip("the native CPU kernel is not built here")
    run = {"native": cpu_attention.cpu_paged_attention, "gpu": functools.partial(gpu_paged_attention, interpret=True),
           "tpu": functools.partial(tpu_paged_attention, interpret=True)}[kernel]  # fmt: skip
    # (seeds whose block 0, the placeholder, is no sequence's visible block: poisoning it changes no live data)
    for spec, local, seed in [(AttentionSpec(0.25, 11), 11, 6), (AttentionSpec(0.25, chunk_size=20), Chunked(20), 7)]:
        case, want = _placeholder_case(seed, spec)
        n = case.num_real_tokens
        clean = np.asarray(run(case.q, case.k, case.v, case.kv_cache, 0, case.attn_metadata, spec))
        np.testing.assert_allclose(clean[:n], want[:n], atol=1e-5, rtol=0)
        for poison in [3e38] + ([] if kernel == "gpu" else [float("nan"), float("inf")]):
            cache, md, replaced = _with_placeholders(case, local, 8, poison)
            assert replaced > 0
            got = np.asarray(run(case.q, case.k, case.v, cache, 0, md, spec))
            np.testing.assert_array_equal(got[:n], clean[:n])


# -- KV cache groups over one pool (hybrid models) ------------------------------------------------------------------


def test_layer_groups_have_equally_many_layers():
    gemma3 = ([1024] * 5 + [None]) * 8
    groups = layer_groups(gemma3, 48)
    assert [w for w, _ in groups] == [1024] * 5 + [None]
    assert all(len(layers) == 8 for _, layers in groups)
    assert sorted(layer for _, layers in groups for layer in layers) == list(range(48))
    assert layer_groups((), 4) == [(None, (0, 1, 2, 3))]
    assert layer_groups((16,) * 4, 4) == [(16, (0, 1, 2, 3))]
    assert layer_groups((None, 8, 8, None, 8, 8), 6) == [(None, (0, 3)), (8, (1, 2)), (8, (4, 5))]


def test_groups_share_one_pool_and_allocate_all_or_nothing():
    window = 6
    pool = BlockPool(14, enable_caching=False)
    kv = KVCacheCoordinator(pool, BS, [None, window])
    c = 0
    while kv.allocate_slots("s", c, 1):
        global_table, local_table = kv.block_table("s")
        assert len(kv.groups[0].held_blocks("s")) == len(global_table) == c // BS + 1  # global: everything
        _check_table(kv.groups[1], "s", c, window)  # local: its window
        assert pool.num_used == len(kv.held_blocks("s"))
        c += 1
    # the pool ran dry at a block boundary: nothing was taken, by either group
    assert c % BS == 0 and pool.num_used == len(kv.held_blocks("s"))
    assert len(kv.block_table("s")[0]) == c // BS and len(kv.block_table("s")[1]) == c // BS
    assert c // BS > pool.num_blocks // 2  # the local group's releases served the global group's growth
    kv.fork("s", "t")
    kv.free("s")
    kv.free("t")
    assert pool.num_free == pool.num_blocks


def test_groups_agree_on_a_prefix_hit():
    window = 6
    pool = BlockPool(40)
    kv = KVCacheCoordinator(pool, BS, [None, window])
    tokens = list(range(1, 34))  # 8 full blocks
    a = Seq("a", tokens)
    for c in range(len(tokens)):
        assert kv.allocate_slots("a", c, 1)
        a.num_computed_tokens = c + 1
        kv.register_full_blocks(a)
    global_blocks = list(kv.block_table("a")[0])
    kv.free("a")
    b = Seq("b", tokens)
    assert kv.take_cached_prefix(b) == 8 * BS  # every group has what it needs
    assert kv.groups[1].num_released("b") == (8 * BS - window + 1) // BS
    kv.free("b")
    # the global group loses block 5: the hit shrinks to 5 blocks for both groups
    pool._free.move_to_end(global_blocks[5], last=False)
    assert kv.allocate_slots("x", 0, 1)
    c = Seq("c", tokens)
    assert kv.take_cached_prefix(c) == 5 * BS
    assert len(kv.block_table("c")[0]) == 5 and kv.block_table("c")[1][: kv.groups[1].num_released("c")] == [NULL_BLOCK] * 3
    kv.free("c")
    kv.free("x")
    assert pool.num_free == pool.num_blocks


def test_scheduler_over_groups_gets_every_block_back():
    pool = BlockPool(16)
    kv = KVCacheCoordinator(pool, BS, [None, 9, 9])
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=12)
    rng = np.random.default_rng(1)
    reqs = [_request(f"r{i}", [int(t) for t in rng.integers(0, 5, 6)], 14) for i in range(4)]
    for r in reqs:
        sched.add(r)
    for _ in range(400):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        held = [b for r in sched.running for b in kv.held_blocks(r.seq_id)]
        assert pool.num_used == len(set(held))
        sched.update(out, [3] * len(out.scheduled), {})
    assert all(r.status == RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 14 for r in reqs)
    assert sched.num_preemptions > 0
    assert pool.num_free == pool.num_blocks

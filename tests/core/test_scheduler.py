"""The scheduler's policy alone, over a fake KV cache manager that only counts blocks: token budget, sequence cap,
chunked prefill, decode rows first, FIFO admission, preemption of the newest when the pool runs dry, and every
block back at the end. No model, no JAX."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxpaged.core.request import ParentRequest, Request, RequestStatus
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.sampling_params import SamplingParams

BLOCK = 4


class FakeKV:
    """A pool of `num_blocks` blocks of BLOCK tokens; allocate_slots grows a sequence's table or says no."""

    block_size = BLOCK

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.tables: dict[str, int] = {}

    @property
    def used(self) -> int:
        return sum(self.tables.values())

    def allocate_slots(self, seq_id: str, num_computed: int, num_new: int) -> bool:
        need = math.ceil((num_computed + num_new) / BLOCK) - self.tables.get(seq_id, 0)
        if need > self.num_blocks - self.used:
            return False
        self.tables[seq_id] = self.tables.get(seq_id, 0) + max(need, 0)
        return True

    def block_table(self, seq_id: str) -> list[int]:
        return list(range(self.tables.get(seq_id, 0)))

    def take_changed(self) -> set[str]:
        return set(self.tables)  # every table, every step: the scheduler sends those of running sequences

    def free(self, seq_id: str) -> None:
        self.tables.pop(seq_id, None)

    def take_cached_prefix(self, request: Request) -> int:
        return 0

    def count_prefix_query(self, num_tokens: int, hit: int) -> None:
        pass

    def take_copies(self) -> list[tuple[int, int]]:
        return []

    def register_full_blocks(self, request: Request, num_known: int | None = None) -> None:
        pass


def _request(name: str, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    group = ParentRequest(name, None, list(range(prompt_len)), params)
    req = Request(name, group, 0, list(range(prompt_len)), params, max_tokens, seed=0)
    group.sequences.append(req)
    return req


def _run_step(sched: Scheduler, out) -> None:
    """What the engine does with a step's results: every sampling sequence gets token 7 (and finishes at max_tokens)."""
    sched.update(out, [7] * len(out.scheduled), {})


def test_budget_cap_chunking_and_order():
    kv = FakeKV(num_blocks=1000)
    sched = Scheduler(kv, max_num_seqs=3, max_num_batched_tokens=16)
    reqs = [_request("a", 10, 4), _request("b", 20, 4), _request("c", 3, 4), _request("d", 3, 4)]
    for r in reqs:
        sched.add(r)

    out = sched.schedule()  # a's whole prompt (10), then b's first 6 of 20: the budget of 16
    assert [(s.request.seq_id, s.start, s.num_tokens, s.samples) for s in out.scheduled] == [("a", 0, 10, True), ("b", 0, 6, False)]
    _run_step(sched, out)

    out = sched.schedule()  # a decodes (1, first), b continues its prompt (14), c's prompt (3) is cut to the last 1
    assert [(s.request.seq_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("c", 1), ("b", 14)]
    assert [r.seq_id for r in sched.running] == ["a", "b", "c"] and [r.seq_id for r in sched.waiting] == ["d"]
    assert out.num_tokens <= 16
    _run_step(sched, out)

    for _ in range(50):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert out.num_tokens <= 16 and len(sched.running) <= 3
        assert [s.num_tokens > 1 for s in out.scheduled] == sorted(s.num_tokens > 1 for s in out.scheduled)  # decode rows first
        _run_step(sched, out)
    assert all(len(r.output_token_ids) == 4 and r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert kv.used == 0  # every block back


def test_a_dry_pool_preempts_the_newest_and_it_is_recomputed():
    kv = FakeKV(num_blocks=6)  # 24 tokens
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    old, new = _request("old", 8, 12), _request("new", 8, 12)
    sched.add(old)
    sched.add(new)
    _run_step(sched, sched.schedule())  # both prompts: 4 blocks
    preempted_at = None
    for step in range(40):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        if out.preempted:
            assert [r.seq_id for r in out.preempted] == ["new"] and preempted_at is None
            assert new.status == RequestStatus.WAITING and new.num_computed_tokens == 0 and "new" not in kv.tables
            assert [s.request.seq_id for s in out.scheduled] == ["old"]
            preempted_at = step
        assert kv.used <= kv.num_blocks
        _run_step(sched, out)
    assert preempted_at is not None and sched.num_preemptions == 1 and new.num_preemptions == 1
    assert len(old.output_token_ids) == len(new.output_token_ids) == 12  # the preempted one finished too
    assert kv.used == 0


def test_finishing_a_waiting_request_frees_it_and_nothing_else():
    kv = FakeKV(num_blocks=100)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64)
    a, b = _request("a", 5, 3), _request("b", 5, 3)
    sched.add(a)
    sched.add(b)
    _run_step(sched, sched.schedule())
    assert sched.running == [a] and list(sched.waiting) == [b]  # the sequence cap
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert not sched.waiting and b.status == RequestStatus.FINISHED_ABORTED and kv.tables == {"a": 2}


class _Counting(Scheduler):
    """Counts the updates that fall back to the row-wise path."""

    row_wise_updates = 0

    def _update_rows(self, *args):
        self.row_wise_updates += bool(args[0].scheduled)  # (an empty step's output has no columns)
        return super()._update_rows(*args)


class _RowWise(Scheduler):
    """The definition: every update takes its rows one by one."""

    def update(self, output, sampled_tokens, stop_strings):
        self.num_computed_tokens_total += output.num_tokens
        self.finished_items = []
        return self._update_rows(output, sampled_tokens, stop_strings)


@pytest.mark.parametrize("quiet", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_bulk_update_equals_the_row_wise_update(overlap, quiet):
    """The update that takes most rows' tokens as arrays (only possible stops and filled blocks row by row) ends the
    same sequences with the same tokens and reasons, and registers the same blocks, as the row-wise one, through EOS
    with min_tokens, stop ids, length limits, preemptions and prefix hits; overlap schedules step N + 1 before N's
    tokens are taken, as async scheduling does. quiet: the sequences decode in the DecodeLanes (advanced and filled
    as arrays), against a scheduler without them. A row's token depends on its sequence and output index alone, as a
    model's would, so that rows may come in another order."""
    from jaxpaged.core.block_pool import BlockPool
    from jaxpaged.core.kv_cache_manager import KVCacheManager

    choices = [2, 5, 7] + list(range(8, 20))

    def tokens_for(output):
        return [choices[(int(item.request.seq_id) * 7 + item.num_output_tokens * 13) % len(choices)] for item in output.scheduled]

    def run(cls):
        pool = BlockPool(40)
        sched = cls(KVCacheManager(pool, BLOCK), max_num_seqs=6, max_num_batched_tokens=24, eos_token_ids=[2, 5],
                    max_model_len=70, decode_lanes=cls is _Counting)  # fmt: skip
        most_in_lanes = 0
        rng = np.random.default_rng(0)
        reqs, common = [], rng.integers(6, 30, 12).tolist()
        for i in range(16):
            params = SamplingParams(max_tokens=int(rng.integers(3, 40)), min_tokens=int(rng.integers(0, 4)),
                                    ignore_eos=i % 5 == 0, stop_token_ids=[7] if i % 4 == 1 else None)  # fmt: skip
            prompt = (common if i % 3 == 0 else []) + rng.integers(6, 30, int(rng.integers(1, 30))).tolist()
            group = ParentRequest(str(i), None, prompt, params)
            req = Request(str(i), group, 0, prompt, params, min(params.max_tokens, 70 - len(prompt)), seed=0, quiet=quiet)
            group.sequences.append(req)
            reqs.append(req)
            sched.add(req)
        in_flight, registered, slot_tables = None, [], {}
        while sched.has_unfinished() or in_flight is not None:
            out = sched.schedule() if sched.has_unfinished() else None
            if out is not None and out.scheduled:  # the tables the columns carry, replayed, are the manager's
                if out.columns.appended is not None:  # (the lanes' new blocks: an entry each, before whole tables)
                    for slot, index, block in zip(*(column.tolist() for column in out.columns.appended)):
                        assert len(slot_tables[slot]) == index
                        slot_tables[slot].append(block)
                slot_tables.update((slot, list(table)) for slot, table in out.columns.tables)
                for item in out.scheduled:
                    assert slot_tables[item.request.slot] == sched.kv.block_table(item.request.seq_id)
            done = in_flight if overlap else out
            if done is not None:
                # mostly ordinary ids, some EOS and stop ids
                sched.update(done, tokens_for(done) + [0] * 8, {})
                registered.append(pool.num_cached)
            in_flight = out if overlap else None
            most_in_lanes = max(most_in_lanes, sched.lanes.count if sched.lanes is not None else 0)
        assert pool.num_free == pool.num_blocks
        if cls is _Counting:  # every update was in bulk
            assert sched.row_wise_updates == 0
            assert (most_in_lanes >= 3) == quiet and (sched.lanes.count == 0)
        outcome = [(r.output_token_ids, r.status, r.stop_reason) for r in reqs]
        return outcome, (registered if not quiet else None), max(registered), sched.num_preemptions

    bulk, row_wise = run(_Counting), run(_RowWise)
    # (the lanes' rows lead a step, so with them the steps' make-up, and the blocks registered by each, can differ)
    assert bulk[:2] == row_wise[:2]
    assert bulk[3] > 0 and bulk[2] > 0  # preemptions, and blocks registered
    statuses = {status for _, status, _ in bulk[0]}
    assert statuses == {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH}


def test_longrope_recomputes_a_short_sequence_past_the_switch_with_its_own_hashes():
    """Phi-3's rule (core/rope_regime.py): a sequence computed in the short regime is recomputed, in the same step,
    from scratch when its length passes the switch; not counted as a preemption; its block hashes rooted anew, so
    blocks it registered short are never its (or a long sequence's) prefix hits; a prompt past the switch starts long."""
    from jaxpaged.core.block_pool import BlockPool
    from jaxpaged.core.kv_cache_manager import KVCacheManager
    from jaxpaged.core.rope_regime import LengthDependentRope

    kv = KVCacheManager(BlockPool(64, enable_caching=True), BLOCK)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, rope=LengthDependentRope("longrope", 10, True))
    short, long = _request("short", 8, 6), _request("long", 12, 2)
    sched.add(short)
    sched.add(long)
    out = sched.schedule()
    assert (short.rope_key, long.rope_key) == (b"", b"rope:long")
    short_hashes = list(short.block_hashes(BLOCK, 2))
    _run_step(sched, out)  # the prompt: 9 tokens
    _run_step(sched, sched.schedule())  # 10
    _run_step(sched, sched.schedule())  # 11, its 10 computed in the short regime (each step's length was <= 10)
    assert short.num_computed_tokens == 10 and short.rope_key == b""
    out = sched.schedule()  # 11 > 10: the whole sequence again, after the long-regime blocks of the same tokens
    # (its first 8 are long's first 8, computed long), not after its own short ones (still cached)
    assert [(s.request.seq_id, s.start, s.num_tokens) for s in out.scheduled if s.request is short] == [("short", 8, 3)]
    assert short.rope_key == b"rope:long" and sched.num_rope_recomputes == 1 and sched.num_preemptions == 0
    assert short.block_hashes(BLOCK, 2) == long.block_hashes(BLOCK, 2) != short_hashes
    assert kv.prefix_cache_hits == 8
    _run_step(sched, out)
    for _ in range(10):
        if sched.has_unfinished():
            _run_step(sched, sched.schedule())
    assert len(short.output_token_ids) == 6 and sched.num_rope_recomputes == 1  # once

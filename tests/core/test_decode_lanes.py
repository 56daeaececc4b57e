"""The scheduler's DecodeLanes (core/decode_lanes.py): quiet decoding sequences advanced and filled as arrays, with
every Request still reading true, the same outputs as without them, and no per-row object in a plain decode step.
No model, no JAX."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged.core import scheduler as scheduler_module
from jaxpaged.core.block_pool import BlockPool
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.request import PLACEHOLDER, ParentRequest, Request, RequestStatus
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.sampling_params import SamplingParams

BLOCK = 4


def _requests(n: int, *, quiet: bool = True, max_tokens: int = 30, prompt_len: int = 5) -> list[Request]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = []
    for i in range(n):
        prompt = [10 + (i + k) % 50 for k in range(prompt_len)]
        parent = ParentRequest(str(i), None, prompt, params)
        req = Request(str(i), parent, 0, prompt, params, max_tokens, seed=i, quiet=quiet)
        parent.sequences.append(req)
        out.append(req)
    return out


def _token(item) -> int:
    """A row's token from its sequence and output index alone, as a model's would be."""
    return 20 + (int(item.request.seq_id) * 7 + item.num_output_tokens * 3) % 40


def _step(sched: Scheduler, in_flight):
    """One step with async scheduling: the next is formed before this one's tokens are taken."""
    out = sched.schedule() if sched.has_unfinished() else None
    if in_flight is not None:
        sched.update(in_flight, [_token(item) for item in in_flight.scheduled], {})
    return out if out is not None and out.scheduled else None


def _scheduler(num_seqs: int, blocks: int = 200, lanes: bool = True, step_tokens: int = 64) -> Scheduler:
    kv = KVCacheManager(BlockPool(blocks, enable_caching=True), BLOCK)
    return Scheduler(kv, max_num_seqs=num_seqs, max_num_batched_tokens=step_tokens, eos_token_ids=[2], decode_lanes=lanes)


def test_members_read_true_and_leave_when_their_list_is_read():
    """Counts read from the lanes leave a member in them; its output list (or a write) takes it out, with its
    in-flight token a PLACEHOLDER and the others the tokens sampled; it joins again once it decodes plainly."""
    sched = _scheduler(4)
    reqs = _requests(4)
    for req in reqs:
        sched.add(req)
    step = None
    for _ in range(6):
        step = _step(sched, step)
    assert sched.lanes.count == 4
    req = reqs[1]
    assert req._lanes is not None
    computed, in_flight = req.num_computed_tokens, req.num_in_flight  # (read from the lanes: it stays)
    assert req._lanes is not None and in_flight == 1 and computed == len(req.prompt_token_ids) + 6 - 1
    assert sched.kv_stats()["kv_token_utilization"] > 0 and sched.lanes.count == 4  # (stats leave the lanes alone)
    outputs = list(req.output_token_ids)
    assert req._lanes is None and sched.lanes.count == 3
    assert outputs[-1] == PLACEHOLDER and PLACEHOLDER not in outputs[:-1] and len(outputs) == 6
    step = _step(sched, step)
    assert req._lanes is not None  # back in
    assert req.output_token_ids[:5] == outputs[:5] and req.output_token_ids[5] != PLACEHOLDER


@pytest.mark.parametrize("overlap", [False, True])
def test_outputs_and_blocks_equal_a_scheduler_without_lanes(overlap):
    """Same tokens, reasons and prefix-cache registrations with and without the lanes, through preemptions (a pool
    too small for all), blocks filling and length ends, with async scheduling (overlap) and without; every block back."""

    def run(lanes: bool):
        sched = _scheduler(6, blocks=24, lanes=lanes)
        reqs = _requests(10, max_tokens=25)
        reqs += _requests(3, quiet=False, max_tokens=12)  # some streamed (never in the lanes) beside them
        for i, req in enumerate(reqs[10:]):
            req.seq_id = req.parent.request_id = str(10 + i)
        for req in reqs:
            sched.add(req)
        most, in_flight = 0, None
        while sched.has_unfinished() or in_flight is not None:
            out = sched.schedule() if sched.has_unfinished() else None
            done = in_flight if overlap else out
            if done is not None and done.scheduled:
                sched.update(done, [_token(item) for item in done.scheduled], {})
            in_flight = out if overlap else None
            most = max(most, sched.lanes.count if sched.lanes is not None else 0)
        assert sched.kv.pool.num_free == sched.kv.pool.num_blocks
        return [(r.output_token_ids, r.status) for r in reqs], sched.kv.pool.num_cached, sched.num_preemptions, most

    with_lanes, without = run(True), run(False)
    assert with_lanes[:2] == without[:2]
    assert with_lanes[3] >= 3 and without[3] == 0
    assert all(status == RequestStatus.FINISHED_LENGTH for _, status in with_lanes[0])


def test_a_plain_decode_step_makes_no_object_per_row(monkeypatch):
    """At 64 decoding rows, schedule and update make a ScheduledSequence only for the rows someone asks for (here
    none: no row ends), and the lanes hold every sequence."""
    made = []
    original = scheduler_module.ScheduledSequence

    class Counted(original):
        __slots__ = ()

        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    sched = _scheduler(64, blocks=2000, step_tokens=512)
    for req in _requests(64, max_tokens=200, prompt_len=8):
        sched.add(req)
    step = None
    for _ in range(4):
        step = _step(sched, step)
    monkeypatch.setattr(scheduler_module, "ScheduledSequence", Counted)
    for _ in range(8):
        out = sched.schedule()
        assert out.columns.host_tokens.shape == (64,) and out.scheduled.num_decode == 64
        sched.update(step, np.array([20] * 64), {})
        step = out
    assert made == [] and sched.lanes.count == 64


def test_lanes_are_off_for_windows_and_on_request():
    """A manager with a window (it frees blocks behind it) says nothing of how far a sequence can write."""
    kv = KVCacheManager(BlockPool(10), BLOCK, sliding_window=8)
    assert Scheduler(kv, 4, 64).lanes is None
    assert Scheduler(KVCacheManager(BlockPool(10), BLOCK), 4, 64, decode_lanes=False).lanes is None


@pytest.mark.parametrize("overlap", [False, True])
def test_aborts_mid_flight_leave_the_same_outputs_and_every_block(overlap):
    """Sequences aborted while in the lanes (with a step in flight under async scheduling) end with the tokens taken
    so far, as without the lanes; the rows of theirs still in flight are dropped; every block comes back."""

    def run(lanes: bool):
        sched = _scheduler(8, blocks=300, lanes=lanes)
        reqs = _requests(12, max_tokens=40)
        for req in reqs:
            sched.add(req)
        in_flight, step = None, 0
        while sched.has_unfinished() or in_flight is not None:
            step += 1
            out = sched.schedule() if sched.has_unfinished() else None
            for victim in (reqs[step % 12],) if step % 7 == 0 else ():
                if not victim.finished:
                    sched.finish(victim, RequestStatus.FINISHED_ABORTED)
            done = in_flight if overlap else out
            if done is not None and done.scheduled:
                live = sched.update(done, [_token(item) for item in done.scheduled], {})
                assert all(not item.request.finished or item in sched.finished_items for item in live)
            in_flight = out if overlap else None
        assert sched.kv.pool.num_free == sched.kv.pool.num_blocks and (sched.lanes is None or sched.lanes.count == 0)
        return [(r.output_token_ids[: r.num_sampled_tokens], r.status) for r in reqs]

    with_lanes, without = run(True), run(False)
    assert with_lanes == without
    assert sum(status == RequestStatus.FINISHED_ABORTED for _, status in with_lanes) >= 3


def test_the_lanes_run_beside_a_chunked_prefill_with_blocks_to_spare():
    """A long prompt prefilled in chunks beside four lane members, in a pool that ends the prefill with 1 block
    free: the lanes keep their rows first (decode rows first, the chunk gets the budget left) in every step, since
    the pool can cover what the chunk asks for (counted exactly, not by a worst case)."""
    sched = _scheduler(5, blocks=45, step_tokens=16)
    decoding = _requests(4, max_tokens=200)
    for req in decoding:
        sched.add(req)
    step = None
    for _ in range(4):
        step = _step(sched, step)
    assert sched.lanes.count == 4
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = list(range(20, 120))
    long = Request("99", ParentRequest("99", None, prompt, params), 0, prompt, params, 4, seed=0)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < len(prompt) and not sched.num_preemptions:
        out = sched.schedule()
        chunks.append((sched.lanes.count, [item.num_tokens for item in out.scheduled]))  # (a fallback releases them)
        sched.update(step, [_token(item) for item in step.scheduled], {})
        step = out
    assert not sched.num_preemptions and long.num_computed_tokens == len(prompt) and len(chunks) >= 8
    assert all(count == 4 and rows[:4] == [1, 1, 1, 1] and rows[4] <= 12 for count, rows in chunks)
    assert sched.kv.pool.num_free <= 2  # (the pool was nearly full at the end)



def test_long_decodes_move_their_tokens_into_their_lists_on_the_way(monkeypatch):
    """A lane holds 8 blocks' worth of tokens beyond its list: sequences decoding 100 tokens in blocks of 4 move
    them into their lists (flush) several times, and end with the tokens and cached blocks of a run without lanes."""
    from jaxpaged.core.decode_lanes import DecodeLanes

    flushed = []
    flush = DecodeLanes.flush
    monkeypatch.setattr(DecodeLanes, "flush", lambda self, slots: (flushed.append(len(slots)), flush(self, slots)))

    def run(lanes: bool):
        sched = _scheduler(3, blocks=200, lanes=lanes)
        reqs = _requests(3, max_tokens=100)
        for req in reqs:
            sched.add(req)
        step = _step(sched, None)
        while step is not None:
            step = _step(sched, step)
        return [(r.output_token_ids, r.status) for r in reqs], sched.kv.pool.num_cached

    with_lanes = run(True)
    assert sum(flushed) >= 6
    assert with_lanes == run(False)

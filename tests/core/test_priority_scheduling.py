"""scheduling_policy "priority" (vLLM's) in the scheduler alone: admission by (priority, arrival), a shortage preempting
the least urgent running sequence (under fcfs the newest), equal priorities exactly as fcfs, and outputs unchanged.
A real KV cache manager, so quiet sequences decode in the DecodeLanes. No model, no JAX."""

from __future__ import annotations

from collections import deque

import pytest

from jaxpaged.core.block_pool import BlockPool
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.request import ParentRequest, Request, RequestStatus
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.sampling_params import SamplingParams

BLOCK = 4


def _parent(name: str, priority: int, n: int = 1, prompt_len: int = 6, max_tokens: int = 12) -> list[Request]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt = [10 + (sum(map(ord, name)) + k) % 50 for k in range(prompt_len)]
    parent = ParentRequest(name, None, prompt, params, priority=priority)
    parent.sequences = [Request(f"{name}#{i}" if n > 1 else name, parent, i, prompt, params, max_tokens, seed=i, quiet=True)
                        for i in range(n)]  # fmt: skip
    return parent.sequences


def _request(name: str, priority: int = 0, **kw) -> Request:
    return _parent(name, priority, **kw)[0]


def _scheduler(policy: str, blocks: int = 200, max_num_seqs: int = 4) -> Scheduler:
    kv = KVCacheManager(BlockPool(blocks, enable_caching=True), BLOCK)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, eos_token_ids=[2], policy=policy)


def _token(item) -> int:
    """A row's token from its sequence and output index alone, as a greedy model's would be."""
    return 20 + (sum(map(ord, item.request.seq_id)) * 7 + item.num_output_tokens * 3) % 40


class Run:
    """Steps a scheduler as the engine does, recording admissions (first ones in `admitted`), preemptions and every
    sequence's outputs."""

    def __init__(self, sched: Scheduler):
        self.sched, self.admissions, self.admitted, self.preempted, self.requests = sched, [], [], [], {}

    def add(self, *reqs: Request) -> None:
        for req in reqs:
            self.requests[req.seq_id] = req
            self.sched.add(req)

    def step(self, count: int = 1) -> None:
        for _ in range(count):
            out = self.sched.schedule()
            self.preempted += [req.seq_id for req in out.preempted]
            if out.columns is not None:
                self.admissions += [r.seq_id for r in out.columns.admitted]
                self.admitted += [r.seq_id for r in out.columns.admitted if r.seq_id not in self.admitted]
            self.sched.update(out, [_token(item) for item in out.scheduled], {})

    def finish(self) -> dict[str, list[int]]:
        for _ in range(500):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished() and self.sched.kv.pool.num_used == 0
        assert all(req.status is RequestStatus.FINISHED_LENGTH for req in self.requests.values())
        return {name: list(req.output_token_ids) for name, req in self.requests.items()}


@pytest.mark.parametrize(("policy", "order"), [("priority", ["b", "d", "c", "a", "e"]), ("fcfs", ["a", "b", "c", "d", "e"])])
def test_admission_takes_the_lowest_priority_value_first_then_arrival(policy, order):
    run = Run(_scheduler(policy, max_num_seqs=1))
    run.add(*(_request(name, p) for name, p in zip("abcde", [2, 0, 1, 0, 2])))
    run.finish()
    assert run.admitted == order and run.preempted == []


def test_an_urgent_arrival_jumps_the_queue_but_preempts_nobody_while_blocks_last():
    """As vLLM: a waiting request never preempts; it is admitted ahead of the less urgent ones when a slot frees."""
    run = Run(_scheduler("priority", max_num_seqs=1))
    run.add(_request("a", 1), _request("b", 1))
    run.step(2)
    run.add(_request("u", 0))
    run.finish()
    assert run.admitted == ["a", "u", "b"] and run.preempted == []


def _shortage(policy: str, priorities: tuple[int, int, int]) -> tuple[Run, dict]:
    """Two requests decode, a third arrives two steps later; 11 blocks cannot hold all three at their length (5 each)."""
    run = Run(_scheduler(policy, blocks=11))
    run.add(_request("lo1", priorities[0]), _request("lo2", priorities[1]))
    run.step(2)
    run.add(_request("late", priorities[2]))
    return run, run.finish()


def test_a_shortage_preempts_the_least_urgent_running_request_not_the_newest():
    run, outputs = _shortage("priority", (1, 2, 0))
    assert run.preempted[0] == "lo2" and "late" not in run.preempted
    assert run.requests["late"].num_preemptions == 0 and run.requests["lo2"].num_preemptions >= 1
    fcfs, fcfs_outputs = _shortage("fcfs", (0, 0, 0))
    assert fcfs.preempted[0] == "late"  # fcfs: the most recently admitted, whatever it asked for
    assert outputs == fcfs_outputs  # who waits changes, not what anyone gets


def test_equal_priorities_schedule_exactly_as_fcfs():
    """Same admissions, same victims (the latest arrival among equals), same outputs."""
    prio, prio_outputs = _shortage("priority", (3, 3, 3))
    fcfs, fcfs_outputs = _shortage("fcfs", (0, 0, 0))
    assert prio.preempted and (prio.admitted, prio.preempted) == (fcfs.admitted, fcfs.preempted)
    assert prio_outputs == fcfs_outputs


def test_a_preempted_request_waits_in_its_priority_place():
    """vLLM's PriorityRequestQueue.prepend_request is add_request: the victim queues behind more urgent waiting ones."""
    run = Run(_scheduler("priority", blocks=8, max_num_seqs=2))  # two near their length need 9
    run.add(_request("lo", 2))
    run.step()
    run.add(_request("u", 0))
    run.step()
    run.add(_request("mid", 1))  # no slot: it waits
    for _ in range(30):
        if run.preempted:
            break
        run.step()
    assert run.preempted == ["lo"] and [r.seq_id for r in run.sched.waiting] == ["mid", "lo"]
    run.finish()
    assert run.admissions == ["lo", "u", "mid", "lo"] and run.requests["u"].num_preemptions == 0


def test_samples_of_one_request_share_its_place():
    sched = _scheduler("priority")
    q = _request("q", 1)
    sched.add(q)
    for seq in _parent("p", 0, n=2):
        sched.add(seq)
    sched.add(_request("r", 0))
    assert [req.seq_id for req in sched.waiting] == ["p#0", "p#1", "r", "q"]


def test_fcfs_keeps_the_plain_queues():
    """The fast path is untouched: fcfs schedules over a deque and a list, as before."""
    sched = _scheduler("fcfs")
    assert type(sched.waiting) is deque and type(sched.running) is list and sched.policy == "fcfs"


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        _scheduler("lifo")

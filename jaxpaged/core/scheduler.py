"""Continuous batching at the iteration level: the batch is re-formed every step.

Each step gives running sequences their next token(s) first, oldest first, then admits waiting
ones (FIFO) while the token budget, the sequence cap and the KV pool allow. A prompt longer than
the budget is prefilled in chunks across steps, mixed with other sequences' decode tokens. When
the pool runs dry, the most recently admitted running sequence is preempted: its blocks are
freed at once and it is recomputed from its tokens later (outputs are unchanged, since sampling
depends only on a sequence's own tokens, seed and position). With prefix caching, a sequence
admitted with nothing computed starts after its longest cached prefix, so a preempted one
usually finds most of its own blocks again.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.request import Request, RequestStatus


@dataclasses.dataclass
class ScheduledSequence:
    request: Request
    start: int  # first position fed this step (== num_computed_tokens at scheduling)
    num_tokens: int
    samples: bool = dataclasses.field(init=False)  # reaches the end of the sequence's tokens: yields the next one

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.request.num_tokens  # fixed when scheduled


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_schedulable_tokens, budget)
            if n <= 0:  # held for a fork that happens after this step's results
                i += 1
                continue
            while not self.kv.allocate_slots(req.seq_id, req.num_computed_tokens, n):
                if self._release_idle_holder(exclude=req):
                    i = self.running.index(req)
                    continue
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledSequence(req, req.num_computed_tokens, n))
                budget -= n
                i += 1

        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            fresh = req.num_computed_tokens == 0 and not self.kv.block_table(req.seq_id)
            # prompt logprobs need every prompt position computed, so such a request skips the cache
            hit = self.kv.take_cached_prefix(req) if fresh and req.prompt_logprobs is None else 0
            if fresh:
                req.num_computed_tokens = hit
            n = min(req.num_schedulable_tokens, budget)  # 0: held for a fork, its prefix all cached
            admitted = n <= 0 or self.kv.allocate_slots(req.seq_id, req.num_computed_tokens, n)
            while not admitted and self._release_idle_holder(exclude=req):
                admitted = self.kv.allocate_slots(req.seq_id, req.num_computed_tokens, n)
            if not admitted:
                if fresh:  # hand back what the lookup took
                    self.kv.free(req.seq_id)
                    req.num_computed_tokens = 0
                break
            if fresh:
                self.kv.count_prefix_query(req.num_tokens, hit)
                if req.num_preemptions == 0:
                    req.num_cached_tokens = hit
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if n > 0:
                scheduled.append(ScheduledSequence(req, req.num_computed_tokens, n))
                budget -= n
        # Single-token (decode) sequences first: the attention reads a mixed step's cached context in
        # two row groups split at the sequence slots, and prefill rows then skip decode rows' contexts.
        scheduled.sort(key=lambda item: item.num_tokens > 1)
        return SchedulerOutput(scheduled, preempted)

    def add_forked(self, requests: list[Request]) -> None:
        """Samples forked from a running sequence: first in line, already holding their shared blocks."""
        for req in requests:
            req.status = RequestStatus.WAITING
        self.waiting.extendleft(reversed(requests))

    def _release_idle_holder(self, exclude: Request) -> bool:
        """Free the blocks of one sequence that holds some but cannot progress now, before anything running is preempted.

        First the last queued holder (a forked sample or beam not yet admitted), then a running sequence with
        nothing to compute (a beam waiting for its siblings' candidates), which goes to the back of the queue.
        Both are recomputed when next admitted, mostly from the prefix cache. Without this, sequences that are
        waiting on each other could fill the pool while nothing runs.
        """
        for req in reversed(self.waiting):
            if req is not exclude and self.kv.block_table(req.seq_id):
                self.kv.free(req.seq_id)
                req.num_computed_tokens = 0
                return True
        for req in reversed(self.running):
            idle = req.num_schedulable_tokens <= 0 and not req.num_in_flight  # not merely awaiting its last token
            if req is not exclude and idle and self.kv.block_table(req.seq_id):
                self.running.remove(req)
                self._preempt(req)
                self.waiting.remove(req)
                self.waiting.append(req)  # behind the sequences it is waiting for
                return True
        return False

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.seq_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take a sequence out of scheduling and return its blocks at once."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req.seq_id)

"""Continuous batching at the iteration level: the batch is re-formed every step.

Each step gives running sequences their next token(s) first, oldest first, then admits waiting
ones (FIFO) while the token budget, the sequence cap and the KV pool allow. A prompt longer than
the budget is prefilled in chunks across steps, mixed with other sequences' decode tokens. When
the pool runs dry, the most recently admitted running sequence is preempted: its blocks are
freed at once and it is recomputed from its tokens later (outputs are unchanged, since sampling
depends only on a sequence's own tokens, seed and position). With prefix caching, a sequence
admitted with nothing computed starts after its longest cached prefix, so a preempted one
usually finds most of its own blocks again.

The scheduler is the one owner of the KV cache manager: `schedule()` allocates (and forks held
samples), `update()` takes a step's sampled tokens, registers full blocks and checks stops
(`check_stop`, as vLLM V1's), `fork`/`finish` share and free blocks.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from typing import Any

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.request import PLACEHOLDER, Request, RequestStatus


@dataclasses.dataclass(slots=True)  # a step makes one per row
class ScheduledSequence:
    request: Request
    start: int  # first position fed this step (== num_computed_tokens at scheduling)
    num_tokens: int
    samples: bool = dataclasses.field(init=False)  # reaches the end of the sequence's tokens: yields the next one
    # what the runner needs, fixed when the step is formed (the request moves on before the step runs):
    row: int = dataclasses.field(init=False, default=0)  # its row in the step's sampled outputs
    first_token_row: int = dataclasses.field(init=False, default=0)  # its first row in the step's token rows
    block_table: list[int] = dataclasses.field(init=False, default_factory=list, repr=False)
    table_stamp: int = dataclasses.field(init=False, default=0)  # moves when the block table changes
    num_output_tokens: int = dataclasses.field(init=False, default=0)  # output tokens the request had then
    prev_row: int = dataclasses.field(init=False, default=-1)  # its last input is the previous step's output at this row
    # speculative decoding: proposals fed after its last token, each verified in a sampled row of its own (row + j + 1)
    draft_token_ids: tuple[int, ...] = dataclasses.field(init=False, default=())

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.request.num_tokens  # fixed when scheduled


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    preempted: list[Request]
    block_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst): copy before the step
    sampled_rows: dict[Request, int] = dataclasses.field(default_factory=dict)  # sequences given a token -> row

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


def check_stop(req: Request, token: int, stop_string: str | None, eos_token_ids: Sequence[int], max_model_len: int | None) -> RequestStatus | None:
    """Whether the token just appended ends the sequence (its stop_reason set); the stop string, found by the
    detokenizer, wins over EOS, stop ids and length."""
    params = req.params
    n_out = req.num_sampled_tokens
    if stop_string is not None:
        req.stop_reason = stop_string
        return RequestStatus.FINISHED_STOPPED
    if n_out >= params.min_tokens and not params.ignore_eos and token in eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if n_out >= params.min_tokens and token in params.stop_token_ids:
        req.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if n_out >= req.max_tokens or (max_model_len is not None and len(req.prompt_token_ids) + n_out >= max_model_len):
        return RequestStatus.FINISHED_LENGTH
    return None


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, eos_token_ids: Sequence[int] = (),
        max_model_len: int | None = None,
    ):  # fmt: skip
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._sampled_rows: dict[Request, int] = {}  # the last step's sampling sequences -> their rows
        self.num_computed_tokens_total = 0  # tokens run through the model (prefix-cache hits are not)
        # speculative decoding: proposals for decoding sequences, set before schedule() (jaxpaged/spec_decode/)
        self.draft_tokens: dict[Request, list[int]] = {}

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """The next step: who runs how many tokens, their block tables and the copies to make first.

        The scheduled sequences advance at once (computed tokens, a PLACEHOLDER for each token they will
        sample), so the following step can be formed before this one's results are read.
        """
        self._fork_ready()
        output = self._schedule()
        if not output.scheduled and self._fork_ready():  # a held sample was admitted with its prefix all cached
            output = self._schedule()
        self.draft_tokens = {}
        cursor = row = 0
        kv, prev_rows, sampled_rows = self.kv, self._sampled_rows, output.sampled_rows
        for item in output.scheduled:  # per row: kept to a few lookups (issue 33's host budget)
            req = item.request
            item.row, item.first_token_row, cursor = row, cursor, cursor + item.num_tokens
            row += 1 + len(item.draft_token_ids)
            item.block_table = kv.block_table(req.seq_id)
            item.table_stamp = kv.table_stamp(req.seq_id)
            outputs = req.output_token_ids
            item.num_output_tokens = len(outputs)
            if req.num_in_flight and item.samples:  # its last input is the previous step's output
                item.prev_row = prev_rows[req]
            # the sequence advances at once
            req.num_computed_tokens += item.num_tokens
            if item.samples and not req.is_beam:
                outputs.append(PLACEHOLDER)
                req.num_in_flight += 1
                sampled_rows[req] = item.row
        output.block_copies = kv.take_copies()
        self._sampled_rows = sampled_rows
        return output

    def _schedule(self) -> SchedulerOutput:
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
            drafts = self.draft_tokens.get(req) if self.draft_tokens else None
            verifying = bool(drafts) and n == 1 and budget > len(drafts)  # a decode row verifying proposals: 1 + k tokens
            if verifying:
                n += len(drafts)
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
                item = ScheduledSequence(req, req.num_computed_tokens, n)
                if verifying:
                    item.samples, item.draft_token_ids = True, tuple(drafts)
                scheduled.append(item)
                budget -= n
                i += 1

        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            fresh = req.num_computed_tokens == 0 and not self.kv.block_table(req.seq_id)
            # prompt logprobs need every prompt position computed, so such a request skips the cache
            hit = self.kv.take_cached_prefix(req) if fresh and not req.wants_prompt_logprobs else 0
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
        if self.draft_tokens:
            self._fit_draft_rows(scheduled)
        # Single-token (decode) sequences first: the attention reads a mixed step's cached context in
        # two row groups split at the sequence slots, and prefill rows then skip decode rows' contexts.
        scheduled.sort(key=lambda item: item.num_tokens > 1)
        return SchedulerOutput(scheduled, preempted)

    def _fit_draft_rows(self, scheduled: list[ScheduledSequence]) -> None:
        """A step samples at most max_num_seqs rows: proposals beyond that are dropped (their slots stay allocated
        and are written later)."""
        excess = len(scheduled) + sum(len(item.draft_token_ids) for item in scheduled) - self.max_num_seqs
        for item in reversed(scheduled):
            if excess <= 0:
                return
            cut = min(excess, len(item.draft_token_ids))
            if cut:
                item.draft_token_ids = item.draft_token_ids[: len(item.draft_token_ids) - cut]
                item.num_tokens -= cut
                excess -= cut

    def update(self, output: SchedulerOutput, sampled_tokens: Sequence[int], stop_strings: dict[Request, str]) -> list[ScheduledSequence]:
        """Take a step's results: fill in each sampling sequence's oldest in-flight token, register the blocks
        now full and finish the sequences that stop. Returns the scheduled sequences that were still live."""
        live = []
        self.num_computed_tokens_total += output.num_tokens
        tokens = sampled_tokens.tolist() if hasattr(sampled_tokens, "tolist") else list(sampled_tokens)  # ints, once
        for item in output.scheduled:
            req = item.request
            if req.finished:  # ended by an earlier step, or aborted, while this one ran: its row is dropped
                continue
            live.append(item)
            self.kv.register_full_blocks(req, req.num_tokens - req.num_in_flight)  # one lookup, unless a block filled
            if item.samples and not req.is_beam:
                self._append_token(req, tokens[item.row], stop_strings.get(req) if stop_strings else None)
        return live

    def _append_token(self, req: Request, token: int, stop_string: str | None) -> None:
        n_out = req.num_sampled_tokens + 1
        req.output_token_ids[n_out - 1] = token
        req.num_in_flight -= 1
        status = check_stop(req, token, stop_string, self.eos_token_ids, self.max_model_len)
        if req.grammar is not None:
            # structured outputs: a grammar that has ended (or refused the token, which its mask forbids) is a stop
            accepted = req.grammar.accept(token)
            if (req.grammar.is_terminated or not accepted) and status is not RequestStatus.FINISHED_STOPPED:
                status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = None
        if status is not None:
            del req.output_token_ids[n_out:]  # a token the next step sampled for it (async) is dropped
            req.num_in_flight = 0
            self.finish(req, status)

    def _fork_ready(self) -> bool:
        """Fork the held samples of every first sample that has computed its prompt but the last token."""
        forked = False
        for first in self.running:
            if first.hold_at is None or first.num_computed_tokens < first.hold_at:
                continue
            children = first.parent.unforked
            for child in children:
                self.fork(first, child)
            self.add_forked(children)
            first.parent.unforked, first.hold_at, forked = [], None, True
        return forked

    def fork(self, parent: Request, child: Request) -> None:
        """The child starts where the parent is, sharing its blocks (n > 1 samples, beams); queue it with add_forked."""
        self.kv.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child._block_hashes = list(parent._block_hashes)

    def kv_stats(self) -> dict[str, Any]:
        held: set[int] = set()  # blocks shared by several sequences count once
        stored = 0
        for req in self.running:
            stored += req.num_computed_tokens - self.kv.num_released(req.seq_id) * self.kv.block_size
            held.update(self.kv.held_blocks(req.seq_id))  # a window's released entries are placeholders
        pool, slots = self.kv.pool, len(held) * self.kv.block_size
        return {
            "kv_blocks_total": pool.num_blocks, "kv_blocks_free": pool.num_free, "kv_blocks_used": pool.num_used,
            "kv_blocks_cached": pool.num_cached, "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits, "kv_token_utilization": stored / slots if slots else 0.0,
        }  # fmt: skip

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

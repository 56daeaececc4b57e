"""Continuous batching at the iteration level: the batch is re-formed every step.

Each step gives running sequences their next token(s) first, oldest first, then admits waiting
ones (FIFO) while the token budget, the sequence cap and the KV pool allow. A prompt longer than
the budget is prefilled in chunks across steps, mixed with other sequences' decode tokens. When
the pool runs dry, the most recently admitted running sequence is preempted: its blocks are
freed at once and it is recomputed from its tokens later (outputs are unchanged, since sampling
depends only on a sequence's own tokens, seed and position). With prefix caching, a sequence
admitted with nothing computed starts after its longest cached prefix, so a preempted one
usually finds most of its own blocks again.

Under scheduling_policy "priority" (vLLM's) both queues are kept in (priority, arrival) order instead, lower first:
admissions take the most urgent waiting request, running sequences are served most urgent first, and a shortage
preempts the least urgent running one (the same `running.pop()`), which waits again in its priority's place.

The scheduler is the one owner of the KV cache manager: `schedule()` allocates (and forks held
samples), `update()` takes a step's sampled tokens, registers full blocks and checks stops
(`check_stop`, as vLLM V1's), `fork`/`finish` share and free blocks.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpaged.config import SCHEDULING_POLICY_CHOICES
from jaxpaged.core.decode_lanes import DecodeLanes
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.request import PLACEHOLDER, Request, RequestStatus
from jaxpaged.core.rope_regime import LengthDependentRope


_urgency = operator.attrgetter("parent.priority", "parent.arrival")  # lower first (vLLM's Request.__lt__)


class _PriorityWaiting(deque):
    """The waiting queue under "priority": every way in (add, a preemption's appendleft, forked samples) takes the
    request's (priority, arrival) place, behind its equals, so waiting[0] is the next to admit. fcfs keeps a plain
    deque: none of this is on its path."""

    def append(self, req: Request) -> None:
        bisect.insort_right(self, req, key=_urgency)

    appendleft = append

    def extendleft(self, reqs) -> None:
        for req in reqs:
            self.append(req)


class _PriorityRunning(list):
    """The running list under "priority", in (priority, arrival) order: served most urgent first, so running.pop()
    preempts the least urgent (vLLM's max(running, key=(priority, arrival_time))), never one served earlier in the step."""

    def append(self, req: Request) -> None:
        bisect.insort_right(self, req, key=_urgency)


@dataclasses.dataclass(slots=True)  # a step makes one per row
class ScheduledSequence:
    request: Request
    start: int  # first position fed this step (== num_computed_tokens at scheduling)
    num_tokens: int
    samples: bool = False  # reaches the end of the sequence's tokens: yields the next one
    # what the runner needs, fixed when the step is formed (the request moves on before the step runs):
    row: int = 0  # its row in the step's sampled outputs
    first_token_row: int = 0  # its first row in the step's token rows
    num_output_tokens: int = 0  # output tokens the request had then
    prev_row: int = -1  # its last input is the previous step's output at this row
    # speculative decoding: proposals fed after its last token, each verified in a sampled row of its own (row + j + 1)
    draft_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class StepColumns:
    """The step's rows as arrays, in `scheduled` order, for the consumers that work on whole arrays (the input batch,
    the scheduler's update): per-row Python is what limits a GPU's step rate (issue 33)."""

    slots: np.ndarray  # each row's sequence's slot: its row in the per-sequence arrays kept across steps
    starts: np.ndarray
    counts: np.ndarray
    prev_rows: np.ndarray  # -1: its inputs are on the host
    num_outputs: np.ndarray  # output tokens it had at scheduling (the index of the token it samples, if it does)
    appends: np.ndarray  # bool: samples a token the scheduler appends (not a beam's)
    samples: np.ndarray  # bool: reaches the end of its sequence's tokens (ScheduledSequence.samples)
    host_tokens: np.ndarray  # a decode row's input token where the scheduler holds it in bulk (DecodeLanes), else -1
    admitted: list[Request]  # sequences that took their slot in this step: the per-slot state to set
    tables: list[tuple[int, list[int]]]  # (slot, block table) of the slots whose table changed or is new
    appended: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # (slot, index, block): entries added, written before `tables`
    gens: np.ndarray  # each row's slot's generation at scheduling: the slot changed hands since where it moved on
    drafts: bool  # some row verifies proposals (its sampled rows are not one per scheduled row)


class _Rows:
    """The step's columns and its requests in row order, as schedule() collects them, a row at a time."""

    __slots__ = ("reqs", "slots", "starts", "counts", "prevs", "outs", "appends", "samples", "lanes")

    def __init__(self):
        self.reqs, self.slots, self.starts, self.counts, self.prevs, self.outs = [], [], [], [], [], []
        self.appends, self.samples = [], []
        # the first rows, from DecodeLanes (their requests lead `reqs`): (slots, starts, output counts, prev rows,
        # input tokens known on the host or -1), as arrays
        self.lanes: tuple[np.ndarray, ...] | None = None

    def add(self, req: Request, start: int, count: int, prev: int, num_outputs: int, append: bool, samples: bool) -> None:
        self.reqs.append(req)
        self.slots.append(req.slot)
        self.starts.append(start)
        self.counts.append(count)
        self.prevs.append(prev)
        self.outs.append(num_outputs)
        self.appends.append(append)
        self.samples.append(samples)


class ScheduledRows(Sequence):
    """A step's scheduled sequences, in row order. The running decode rows come first and are kept as the step's
    columns alone: their ScheduledSequence is made when a consumer asks for that row (most steps ask for a few, the
    rows that end or fill a block), since making 1,024 of them cost ~0.4 ms a step (issue 33). The other rows
    (prompts, chunks, proposals) are items from the start."""

    __slots__ = ("requests", "num_decode", "tail", "columns", "_made")

    def __init__(self, decode_requests: list[Request], tail: list[ScheduledSequence]):
        self.requests = decode_requests  # every row's request once schedule() is done (the decode rows' until then)
        self.num_decode = len(decode_requests)
        self.tail = tail
        self.columns: StepColumns | None = None
        self._made: list[ScheduledSequence | None] = [None] * self.num_decode

    def __len__(self) -> int:
        return self.num_decode + len(self.tail)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[j] for j in range(*index.indices(len(self)))]
        k = self.num_decode
        if index < 0:
            index += len(self)
            if index < 0:
                raise IndexError("scheduled row index out of range")
        if index >= k:
            return self.tail[index - k]
        item = self._made[index]
        if item is None:
            c = self.columns
            item = self._made[index] = ScheduledSequence(
                self.requests[index], int(c.starts[index]), 1, bool(c.samples[index]), index, index,
                int(c.num_outputs[index]), int(c.prev_rows[index]),
            )  # fmt: skip
        return item

    def __iter__(self):
        for j in range(self.num_decode):
            yield self[j]
        yield from self.tail


class _Skipping:
    """A step's rows less those dropped by update (their sequences ended before it): what the output processor reads."""

    __slots__ = ("rows", "dropped")

    def __init__(self, rows: Sequence[ScheduledSequence], dropped: list[int]):
        self.rows, self.dropped = rows, set(dropped)

    def __iter__(self):
        dropped = self.dropped
        return (self.rows[j] for j in range(len(self.rows)) if j not in dropped)


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: Sequence[ScheduledSequence]  # Scheduler.schedule's: ScheduledRows
    preempted: list[Request]
    block_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst): copy before the step
    state_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # hybrid models: state slots, likewise
    columns: StepColumns | None = None  # set by Scheduler.schedule (an output built otherwise takes the row-wise paths)
    needs_host_tokens: bool = False  # a sampling row's sampler reads its tokens on the host (a grammar, penalties)
    encoder_work: list = dataclasses.field(default_factory=list)  # images to encode before the step (EncodeWork)

    @property
    def sampled_rows(self) -> dict[Request, int]:
        """Sequences given a token in this step -> its row in the step's sampled tokens."""
        return {item.request: item.row for item in self.scheduled if item.samples and not item.request.is_beam}

    @property
    def num_tokens(self) -> int:
        if self.columns is not None:
            return int(self.columns.counts.sum())
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
        max_model_len: int | None = None, rope: LengthDependentRope | None = None, decode_lanes: bool = True,
        policy: str = "fcfs",
    ):  # fmt: skip
        if policy not in SCHEDULING_POLICY_CHOICES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICY_CHOICES} (got {policy!r})")
        self.policy = policy
        self.kv = kv
        self._states = hasattr(kv, "take_state_copies")  # a hybrid model's state slot per sequence (core/state_slots.py)
        self.rope = rope  # a length-dependent RoPE: each KV's regime, and longrope's recompute past its switch
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = _PriorityWaiting() if policy == "priority" else deque()
        self.running: list[Request] = _PriorityRunning() if policy == "priority" else []
        self.num_preemptions = 0
        self.num_rope_recomputes = 0  # sequences recomputed at longrope's switch (not preemptions)
        self.num_computed_tokens_total = 0  # tokens run through the model (prefix-cache hits are not)
        # speculative decoding: proposals for decoding sequences, set before schedule() (jaxpaged/spec_decode/)
        self.draft_tokens: dict[Request, list[int]] = {}
        # Slots: each running sequence holds one, a row in per-sequence arrays kept across steps (here, and in the
        # runner's input batch), so a step's checks run on whole arrays instead of a Python call per row.
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._by_seq: dict[str, Request] = {}  # seq_id -> the running sequence (holding a slot)
        self._admitted: list[Request] = []  # took a slot since the last step was formed
        self._slot_gen = np.zeros(max_num_seqs, np.int64)  # moves whenever its slot is given up
        self._stop_at = np.zeros(max_num_seqs, np.int64)  # output count at which the sequence ends by length
        self._min_tokens = np.zeros(max_num_seqs, np.int64)
        self._eos_stops = np.zeros(max_num_seqs, bool)  # EOS may end it (not ignore_eos)
        self._bulk = np.zeros(max_num_seqs, bool)  # update may take its tokens in bulk: no beam, grammar or stop ids
        self._host_sampled = np.zeros(max_num_seqs, bool)  # its sampler reads its tokens on the host
        self._eos_ids = np.array(self.eos_token_ids, np.int64)
        self.finished_items: list[ScheduledSequence] = []  # the rows of the last update whose sequences ended in it
        # decoding sequences advanced in bulk (decode_lanes.py): with a KV cache manager that says how far each
        # sequence can write (no window, no groups), without longrope's recompute (and the engine turns them off for
        # speculative decoding, whose proposals need each sequence's tokens every step)
        plain_kv = getattr(kv, "writable", None) is not None and getattr(kv, "sliding_window", None) is None
        use_lanes = decode_lanes and plain_kv and not (rope is not None and rope.recompute_past)
        self.lanes = DecodeLanes(max_num_seqs, 8 * kv.block_size + 4) if use_lanes else None
        self._lane_ok = np.zeros(max_num_seqs, bool)  # may decode in the lanes: quiet, plain sampling, no beam
        # vision-language models: a row covering image tokens needs their embeddings cached or encoded in its step
        # (jaxpaged/multimodal/encoder_cache.py: EncoderScheduler), set by the engine
        self.mm = None
        self.whole_prompts = False  # a bidirectional model's: a prompt is scheduled whole or not at all (never chunked)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _take_slot(self, req: Request) -> None:
        slot = req.slot = self._free_slots.pop()
        self._by_seq[req.seq_id] = req
        self._admitted.append(req)
        if self._states:  # (taken with its first tokens' blocks, or at its fork: fixed while it holds this slot)
            req.state_slot = self.kv.state_slot(req.seq_id)
        params = req.params
        self._stop_at[slot] = req.max_tokens if self.max_model_len is None else min(req.max_tokens, self.max_model_len - len(req.prompt_token_ids))
        self._min_tokens[slot] = params.min_tokens
        self._eos_stops[slot] = not params.ignore_eos
        self._bulk[slot] = not (req.is_beam or req.grammar is not None or params.stop_token_ids)
        self._host_sampled[slot] = req.sampler_reads_tokens
        self._lane_ok[slot] = req.quiet and self._bulk[slot] and not self._host_sampled[slot]

    def _drop_slot(self, req: Request) -> None:
        if req.slot >= 0:
            if req._lanes is not None:
                req._lanes.release(req)
            self._free_slots.append(req.slot)
            del self._by_seq[req.seq_id]
            self._slot_gen[req.slot] += 1
            req.slot = -1

    def schedule(self) -> SchedulerOutput:
        """The next step: who runs how many tokens, their block tables and the copies to make first.

        The scheduled sequences advance at once (computed tokens, a PLACEHOLDER for each token they will
        sample), so the following step can be formed before this one's results are read.
        """
        self._fork_ready()
        if self.mm is not None:
            self.mm.begin()
        rows = _Rows()
        output = self._schedule(rows)
        if not output.scheduled and self._fork_ready():  # a held sample was admitted with its prefix all cached
            output = self._schedule(rows)
        if self.mm is not None:
            output.encoder_work = self.mm.end(bool(output.scheduled))
        drafts = bool(self.draft_tokens)
        self.draft_tokens = {}
        # the rows _schedule did not advance itself (all but running decode rows): admissions, chunks, proposals
        scheduled = output.scheduled
        cursor = row = scheduled.num_decode
        for item in scheduled.tail:
            req = item.request
            n = item.num_tokens
            item.row, item.first_token_row = row, cursor
            cursor += n
            row += 1 + len(item.draft_token_ids)
            outputs = req.output_token_ids
            k = item.num_output_tokens = len(outputs)
            if req.num_in_flight and item.samples:  # its last input is the previous step's output
                item.prev_row = req.sampled_row
            req.num_computed_tokens += n
            append = item.samples and not req.is_beam
            if append:
                outputs.append(PLACEHOLDER)
                req.num_in_flight += 1
                req.sampled_row = item.row
            rows.add(req, item.start, n, item.prev_row, k, append, item.samples)
        if output.scheduled:  # an empty step runs nothing: the slots taken, tables changed and copies wait for the next
            output.block_copies = self.kv.take_copies()
            if self._states:
                output.state_copies = self.kv.take_state_copies()
            output.columns = scheduled.columns = self._columns(rows, drafts)
            scheduled.requests = rows.reqs
            output.needs_host_tokens = bool(self._host_sampled[output.columns.slots[output.columns.appends]].any())
        return output

    def _columns(self, rows: _Rows, drafts: bool) -> StepColumns:
        """The step's columns, with the block tables the runner must copy again: those that changed, and the whole
        table of every sequence that took a slot."""
        kv, tables = self.kv, {}
        for seq_id in kv.take_changed():
            req = self._by_seq.get(seq_id)
            if req is not None:
                tables[req.slot] = kv.block_table(seq_id)
        appended = None
        if self.lanes is not None:  # the lanes' new blocks (KVCacheManager.append_blocks), one entry each
            entries = [(req.slot, index, block) for seq_id, index, block in kv.take_appended()
                       if (req := self._by_seq.get(seq_id)) is not None]  # fmt: skip
            if entries:
                appended = tuple(np.array(column, np.intp) for column in zip(*entries))
        admitted = [req for req in self._admitted if req.slot >= 0]  # not given up again within the step
        self._admitted = []
        for req in admitted:
            tables[req.slot] = kv.block_table(req.seq_id)
        i32 = np.int32
        slots, starts, counts = np.array(rows.slots, np.intp), np.array(rows.starts, i32), np.array(rows.counts, i32)
        prevs, outs = np.array(rows.prevs, i32), np.array(rows.outs, i32)
        appends, samples = np.array(rows.appends, bool), np.array(rows.samples, bool)
        host_tokens = np.full(len(slots), -1, i32)
        if rows.lanes is not None:  # the lanes' rows lead
            lane_slots, lane_starts, lane_outs, lane_prevs, lane_tokens = rows.lanes
            ones = np.ones(len(lane_slots), bool)
            slots, starts = np.concatenate([lane_slots, slots]), np.concatenate([lane_starts.astype(i32), starts])
            counts, prevs = np.concatenate([ones.astype(i32), counts]), np.concatenate([lane_prevs.astype(i32), prevs])
            outs, appends = np.concatenate([lane_outs.astype(i32), outs]), np.concatenate([ones, appends])
            samples, host_tokens = np.concatenate([ones, samples]), np.concatenate([lane_tokens.astype(i32), host_tokens])
        return StepColumns(
            slots, starts, counts, prevs, outs, appends, samples, host_tokens, admitted, list(tables.items()), appended,
            self._slot_gen[slots], drafts,
        )  # fmt: skip

    def _schedule(self, rows: _Rows) -> SchedulerOutput:
        """Who runs, in row order: running sequences first (their decode rows advanced by _advance_running, which
        hands over to the loop below where proposals, a RoPE switch or a shortage of blocks need more), then
        admissions."""
        # Single-token (decode) rows first: the attention reads a mixed step's cached context in two row groups
        # split at the sequence slots, and prefill rows then skip decode rows' contexts. (With proposals, rows keep
        # their order until _fit_draft_rows has cut them, then sort.)
        single: list[ScheduledSequence] = []  # single-token rows other than the decode rows _advance_running took
        multi: list[ScheduledSequence] = []
        preempted: list[Request] = []
        kv, running, draft_tokens = self.kv, self.running, self.draft_tokens
        budget = self.max_num_batched_tokens
        lanes = self.lanes
        if not draft_tokens and lanes is not None and lanes.count:
            if self._lane_rows(rows):
                budget -= len(rows.reqs)
            else:  # the loops take everyone as Requests, in running order: out of the lanes at once
                lanes.release_slots(np.flatnonzero(lanes.member))
        i, budget = (0, budget) if draft_tokens else self._advance_running(rows, multi, budget)
        writable = getattr(kv, "writable", None)  # seq_id -> tokens it can write without allocate_slots (no window)
        recompute_past = self.rope.recompute_past if self.rope is not None else 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.num_schedulable_tokens
            start, num_outputs = req.num_computed_tokens, len(req.output_token_ids)
            if recompute_past and start and not req.rope_key and len(req.prompt_token_ids) + num_outputs > recompute_past:
                self._recompute(running.pop(i))  # its short-regime KV: admitted again below, in the long regime
                continue
            n = min(n, budget)
            if self.mm is not None and req.parent.mm is not None and start < req.parent.mm.end:
                n = self.mm.fit(req, start, n)  # up to an image whose embeddings it cannot have in this step
            if n <= 0:  # held for a fork that happens after this step's results
                i += 1
                continue
            verifying = False
            if draft_tokens:
                drafts = draft_tokens.get(req)
                verifying = bool(drafts) and n == 1 and budget > len(drafts)  # a decode row verifying proposals: 1 + k tokens
                if verifying:
                    n += len(drafts)
            fits = writable is not None and start + n <= writable.get(req.seq_id, 0)
            while not fits and not kv.allocate_slots(req.seq_id, start, n):
                if self._release_idle_holder(exclude=req):
                    i = running.index(req)
                    continue
                victim = running.pop()  # the most recently admitted (under "priority": the least urgent)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                item = ScheduledSequence(req, start, n, start + n == len(req.prompt_token_ids) + num_outputs)
                if verifying:
                    item.samples, item.draft_token_ids = True, tuple(drafts)
                (single if n == 1 or draft_tokens else multi).append(item)
                budget -= n
                i += 1

        while not preempted and self.waiting and budget > 0 and len(running) < self.max_num_seqs:
            req = self.waiting[0]
            fresh = req.num_computed_tokens == 0 and not kv.block_table(req.seq_id)
            if fresh and self.rope is not None:  # the regime its KV will be computed in, before the prefix lookup
                req.set_rope_key(self.rope.key(req.num_tokens, len(req.prompt_token_ids)))
            # prompt logprobs (and MEAN/CLS pooling) need every prompt position computed: such a request skips the cache
            hit = kv.take_cached_prefix(req) if fresh and not req.reads_every_position else 0
            if fresh:
                req.num_computed_tokens = hit
            n = min(req.num_schedulable_tokens, budget)  # 0: held for a fork, its prefix all cached
            if self.whole_prompts and n < req.num_schedulable_tokens:
                break  # (it fits an empty step: max_model_len <= max_num_batched_tokens)
            if n > 0 and self.mm is not None and req.parent.mm is not None and req.num_computed_tokens < req.parent.mm.end:
                n = self.mm.fit(req, req.num_computed_tokens, n)  # 0: it waits for an image's embeddings or span
            admitted = n <= 0 or kv.allocate_slots(req.seq_id, req.num_computed_tokens, n)
            while not admitted and self._release_idle_holder(exclude=req):
                admitted = kv.allocate_slots(req.seq_id, req.num_computed_tokens, n)
            if not admitted:
                if fresh:  # hand back what the lookup took
                    kv.free(req.seq_id)
                    req.num_computed_tokens = 0
                break
            if fresh:
                kv.count_prefix_query(req.num_tokens, hit)
                if req.num_preemptions == 0:
                    req.num_cached_tokens = hit
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            running.append(req)
            self._take_slot(req)
            if n > 0:
                start = req.num_computed_tokens
                (single if n == 1 or draft_tokens else multi).append(ScheduledSequence(req, start, n, start + n == req.num_tokens))
                budget -= n
        tail = single + multi
        if draft_tokens:
            self._fit_draft_rows(tail)
            self._snapshot_states(tail)
            tail.sort(key=lambda item: item.num_tokens > 1)  # (in admission order until here)
        return SchedulerOutput(ScheduledRows(rows.reqs, tail), preempted)  # (schedule() adds the tail's requests to rows)

    def _lane_rows(self, rows: _Rows) -> bool:
        """The lanes' decode rows, advanced in numpy, as the step's first rows (decode rows first, then the others in
        running order with the budget left); False (nothing done) where the step would then run short of blocks for
        the other running sequences (the general loop would preempt one, maybe one given a row here), or of tokens:
        the loops below take the lanes' members then, as Requests, in running order."""
        lanes, kv = self.lanes, self.kv
        slots = np.flatnonzero(lanes.member)
        num_outputs = lanes.num_outputs[slots]
        n = np.where(num_outputs >= lanes.max_tokens[slots], 0, lanes.num_prompt[slots] + num_outputs - lanes.computed[slots])
        full = num_outputs - lanes.listed[slots] >= lanes.width - 1  # (once in width - 1 steps: into its list)
        if full.any():
            lanes.flush(slots[full])
        odd = n > 1  # (never: the loops take it)
        if odd.any():
            lanes.release_slots(slots[odd])
        slots = slots[(n == 1) & ~odd]
        budget = self.max_num_batched_tokens - len(slots)
        if not len(slots) or budget < 0:
            return False
        grow = slots[lanes.computed[slots] >= lanes.capacity[slots]]  # its next token starts a block
        need = len(grow)
        if len(self.running) > lanes.count:  # the others' blocks, as the loop below will ask for them, in order
            for req in self.running:
                if req._lanes is not None:
                    continue
                n = min(req.num_schedulable_tokens, budget)
                if n > 0:
                    need += kv.blocks_needed(req.seq_id, req.num_computed_tokens, n)
                    budget -= n
                    if budget <= 0:
                        break
        if need > kv.pool.num_free:
            return False
        if len(grow):  # (each has written its blocks full, and they are its alone: `writable` is set only then)
            if not kv.append_blocks([lanes.requests[slot].seq_id for slot in grow.tolist()]):
                raise RuntimeError("the KV pool could not give the blocks it was counted to have")
            lanes.capacity[grow] += kv.block_size
        starts, num_outputs, prev = lanes.advance(slots)
        rows.lanes = (slots, starts, num_outputs, prev, np.where(prev < 0, lanes.last_token[slots], -1))
        rows.reqs.extend(operator.itemgetter(*slots.tolist())(lanes.requests) if len(slots) > 1 else [lanes.requests[slots[0]]])
        return True

    def _advance_running(self, rows: _Rows, multi: list[ScheduledSequence], budget: int) -> tuple[int, int]:
        """The running sequences in order, each given what it can compute within the budget, until one needs blocks
        the pool cannot give, proposals are in play or longrope must recompute one: -> (how many were passed, the
        budget left). A decode row is advanced here and kept as columns only (ScheduledRows); a chunk is an item.
        Everything else is _schedule's general loop, which starts where this one stopped. This loop runs for every
        running sequence every step, so its per-row work is inlined and kept to the minimum (issue 33: at 1,024 rows
        a call or an object per row costs ~0.1-0.4 ms a step). The lanes' members have their rows already."""
        kv = self.kv
        writable = getattr(kv, "writable", None)  # seq_id -> tokens it can write without allocate_slots (no window)
        wget = writable.get if writable is not None else (lambda seq_id, default: -1)
        allocate = kv.allocate_slots
        recompute_past = self.rope.recompute_past if self.rope is not None else 0
        images = self.mm
        decode = rows.reqs
        add_req, add_slot, add_start, add_count = decode.append, rows.slots.append, rows.starts.append, rows.counts.append
        add_prev, add_out, add_append, add_samples = rows.prevs.append, rows.outs.append, rows.appends.append, rows.samples.append
        i = 0
        for req in self.running:
            if budget <= 0:
                break
            if req._lanes is not None:
                i += 1
                continue
            # (its fields read and written directly: it is not in the lanes)
            outputs = req._output_token_ids
            num_outputs, start, num_prompt = len(outputs), req._num_computed_tokens, len(req.prompt_token_ids)
            if recompute_past and start and not req.rope_key and num_prompt + num_outputs > recompute_past:
                break
            n = 0 if num_outputs >= req.max_tokens else num_prompt + num_outputs - start  # num_schedulable_tokens
            if req.hold_at is not None:
                n = min(n, req.hold_at - start)
            if n > budget:
                n = budget
            if images is not None and req.parent.mm is not None and start < req.parent.mm.end:
                n = images.fit(req, start, n)  # up to an image whose embeddings it cannot have in this step
            if n <= 0:  # its last token is in flight, or held for a fork that happens after this step's results
                i += 1
                continue
            if start + n > wget(req.seq_id, 0) and not allocate(req.seq_id, start, n):
                break
            samples = start + n == num_prompt + num_outputs
            if n == 1:
                prev = req._sampled_row if req._num_in_flight and samples else -1
                req._num_computed_tokens = start + 1
                append = samples and not req.is_beam
                if append:
                    req._sampled_row = len(decode)
                    outputs.append(PLACEHOLDER)
                    req._num_in_flight += 1
                add_req(req), add_slot(req.slot), add_start(start), add_count(1), add_prev(prev), add_out(num_outputs)
                add_append(append), add_samples(samples)
            else:
                multi.append(ScheduledSequence(req, start, n, samples))
            budget -= n
            i += 1
        return i, budget

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

    def _snapshot_states(self, scheduled: list[ScheduledSequence]) -> None:
        """A hybrid model's verifying sequences: their linear layers' states saved before the step (a rejected guess
        restores them: core/state_slots.py); one whose state cannot be saved verifies nothing this step."""
        snapshot = getattr(self.kv, "snapshot", None)
        if snapshot is None:
            return
        for item in scheduled:
            if item.draft_token_ids and not snapshot(item.request.seq_id):
                item.num_tokens -= len(item.draft_token_ids)
                item.draft_token_ids = ()

    def update(self, output: SchedulerOutput, sampled_tokens: Sequence[int], stop_strings: dict[Request, str]) -> Sequence[ScheduledSequence]:
        """Take a step's results: fill in each sampling sequence's oldest in-flight token, register the blocks
        now full and finish the sequences that stop. Returns the scheduled sequences that were still live; the
        rows among them whose sequences ended are in `finished_items`."""
        self.num_computed_tokens_total += output.num_tokens
        self.finished_items = []
        cols = output.columns
        if cols is None or cols.drafts:
            return self._update_rows(output, sampled_tokens, stop_strings)
        # A row's sampled row is its index. The rows that may end (length, EOS, a stop string), may have filled a
        # block, need more (beams, grammars, stop ids) or whose slot changed hands since (preempted, finished) go
        # through the row-wise path; the others only take their token, in the lanes' arrays or their request's list.
        scheduled = output.scheduled
        tokens = np.asarray(sampled_tokens)[: len(scheduled)]
        slots, appends, n_out = cols.slots, cols.appends, cols.num_outputs + 1
        stale = self._slot_gen[slots] != cols.gens
        may_end = n_out >= self._stop_at[slots]
        if len(self.eos_token_ids):
            eos = tokens == self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else np.isin(tokens, self._eos_ids)
            may_end |= eos & self._eos_stops[slots] & (n_out >= self._min_tokens[slots])
        may_end &= appends
        # a block is registered once its tokens are computed and known: a decode row's known count reaches
        # start + 1 in this update (the tokens before its own sampled one)
        filled = (cols.counts > 1) | ((cols.starts + 1) % self.kv.block_size == 0)
        by_row = may_end | ~self._bulk[slots] | stale
        requests = scheduled.requests
        if stop_strings:
            hit = set(map(id, stop_strings))
            by_row |= np.fromiter((id(req) in hit for req in requests), bool, len(requests))
        lanes = self.lanes
        lane_filled = None  # the lanes' decode rows that filled a block: registered from the lanes, in them
        if lanes is not None and lanes.count:
            lane_filled = filled & ~by_row & lanes.member[slots] & (cols.counts == 1)
            filled &= ~lane_filled
            lanes.release_slots(slots[(by_row | filled) & ~stale & lanes.member[slots]])  # out of the lanes at once
        by_row |= filled
        token_list = tokens.tolist()
        dropped = []
        for j in np.flatnonzero(by_row).tolist():
            item = scheduled[j]
            req = item.request
            if req.finished:  # ended by an earlier step, or aborted, while this one ran: its row is dropped
                dropped.append(j)
                continue
            self._take_row(item, token_list[j], stop_strings.get(req) if stop_strings else None)
        take = appends & ~by_row
        if lanes is not None and lanes.count:
            members = take & lanes.member[slots]
            if members.any():
                lanes.take(slots[members], cols.num_outputs[members], tokens[members])
                take &= ~members
        take = np.flatnonzero(take)
        for req, k, token in zip([requests[j] for j in take.tolist()], cols.num_outputs[take].tolist(), tokens[take].tolist()):
            req._output_token_ids[k] = token  # (not in the lanes)
            req._num_in_flight -= 1
        if lane_filled is not None and lane_filled.any():
            rows = np.flatnonzero(lane_filled)
            # each has computed and knows its tokens up to the one it sampled (block_hashes reads them in the lanes)
            self.kv.register_known_blocks([requests[j] for j in rows.tolist()], (cols.starts[rows] + 1).tolist())
        if lanes is not None:
            self._enter_lanes(requests, np.flatnonzero(appends & ~stale & self._lane_ok[slots] & ~lanes.member[slots]))
        return scheduled if not dropped else _Skipping(scheduled, dropped)

    def _enter_lanes(self, requests: list[Request], rows: np.ndarray) -> None:
        """The rows' sequences that now decode plainly join the lanes: one token to compute next, nothing held."""
        writable, joining = self.kv.writable, []
        for j in rows.tolist():
            req = requests[j]
            if req.finished or req.hold_at is not None or req._lanes is not None:
                continue
            # (decoding: one token to compute; and how far it can write is known, its last block its own)
            if req.num_pending_tokens == 1 and req.seq_id in writable:
                joining.append(req)
        if joining:
            self.lanes.enter(joining, [writable[req.seq_id] for req in joining])

    def _update_rows(self, output: SchedulerOutput, sampled_tokens: Sequence[int], stop_strings: dict[Request, str]) -> list[ScheduledSequence]:
        live = []
        tokens = sampled_tokens.tolist() if hasattr(sampled_tokens, "tolist") else list(sampled_tokens)  # ints, once
        for item in output.scheduled:
            req = item.request
            if req.finished:  # ended by an earlier step, or aborted, while this one ran: its row is dropped
                continue
            live.append(item)
            self._take_row(item, tokens[item.row], stop_strings.get(req) if stop_strings else None)
        return live

    def _take_row(self, item: ScheduledSequence, token: int, stop_string: str | None) -> None:
        """One row of a step's results: the blocks it filled registered, its token taken (a beam's is not) and its
        stops checked."""
        req = item.request
        self.kv.register_full_blocks(req, req.num_tokens - req.num_in_flight)  # one lookup, unless a block filled
        if item.samples and not req.is_beam:
            self._append_token(req, token, stop_string)
            if req.finished:
                self.finished_items.append(item)

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
        if parent._lanes is not None:  # (its blocks stop being its alone: the lanes' capacity would be wrong)
            parent._lanes.release(parent)
        if self.kv.fork(parent.seq_id, child.seq_id) is False:  # a hybrid model with no state slot free: the child
            return  # computes its tokens from scratch
        child.num_computed_tokens = parent.num_computed_tokens
        child.rope_key = parent.rope_key
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
        self._drop_slot(req)
        self.kv.free(req.seq_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _recompute(self, req: Request) -> None:
        """Free a running sequence's KV and queue it first to be computed again from its tokens (a preemption that
        no shortage caused: longrope's switch, where transformers recomputes too)."""
        self._drop_slot(req)
        self.kv.free(req.seq_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1  # (so its readmission keeps num_cached_tokens of its first)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_rope_recomputes += 1

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take a sequence out of scheduling and return its blocks at once."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._drop_slot(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req.seq_id)

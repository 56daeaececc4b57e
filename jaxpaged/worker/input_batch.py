"""A SchedulerOutput as the runner's padded StepInputs: token ids, positions, slots, block tables, sampling rows.

The scheduler hands over each sequence's block table with the step, so the runner never asks
the KV cache manager; everything is padded to the runner's bucket, so a step never recompiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxpaged.core.scheduler import ScheduledSequence, SchedulerOutput
from jaxpaged.pallas_kernels import AttentionMetadata
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.sampler import SamplingMetadata, SamplingRow, bitmask_words, build_sampling_metadata, columns_metadata

if TYPE_CHECKING:
    from jaxpaged.worker.model_runner import ModelRunner


@dataclasses.dataclass
class StepInputs:
    """One step, already padded to its bucket, as numpy arrays."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    attention: AttentionMetadata  # numpy leaves
    logit_rows: np.ndarray  # [S] row of each sequence's last token
    sampling: SamplingMetadata | None  # numpy leaves; None: built later (ModelRunner.sample_later)
    prompt_next_ids: np.ndarray | None = None  # [T] next prompt token of rows whose prompt_logprobs are wanted, else -1
    prev_rows: np.ndarray | None = None  # [T] row of the previous step whose sampled token is this input, else -1
    lora_slots: np.ndarray | None = None  # [T] with enable_lora: each token's adapter slot, -1 for none (and padding)


class _OutputsAtScheduling(Sequence):
    """A request's output ids as they were when its step was formed (later PLACEHOLDERs left out), without a copy."""

    __slots__ = ("ids", "n")

    def __init__(self, ids: list[int], n: int):
        self.ids, self.n = ids, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        return self.ids[: self.n][index]

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.ids[: self.n], dtype=dtype)


_FINISHED_ROW = SamplingParams(temperature=0.0, max_tokens=1)  # a row whose result will be dropped


class InputBatchBuilder:
    """The runner's: its buckets and table width fix every array's shape.

    It works on whole arrays, with per-row Python kept to reading each scheduled sequence's few numbers: block
    tables stay on the host between steps (a row per sequence, copied again only when the KV cache manager's stamp
    for it moves: a new block, a copy-on-write, a fork), and positions, slots and offsets are computed in numpy.
    """

    def __init__(self, runner: ModelRunner, eos_token_ids: Sequence[int], max_suppress: int):
        self.runner = runner
        self.block_size = runner.block_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_suppress = max_suppress  # ids min_tokens may forbid per row
        self.mask_words = bitmask_words(runner.model_config.vocab_size)  # structured outputs' packed bitmask
        # a step holds at most max_num_seqs sequences: twice that many rows never run out within one step
        capacity = 2 * runner.config.max_num_seqs
        self._table_rows = np.zeros((capacity, runner.table_width), np.int32)
        self._rows: dict[object, list[int]] = {}  # request -> [its row in _table_rows, the table stamp it holds]
        self._free_rows = list(range(capacity - 1, -1, -1))
        # with enable_lora: each table row's adapter slot, set when a request takes the row (fixed until it finishes)
        self._row_lora = np.full(capacity, -1, np.int32) if runner.config.enable_lora else None

    def blank(self, num_tokens: int) -> StepInputs:
        """An all-padding step of a bucket's shapes: compiles it and writes nothing."""
        t, s = self.runner.bucket_for(num_tokens)
        attn_metadata = AttentionMetadata(
            slot_mapping=np.full(t, -1, np.int32),
            block_tables=np.zeros((s, self.runner.table_width), np.int32),
            seq_lens=np.zeros(s, np.int32),
            query_start_loc=np.zeros(s + 1, np.int32),
        )
        sampling = build_sampling_metadata([], s, self.runner.history_width, self.max_suppress, self.mask_words)
        return StepInputs(np.zeros(t, np.int32), np.zeros(t, np.int32), attn_metadata, np.zeros(s, np.int32), sampling)

    def _table_rows_of(self, scheduled: Sequence[ScheduledSequence]) -> np.ndarray:
        """Each scheduled sequence's row in _table_rows, its block table brought up to date where it changed."""
        rows = np.empty(len(scheduled), np.intp)
        for j, item in enumerate(scheduled):
            entry = self._rows.get(item.request)
            if entry is None:
                entry = self._rows[item.request] = [self._take_row(scheduled), -1]
                if self._row_lora is not None:
                    self._row_lora[entry[0]] = item.request.parent.lora_slot
            if entry[1] != item.table_stamp:
                table, row = item.block_table, self._table_rows[entry[0]]
                row[: len(table)] = table
                row[len(table) :] = 0
                entry[1] = item.table_stamp
            rows[j] = entry[0]
        return rows

    def _take_row(self, scheduled: Sequence[ScheduledSequence]) -> int:
        if not self._free_rows:  # hand back the rows of every sequence not in this step (finished, or idle)
            current = {item.request for item in scheduled}
            for req in [r for r in self._rows if r not in current]:
                self._free_rows.append(self._rows.pop(req)[0])
        return self._free_rows.pop()

    def build(self, output: SchedulerOutput, with_sampling: bool = True) -> StepInputs:
        t, s = self.runner.bucket_for(output.num_tokens)
        scheduled = output.scheduled
        m = len(scheduled)
        counts = np.fromiter((item.num_tokens for item in scheduled), np.int32, m)
        starts = np.fromiter((item.start for item in scheduled), np.int32, m)
        prev = np.fromiter((item.prev_row for item in scheduled), np.int32, m)
        ends = np.cumsum(counts, dtype=np.int32)
        total = int(ends[-1]) if m else 0

        ids = np.zeros(t, np.int32)
        flat: list[int] = []
        for item in scheduled:
            if item.prev_row >= 0 and item.num_tokens == 1:
                flat.append(0)  # the previous step's output, still on the device (prev_rows)
            elif item.draft_token_ids:  # speculative decoding: its last token, then the proposals it verifies
                flat.extend(item.request.tokens_at(item.start, 1))
                flat.extend(item.draft_token_ids)
            else:
                flat.extend(item.request.tokens_at(item.start, item.num_tokens))
        ids[:total] = flat

        tables = np.zeros((s, self.runner.table_width), np.int32)
        table_rows = self._table_rows_of(scheduled)
        tables[:m] = self._table_rows[table_rows]
        row_of = np.repeat(np.arange(m), counts)
        pos = np.arange(total, dtype=np.int32) + (starts - (ends - counts))[row_of]
        positions = np.zeros(t, np.int32)
        positions[:total] = pos
        slots = np.full(t, -1, np.int32)
        slots[:total] = tables[row_of, pos // self.block_size] * self.block_size + pos % self.block_size
        seq_lens = np.zeros(s, np.int32)
        seq_lens[:m] = starts + counts
        query_start_loc = np.full(s + 1, total, np.int32)
        query_start_loc[0] = 0
        query_start_loc[1 : m + 1] = ends
        logit_rows = np.zeros(s, np.int32)
        drafts = np.fromiter((len(item.draft_token_ids) for item in scheduled), np.int32, m)
        if drafts.any():  # a verifying sequence samples at each of its last 1 + k positions
            per_row = np.repeat(ends - 1 - drafts, 1 + drafts)
            logit_rows[: len(per_row)] = per_row + np.arange(len(per_row)) - np.repeat(np.cumsum(1 + drafts) - 1 - drafts, 1 + drafts)
        else:
            logit_rows[:m] = ends - 1
        prev_rows = None
        if (prev >= 0).any():  # rows whose last token is the previous step's output, still on the device
            prev_rows = np.full(t, -1, np.int32)
            fed = prev >= 0
            prev_rows[ends[fed] - 1] = prev[fed]
        prompt_next = None
        for j, item in enumerate(scheduled):
            req = item.request
            if req.params.prompt_logprobs is None or not req.wants_prompt_logprobs:
                continue
            start, n, prompt_len = item.start, item.num_tokens, len(req.prompt_token_ids)
            if start < prompt_len - 1:
                prompt_next = np.full(t, -1, np.int32) if prompt_next is None else prompt_next
                stop = min(start + n, prompt_len - 1)  # rows that predict a prompt token
                cursor = int(ends[j] - n)
                prompt_next[cursor : cursor + stop - start] = req.prompt_token_ids[start + 1 : stop + 1]
        sampling = self.sampling(output, t) if with_sampling else None
        attn_metadata = AttentionMetadata(slots, tables, seq_lens, query_start_loc)
        lora_slots = None
        if self._row_lora is not None:
            lora_slots = np.full(t, -1, np.int32)
            lora_slots[:total] = np.repeat(self._row_lora[table_rows], counts)
        return StepInputs(ids, positions, attn_metadata, logit_rows, sampling, prompt_next, prev_rows, lora_slots)

    def sampling(self, output: SchedulerOutput, num_tokens: int) -> SamplingMetadata:
        """The step's sampling rows from its requests as they stand: at scheduling, or (deferred) once the previous
        step's tokens are in, when a sequence that finished meanwhile gets a neutral row (its result is dropped)."""
        _, s = self.runner.bucket_for(num_tokens)
        scheduled = output.scheduled
        params = []
        for item in scheduled:  # most steps: every row plain, its metadata built as columns
            req = item.request
            p = req.params
            if (req.finished or item.draft_token_ids or req.grammar is not None or p.has_penalties
                    or item.num_output_tokens < p.min_tokens):  # fmt: skip
                break
            params.append(p)
        else:
            m = len(scheduled)
            return columns_metadata(
                params, np.fromiter((len(item.request.prompt_token_ids) for item in scheduled), np.int32, m),
                np.fromiter((item.num_output_tokens for item in scheduled), np.int32, m),
                [item.request.seed for item in scheduled], s, self.runner.history_width, self.max_suppress, self.mask_words,
            )  # fmt: skip
        rows = []
        for item in output.scheduled:
            req = item.request
            if req.finished:
                rows.extend([SamplingRow(_FINISHED_ROW, (), (), 0)] * (1 + len(item.draft_token_ids)))
                continue
            outputs = req.output_token_ids
            if len(outputs) != item.num_output_tokens:
                outputs = _OutputsAtScheduling(outputs, item.num_output_tokens)
            grammar = req.grammar if item.samples else None  # a chunk that samples nothing needs no mask
            if item.draft_token_ids:  # speculative decoding: row j verifies proposal j; the last is the bonus row
                for j, draft in enumerate((*item.draft_token_ids, -1)):
                    rows.append(SamplingRow(req.params, req.prompt_token_ids, outputs, req.seed, self.eos_token_ids,
                                            None, draft, j))  # fmt: skip
                continue
            rows.append(SamplingRow(req.params, req.prompt_token_ids, outputs, req.seed, self.eos_token_ids, grammar))
        return build_sampling_metadata(rows, s, self.runner.history_width, self.max_suppress, self.mask_words)

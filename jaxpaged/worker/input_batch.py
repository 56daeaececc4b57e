"""A SchedulerOutput as the runner's padded StepInputs: token ids, positions, slots, block tables, sampling rows.

The scheduler hands over each sequence's block table with the step, so the runner never asks
the KV cache manager; everything is padded to the runner's bucket, so a step never recompiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxpaged.core.kv_cache_manager import slot_mapping
from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.pallas_kernels import AttentionMetadata
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.sampler import SamplingMetadata, SamplingRow, bitmask_words, build_sampling_metadata

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
    """The runner's: its buckets and table width fix every array's shape."""

    def __init__(self, runner: ModelRunner, eos_token_ids: Sequence[int], max_suppress: int):
        self.runner = runner
        self.block_size = runner.block_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_suppress = max_suppress  # ids min_tokens may forbid per row
        self.mask_words = bitmask_words(runner.model_config.vocab_size)  # structured outputs' packed bitmask

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

    def build(self, output: SchedulerOutput, with_sampling: bool = True) -> StepInputs:
        t, s = self.runner.bucket_for(output.num_tokens)
        ids = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        slots = np.full(t, -1, np.int32)
        tables = np.zeros((s, self.runner.table_width), np.int32)
        seq_lens = np.zeros(s, np.int32)
        query_start_loc = np.zeros(s + 1, np.int32)
        logit_rows = np.zeros(s, np.int32)
        prompt_next = prev_rows = None
        cursor = 0
        for j, item in enumerate(output.scheduled):
            req, start, n = item.request, item.start, item.num_tokens
            ids[cursor : cursor + n] = req.tokens_at(start, n)
            if item.prev_row >= 0:  # its last token is the previous step's output, still on the device
                prev_rows = np.full(t, -1, np.int32) if prev_rows is None else prev_rows
                prev_rows[cursor + n - 1] = item.prev_row
            positions[cursor : cursor + n] = np.arange(start, start + n, dtype=np.int32)
            slots[cursor : cursor + n] = slot_mapping(item.block_table, start, n, self.block_size)
            tables[j, : len(item.block_table)] = item.block_table
            prompt_len = len(req.prompt_token_ids)
            if req.wants_prompt_logprobs and start < prompt_len - 1:
                prompt_next = np.full(t, -1, np.int32) if prompt_next is None else prompt_next
                stop = min(start + n, prompt_len - 1)  # rows that predict a prompt token
                prompt_next[cursor : cursor + stop - start] = req.prompt_token_ids[start + 1 : stop + 1]
            seq_lens[j] = start + n
            cursor += n
            query_start_loc[j + 1] = cursor
            logit_rows[j] = cursor - 1
        query_start_loc[len(output.scheduled) + 1 :] = cursor
        sampling = self.sampling(output, t) if with_sampling else None
        attn_metadata = AttentionMetadata(slots, tables, seq_lens, query_start_loc)
        return StepInputs(ids, positions, attn_metadata, logit_rows, sampling, prompt_next, prev_rows)

    def sampling(self, output: SchedulerOutput, num_tokens: int) -> SamplingMetadata:
        """The step's sampling rows from its requests as they stand: at scheduling, or (deferred) once the previous
        step's tokens are in, when a sequence that finished meanwhile gets a neutral row (its result is dropped)."""
        rows = []
        for item in output.scheduled:
            req = item.request
            if req.finished:
                rows.append(SamplingRow(_FINISHED_ROW, (), (), 0))
                continue
            outputs = req.output_token_ids
            if len(outputs) != item.num_output_tokens:
                outputs = _OutputsAtScheduling(outputs, item.num_output_tokens)
            grammar = req.grammar if item.samples else None  # a chunk that samples nothing needs no mask
            rows.append(SamplingRow(req.params, req.prompt_token_ids, outputs, req.seed, self.eos_token_ids, grammar))
        _, s = self.runner.bucket_for(num_tokens)
        return build_sampling_metadata(rows, s, self.runner.history_width, self.max_suppress, self.mask_words)

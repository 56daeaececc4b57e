"""A SchedulerOutput as the runner's padded StepInputs: token ids, positions, slots, block tables, sampling rows.

The scheduler hands over each sequence's block table with the step, so the runner never asks
the KV cache manager; everything is padded to the runner's bucket, so a step never recompiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxpaged.core.request import POOL_ALL
from jaxpaged.core.rope_regime import LengthDependentRope
from jaxpaged.core.scheduler import SchedulerOutput, StepColumns
from jaxpaged.pallas_kernels import AttentionMetadata
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.sampler import (
    SamplingMetadata, SamplingRow, _blank, _constants, _seeds_u32, bitmask_words, build_sampling_metadata, columns_metadata,
    constants_metadata,
)  # fmt: skip

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
    state_copies: list = dataclasses.field(default_factory=list)  # hybrid models: (src, dst) state slots, copied first
    mm_rows: np.ndarray | None = None  # [T] vision-language models: the encoder-cache row of each image token, else -1
    mrope_positions: np.ndarray | None = None  # [3, T] M-RoPE models: each token's (t, h, w) position
    pool_rows: np.ndarray | None = None  # [T] a pooling engine's: the row whose pooled sum a token joins, else -1
    pool_tokens: bool = False  # a pooling engine's: some row reads its tokens' hidden states (ALL: the token tasks)
    embeds_mask: np.ndarray | None = None  # [T] enable_prompt_embeds: the positions given as embeddings (None: none)
    prompt_embeds: np.ndarray | None = None  # [T, D] their embeddings (worker/prompt_embeds_inputs.py)


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


class _Unread(Sequence):
    """The output ids of a sequence in the scheduler's DecodeLanes, as a sampler without penalties or a grammar reads
    them: their count alone (reading the request's list would take it out of the lanes)."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        return [-1] * self.n if isinstance(index, slice) else -1

    def __array__(self, dtype=None, copy=None):
        return np.full(self.n, -1, dtype=dtype)


_FINISHED_ROW = SamplingParams(temperature=0.0, max_tokens=1)  # a row whose result will be dropped


class InputBatchBuilder:
    """The runner's: its buckets and table width fix every array's shape.

    It keeps a row per scheduler slot (a running sequence's, fixed while it runs) across steps: its block table,
    copied again only when the scheduler says it changed, and its sampling constants, set when a sequence takes
    the slot. A step is then built from the scheduler's columns in numpy; per-row Python is left to rows whose
    tokens are on the host (prefill chunks, or every row with async scheduling off).
    """

    def __init__(self, runner: ModelRunner, eos_token_ids: Sequence[int], max_suppress: int):
        self.runner = runner
        self.block_size = runner.block_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_suppress = max_suppress  # ids min_tokens may forbid per row
        self.mask_words = bitmask_words(runner.model_config.vocab_size)  # structured outputs' packed bitmask
        slots = runner.config.max_num_seqs
        groups = runner.kv_groups  # KV cache groups: a table per group and slot, and each group's own slots
        self.layer_groups = None if groups is None else groups.layer_groups
        self.num_groups = 1 if groups is None else len(groups.layers)
        self._table_rows = np.zeros((self.num_groups, slots, runner.table_width), np.int32)
        # per slot, set when a sequence takes it: sampling constants (sampler._constants), seed, prompt length and
        # whether its sampling is plain (no penalties, grammar or token controls: built as columns), prompt logprobs,
        # adapter slot
        self._constants = np.zeros((slots, 8), np.float64)
        self._seeds = np.zeros(slots, np.uint32)
        self._prompt_lens = np.zeros(slots, np.int32)
        self._plain = np.zeros(slots, bool)
        self._top = np.zeros(slots, bool)  # truncation (top-k/p, min-p) in a sampled, not greedy, row
        self._logprobs = np.zeros(slots, bool)
        self._prompt_logprobs = np.zeros(slots, bool)
        self._pool_code = np.zeros(slots, np.int8)  # a pooling engine's rows: ParentRequest.pool_code
        # with enable_lora: each slot's adapter slot (fixed until its sequence finishes)
        self._row_lora = np.full(slots, -1, np.int32) if runner.config.enable_lora else None
        # hybrid models: each slot's state slot (fixed while its sequence runs); padded rows get the out-of-range count
        self.num_state_slots = runner.num_state_slots
        self._state_slots = np.zeros(slots, np.int32) if self.num_state_slots else None
        self.rope = LengthDependentRope.of(runner.model_config)  # set: each step carries rows' RoPE lengths
        # vision-language models: each slot's images (its request's MultimodalInputs, or None) and M-RoPE offset
        self.mm = getattr(runner, "mm", None)
        # an is_causal=false pooling model: each row's tokens see its whole chunk (the prompt: never chunked)
        self.bidirectional = bool(runner.model_config.option("bidirectional", False))
        self._slot_mm: list = [None] * slots
        self._slot_images_end = np.zeros(slots, np.int32)  # positions past which its rows hold no image
        self._mrope_delta = np.zeros(slots, np.int32)
        self.embeds = runner.prompt_embeds  # enable_prompt_embeds: each slot's prompt embeddings, a step's rows

    def blank(self, num_tokens: int) -> StepInputs:
        """An all-padding step of a bucket's shapes: compiles it and writes nothing."""
        t, s = self.runner.bucket_for(num_tokens)
        grouped = () if self.layer_groups is None else (self.num_groups,)
        attn_metadata = AttentionMetadata(
            slot_mapping=np.full((*grouped, t), -1, np.int32),
            block_tables=np.zeros((*grouped, s, self.runner.table_width), np.int32),
            seq_lens=np.zeros(s, np.int32),
            query_start_loc=np.zeros(s + 1, np.int32),
            rope_lens=None if self.rope is None else np.zeros(s, np.int32),
            layer_groups=self.layer_groups,
            state_slots=None if self._state_slots is None else np.full(s, self.num_state_slots, np.int32),
        )
        sampling = build_sampling_metadata([], s, self.runner.history_width, self.max_suppress, self.mask_words)
        if self.bidirectional or (self.mm is not None and self.mm.spec.bidirectional):  # (the same packed layout as a step's)
            attn_metadata = dataclasses.replace(attn_metadata, key_ends=np.zeros(t, np.int32))
        return StepInputs(np.zeros(t, np.int32), np.zeros(t, np.int32), attn_metadata, np.zeros(s, np.int32), sampling)

    def _take_slots(self, cols: StepColumns) -> None:
        """The per-slot state of sequences that took a slot, and the block tables that changed."""
        for req in cols.admitted:
            slot, params = req.slot, req.params
            self._constants[slot] = _constants(params)
            self._seeds[slot] = _seeds_u32([req.seed])[0]
            self._prompt_lens[slot] = len(req.prompt_token_ids)
            self._plain[slot] = not req.sampler_reads_request
            self._top[slot] = params.uses_truncation and not params.is_greedy
            self._logprobs[slot] = params.logprobs is not None
            self._prompt_logprobs[slot] = req.wants_prompt_logprobs
            self._pool_code[slot] = req.parent.pool_code
            if self._row_lora is not None:
                self._row_lora[slot] = req.parent.lora_slot
            if self._state_slots is not None:
                self._state_slots[slot] = req.state_slot
            if self.embeds is not None:
                self.embeds.admit(slot, req.parent.prompt_embeds)
            if self.mm is not None:
                mm = req.parent.mm
                self._slot_mm[slot] = mm
                self._slot_images_end[slot] = 0 if mm is None else mm.end
                self._mrope_delta[slot] = 0 if mm is None else mm.mrope_delta
        grouped = self.layer_groups is not None
        if cols.appended is not None:  # single entries first: a table copied whole below is the newer
            slots, index, blocks = cols.appended
            self._table_rows[0, slots, index] = blocks
        for slot, table in cols.tables:  # with groups, a tuple of one table per group (or () for none)
            for g, group_table in enumerate((table or ((),) * self.num_groups) if grouped else (table,)):
                row = self._table_rows[g, slot]
                row[: len(group_table)] = group_table
                row[len(group_table) :] = 0

    def build(self, output: SchedulerOutput, with_sampling: bool = True) -> StepInputs:
        t, s = self.runner.step_bucket(output.num_tokens)
        scheduled, cols = output.scheduled, output.columns
        self._take_slots(cols)
        m = len(scheduled)
        slots, counts, starts, prev = cols.slots, cols.counts, cols.starts, cols.prev_rows
        ends = np.cumsum(counts, dtype=np.int32)
        total = int(ends[-1]) if m else 0

        ids = np.zeros(t, np.int32)
        fed = (prev >= 0) & (counts == 1)  # the previous step's output, still on the device (prev_rows)
        known = cols.host_tokens >= 0  # a decode row's input the scheduler holds in bulk (its DecodeLanes)
        if known.any():
            ids[(ends - counts)[known]] = cols.host_tokens[known]
            fed = fed | known
        for j in np.flatnonzero(~fed).tolist():  # the rows whose tokens are on the host
            item = scheduled[j]
            first = int(ends[j]) - item.num_tokens
            if item.draft_token_ids:  # speculative decoding: its last token, then the proposals it verifies
                ids[first] = item.request.tokens_at(item.start, 1)[0]
                ids[first + 1 : first + 1 + len(item.draft_token_ids)] = item.draft_token_ids
            else:
                ids[first : first + item.num_tokens] = item.request.tokens_at(item.start, item.num_tokens)

        # without KV cache groups the tables are [slots, width] (the group axis of one, indexed away first: the
        # gathers below on 3-D arrays cost ~5% of a step's pack at 1,024 rows)
        table_rows = self._table_rows if self.layer_groups is not None else self._table_rows[0]
        tables = np.zeros((*table_rows.shape[:-2], s, self.runner.table_width), np.int32)
        tables[..., :m, :] = table_rows[..., slots, :]
        row_of = np.repeat(np.arange(m), counts)
        pos = np.arange(total, dtype=np.int32) + (starts - (ends - counts))[row_of]
        positions = np.zeros(t, np.int32)
        positions[:total] = pos
        slot_mapping = np.full((*table_rows.shape[:-2], t), -1, np.int32)
        slot_mapping[..., :total] = tables[..., row_of, pos // self.block_size] * self.block_size + pos % self.block_size
        seq_lens = np.zeros(s, np.int32)
        seq_lens[:m] = starts + counts
        query_start_loc = np.full(s + 1, total, np.int32)
        query_start_loc[0] = 0
        query_start_loc[1 : m + 1] = ends
        logit_rows = np.zeros(s, np.int32)
        if cols.drafts:  # a verifying sequence samples at each of its last 1 + k positions
            drafts = np.fromiter((len(item.draft_token_ids) for item in scheduled), np.int32, m)
            per_row = np.repeat(ends - 1 - drafts, 1 + drafts)
            logit_rows[: len(per_row)] = per_row + np.arange(len(per_row)) - np.repeat(np.cumsum(1 + drafts) - 1 - drafts, 1 + drafts)
        else:
            logit_rows[:m] = ends - 1
        prev_rows = None
        if (prev >= 0).any():  # rows whose last token is the previous step's output, still on the device
            prev_rows = np.full(t, -1, np.int32)
            has_prev = prev >= 0
            prev_rows[ends[has_prev] - 1] = prev[has_prev]
        prompt_next = None
        for j in np.flatnonzero(self._prompt_logprobs[slots]).tolist():
            item = scheduled[j]
            req = item.request
            start, n, prompt_len = item.start, item.num_tokens, len(req.prompt_token_ids)
            if start < prompt_len - 1:
                prompt_next = np.full(t, -1, np.int32) if prompt_next is None else prompt_next
                stop = min(start + n, prompt_len - 1)  # rows that predict a prompt token
                cursor = int(ends[j] - n)
                prompt_next[cursor : cursor + stop - start] = req.prompt_token_ids[start + 1 : stop + 1]
        sampling = None
        if with_sampling:
            sampling = self._plain_sampling(cols, s) if self._is_plain(cols) else self.sampling(output, t)
        rope_lens = None
        if self.rope is not None:
            rope_lens = np.zeros(s, np.int32)
            rope_lens[:m] = self.rope.row_lengths(self._prompt_lens[slots], cols.num_outputs)
        state_slots = None
        if self._state_slots is not None:
            state_slots = np.full(s, self.num_state_slots, np.int32)
            state_slots[:m] = self._state_slots[slots]
        attn_metadata = AttentionMetadata(slot_mapping, tables, seq_lens, query_start_loc, rope_lens, self.layer_groups, state_slots)
        lora_slots = None
        if self._row_lora is not None:
            lora_slots = np.full(t, -1, np.int32)
            lora_slots[:total] = np.repeat(self._row_lora[slots], counts)
        step = StepInputs(ids, positions, attn_metadata, logit_rows, sampling, prompt_next, prev_rows, lora_slots)
        if self.runner.pooling:
            step.pool_rows, step.pool_tokens = self._pool_rows(t, scheduled, self._pool_code[slots], ends)
        if self.mm is not None:
            self._images(step, slots, starts, counts, ends, total, row_of)
        if self.bidirectional:  # every token's last visible key: its row's last in this step
            key_ends = np.zeros(t, np.int32)
            key_ends[:total] = np.repeat(starts + counts - 1, counts)
            step.attention = dataclasses.replace(step.attention, key_ends=key_ends)
        if self.embeds is not None:
            self.embeds.fill(step, slots, starts, counts, ends)
        return step

    @staticmethod
    def _pool_rows(t: int, scheduled, codes: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, bool]:
        """Each token's pooled row: LAST pools the prompt's last position, MEAN every prompt position, CLS the first
        (whichever of them lie in this step's chunk of the row); and whether an ALL row (read from the step's whole
        hidden states, not summed) has prompt positions in this step."""
        pool_rows = np.full(t, -1, np.int32)
        tokens = False
        for j in np.flatnonzero(codes).tolist():
            item = scheduled[j]
            start, n = item.start, item.num_tokens
            first = int(ends[j]) - n  # the chunk's first token row
            lo, hi = item.request.pooled_span()
            lo, hi = max(lo, start), min(hi, start + n)
            if lo < hi and codes[j] == POOL_ALL:
                tokens = True
            elif lo < hi:
                pool_rows[first + lo - start : first + hi - start] = item.row
        return pool_rows, tokens

    def _images(self, step: StepInputs, slots, starts, counts, ends, total: int, row_of) -> None:
        """A vision-language model's per-token arrays (multimodal/runner.py): the rows holding image tokens are few,
        found with numpy; M-RoPE's positions for every row."""
        t = step.input_ids.shape[0]
        with_images = np.flatnonzero(starts < self._slot_images_end[slots]).tolist()
        rows = [(int(ends[j] - counts[j]), self._slot_mm[slots[j]], int(starts[j]), int(counts[j])) for j in with_images]
        deltas = None
        if self.mm.spec.mrope:
            deltas = np.zeros(t, np.int32)
            deltas[:total] = self._mrope_delta[slots][row_of]
        step.mm_rows, key_ends, step.mrope_positions = self.mm.step_arrays(t, step.positions, rows, deltas)
        if key_ends is not None:
            step.attention = dataclasses.replace(step.attention, key_ends=key_ends)

    def _is_plain(self, cols: StepColumns) -> bool:
        """Every row's sampling metadata comes from its slot's constants: no proposals, penalties, grammars, and no
        row still short of its min_tokens (its EOS suppressed)."""
        slots = cols.slots
        return not cols.drafts and bool(self._plain[slots].all()) and bool(
            (cols.num_outputs >= self._constants[slots, 7]).all())

    def _plain_sampling(self, cols: StepColumns, num_rows: int) -> SamplingMetadata:
        """columns_metadata's values, gathered from the slots' constants."""
        slots = cols.slots
        return constants_metadata(
            self._constants[slots], self._seeds[slots], self._prompt_lens[slots], cols.num_outputs, num_rows,
            self.runner.history_width, _blank((num_rows, self.max_suppress)), self.mask_words, any_penalty=False,
            any_top=bool(self._top[slots].any()), want_logprobs=bool(self._logprobs[slots].any()),
        )  # fmt: skip

    def sampling(self, output: SchedulerOutput, num_tokens: int) -> SamplingMetadata:
        """The step's sampling rows from its requests as they stand: at scheduling, or (deferred) once the previous
        step's tokens are in, when a sequence that finished meanwhile gets a neutral row (its result is dropped)."""
        _, s = self.runner.bucket_for(num_tokens)
        scheduled = output.scheduled
        params = []
        for item in scheduled:  # most steps: every row plain, its metadata built as columns
            req = item.request
            p = req.params
            if req.finished or item.draft_token_ids or req.sampler_reads_request or item.num_output_tokens < p.min_tokens:
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
            if req._lanes is not None:  # (plain sampling: its tokens are not read)
                outputs = _Unread(item.num_output_tokens)
            else:
                outputs = req.output_token_ids
                if len(outputs) != item.num_output_tokens:
                    outputs = _OutputsAtScheduling(outputs, item.num_output_tokens)
            grammar = req.grammar if item.samples else None  # a chunk that samples nothing needs no mask
            if item.draft_token_ids:  # speculative decoding: row j verifies proposal j (the last is the bonus row),
                drafts = item.draft_token_ids  # sampled as if proposals 0..j-1 were output (history, grammar, min_tokens)
                known = list(outputs)
                for j, draft in enumerate((*drafts, -1)):
                    rows.append(SamplingRow(req.params, req.parent.shown_prompt_ids, known + list(drafts[:j]), req.seed,
                                            self.eos_token_ids, grammar.after(drafts[:j]) if grammar else None, draft,
                                            req.controls))  # fmt: skip
                continue
            # (penalties count an embeds prompt's generated tokens only: its placeholder ids are no tokens)
            rows.append(SamplingRow(req.params, req.parent.shown_prompt_ids, outputs, req.seed, self.eos_token_ids, grammar,
                                    controls=req.controls))  # fmt: skip
        return build_sampling_metadata(rows, s, self.runner.history_width, self.max_suppress, self.mask_words)

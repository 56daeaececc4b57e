"""A step's prompt embeddings (enable_prompt_embeds): the rows of the prompt positions it computes for requests given
as embeddings, and a mask of where they apply; every other position embeds its token id (engine/prompt_embeds.py).

The mask travels in the step's packed int32 buffer; the rows [T, D] in the model's dtype are a second input. A step
with no such position (decode, token prompts) sends neither: it reuses an all-False mask and an all-zero device
array per bucket, so the shapes stay the bucket's and the step compiles once, at warm-up, with or without rows.
Rows are sent only with the steps that compute an embeds prompt's positions (prefill chunks, and the recompute of a
preempted one), not kept on the device between steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np

if TYPE_CHECKING:
    from jaxpaged.worker.input_batch import StepInputs
    from jaxpaged.worker.model_runner import ModelRunner


class PromptEmbedsInputs:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.hidden_size = runner.model_config.hidden_size
        self.dtype = np.dtype(runner.dtype)
        slots = runner.config.max_num_seqs
        self._slot_embeds: list = [None] * slots  # each slot's request's PromptEmbeds, or None
        self._slot_len = np.zeros(slots, np.int32)  # positions below which its rows are given embeddings
        self._no_mask: dict[int, np.ndarray] = {}
        self._no_rows: dict[int, jax.Array] = {}

    def admit(self, slot: int, embeds) -> None:
        """A sequence took the slot: its prompt's embeddings (or None)."""
        self._slot_embeds[slot] = embeds
        self._slot_len[slot] = 0 if embeds is None else len(embeds)

    def fill(self, step: StepInputs, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray, ends: np.ndarray) -> None:
        """The step's mask and rows, for the rows (scheduled sequences) whose chunk holds given prompt positions."""
        lens = self._slot_len[slots]
        given = np.flatnonzero(starts < lens)
        if not len(given):
            return
        t = step.input_ids.shape[0]
        mask = np.zeros(t, bool)
        rows = np.zeros((t, self.hidden_size), self.dtype)
        for j in given.tolist():
            start, stop = int(starts[j]), min(int(starts[j] + counts[j]), int(lens[j]))
            first = int(ends[j] - counts[j])
            mask[first : first + stop - start] = True
            rows[first : first + stop - start] = self._slot_embeds[slots[j]].rows[start:stop]
        step.embeds_mask, step.prompt_embeds = mask, rows

    def mask(self, step: StepInputs, num_tokens: int) -> np.ndarray:
        if step.embeds_mask is not None:
            return step.embeds_mask
        if num_tokens not in self._no_mask:
            self._no_mask[num_tokens] = np.zeros(num_tokens, bool)
        return self._no_mask[num_tokens]

    def rows(self, step: StepInputs, num_tokens: int) -> jax.Array:
        if step.prompt_embeds is not None:
            return self.runner._put(step.prompt_embeds)
        if num_tokens not in self._no_rows:
            self._no_rows[num_tokens] = self.runner._put(np.zeros((num_tokens, self.hidden_size), self.dtype))
        return self._no_rows[num_tokens]

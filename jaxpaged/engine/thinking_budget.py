"""thinking_token_budget (vLLM's): a reasoning model thinks at most N tokens, then its end marker is forced.

A sequence's budget rides on the structured-output path (llm_engine: `Request.grammar`, worker/sampler.py's
bitmask rows), as vLLM's thinking-budget state sits beside its grammars: `ThinkingBudget` counts the tokens written
after the start marker (or from the first one when the prompt leaves the thinking open), and once N are written
without the end marker it allows only the end marker's tokens, one a step, then nothing more of its own. A
structured-output grammar of the same request (`inner`, behind the thinking: AfterReasoning) sees every token too
and takes over once the thinking has ended. Markers are matched on the tokens' text, as AfterReasoning does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxpaged.engine.structured_output import thinking_closed

WAITING, THINKING, FORCING, DONE = range(4)


class ThinkingBudget:
    __slots__ = ("budget", "count", "end", "forced", "inner", "next_forced", "num_consumed", "phase", "start", "tail",
                 "token_text")  # fmt: skip

    def __init__(self, budget: int, start: str | None, end: str, forced: Sequence[int], token_text, phase: int, inner=None):
        self.budget, self.start, self.end, self.forced = budget, start, end, tuple(int(t) for t in forced)
        self.token_text, self.phase, self.inner = token_text, phase, inner
        self.count = self.next_forced = self.num_consumed = 0
        self.tail = ""  # the last characters written: a marker may begin there
        if phase == THINKING and budget == 0:
            self.phase = FORCING

    @staticmethod
    def for_prompt(budget: int, start: str | None, end: str, forced, token_text, prompt_text: str, inner=None):
        """The state a prompt leaves: done if it closed the thinking, thinking if it opened it (its last marker is
        `start`, or there is no start marker), else waiting for the output to open it."""
        if thinking_closed(prompt_text, start, end):
            phase = DONE
        elif start is None or prompt_text.rfind(start) > prompt_text.rfind(end):
            phase = THINKING
        else:
            phase = WAITING
        return ThinkingBudget(budget, start, end, forced, token_text, phase, inner)

    def copy(self) -> ThinkingBudget:
        state = ThinkingBudget(self.budget, self.start, self.end, self.forced, self.token_text, self.phase,
                               None if self.inner is None else self.inner.copy())  # fmt: skip
        state.count, state.next_forced, state.num_consumed, state.tail = self.count, self.next_forced, self.num_consumed, self.tail
        return state

    def _step(self, token: int) -> bool:
        """Advance this state by one token; False: a token the budget did not allow (not the forced one)."""
        if self.phase == FORCING:
            if token != self.forced[self.next_forced]:
                return False
            self.next_forced += 1
            if self.next_forced == len(self.forced):
                self.phase = DONE
            return True
        if self.phase in (WAITING, THINKING):
            marker = self.start if self.phase == WAITING else self.end
            text = self.tail + self.token_text(int(token))
            if marker in text:
                self.phase, self.tail = (THINKING if self.phase == WAITING else DONE), ""
                if self.phase == THINKING and self.budget == 0:
                    self.phase = FORCING
                return True
            self.tail = text[len(text) - len(marker) + 1 :] if len(marker) > 1 else ""
            if self.phase == THINKING:
                self.count += 1
                if self.count >= self.budget:
                    self.phase = FORCING
        return True

    def accept(self, token: int) -> bool:
        self.num_consumed += 1
        ok = self._step(token)
        if self.inner is not None:
            ok = self.inner.accept(token) and ok
        return ok

    def fill_bitmask(self, row: np.ndarray) -> None:
        if self.phase == FORCING:
            token = self.forced[self.next_forced]
            row[:] = 0
            if token // 32 < row.shape[0]:
                row[token // 32] = np.int32(np.uint32(1 << (token % 32)).view(np.int32))
        elif self.inner is not None:
            self.inner.fill_bitmask(row)
        else:
            row[:] = -1

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        state = self.copy()
        for k, token in enumerate(tokens):
            if state.phase == FORCING and int(token) != state.forced[state.next_forced]:
                return k
            if state.inner is not None and state.inner.valid_prefix([token]) == 0:
                return k
            state.accept(int(token))
        return len(tokens)

    def after(self, tokens: Sequence[int]) -> ThinkingBudget:
        """A view for one speculative row's mask: this state after `tokens`."""
        state = self.copy()
        for token in tokens:
            state.accept(int(token))
        return state

    def ends_after(self, token: int) -> bool:
        return self.phase == DONE and self.inner is not None and self.inner.ends_after(token)

    @property
    def is_terminated(self) -> bool:
        return self.phase == DONE and self.inner is not None and self.inner.is_terminated

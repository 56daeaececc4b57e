"""Beam search with transformers' semantics, on beams that are ordinary engine sequences.

Each round, every running beam computes one position and reports its top-K next-token
logprobs (K = max(2, 1 + number of EOS ids) x beam_width, as transformers keeps: the global
top-K over beams x vocab can only come from each beam's own top-K). `BeamSearch.advance`
then does what `GenerationMixin._beam_search` does, step for step, in float32:

- candidates are ranked by beam score + token logprob; the best K are kept;
- a candidate "finishes" if its token is an EOS id or it reaches max_tokens; the top
  beam_width of the K that finish enter the finished list with score
  cum_logprob / generated_length ** length_penalty (the list keeps the best beam_width);
- the best beam_width unfinished candidates run on (finished ones are pushed down by 1e9);
- early stopping (`early_stopping`, as transformers): True stops once beam_width hypotheses
  are finished; False (the default) stops when the best running beam, normalised by its
  current length, cannot beat the worst finished one; "never" uses max_tokens instead of the
  current length when length_penalty > 0 (the exact, slower criterion). Generation also
  stops when every kept candidate finishes (max_tokens).

The engine forks the chosen beams from their parents (blocks shared, the partly filled last
block copied on first write) and frees the parents; see LLMEngine._update_beams.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxpaged.outputs import CompletionOutput

NEG = np.float32(-1.0e9)  # transformers' "impossible" score


@dataclasses.dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams, plus transformers' early_stopping."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer (got {value!r})")
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 for beam search (got {self.temperature!r})")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool (got {self.ignore_eos!r})")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise ValueError(f"length_penalty must be a finite number (got {lp!r})")
        check_early_stopping(self.early_stopping)


def check_early_stopping(value) -> None:
    if value not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never' (got {value!r})")


@dataclasses.dataclass
class BeamSearchSequence:
    """One finished hypothesis. `tokens` holds the prompt too, as in vLLM."""

    tokens: list[int]
    output_token_ids: list[int]
    cum_logprob: float
    score: float  # cum_logprob / generated_length ** length_penalty: what beams are ranked by
    text: str | None = None  # the generated text
    finish_reason: str = "length"


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclasses.dataclass
class _Hypothesis:
    score: np.float32
    tokens: list[int] | None  # generated tokens; None for transformers' empty placeholder slots
    cum_logprob: float = 0.0
    finished: bool = False
    stopped: bool = False  # ended by EOS or its grammar, not by max_tokens


class BeamSearch:
    def __init__(self, width: int, max_tokens: int, eos_ids: list[int], length_penalty: float, early_stopping):
        self.width = width
        self.max_tokens = max_tokens
        self.eos_ids = set(eos_ids)
        self.num_candidates = max(2, 1 + len(eos_ids)) * width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.generated = 0  # tokens per beam so far
        self.running: list = []  # the engine's sequences, one per running beam
        self.tops: dict = {}  # running beam -> (top ids, top logprobs) of its next position, once computed
        self.scores: list[np.float32] = [np.float32(0.0)]  # running beams' accumulated logprobs
        self.cum_logprobs: list[float] = [0.0]
        self.finished = [_Hypothesis(NEG, None) for _ in range(width)]
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False

    def advance(self, tops: list[tuple[np.ndarray, np.ndarray]], outputs: list[list[int]], ends=None) -> list[tuple[int, int]]:
        """One round. tops[b] = (ids, logprobs) of running beam b, best first; outputs[b] its tokens so far;
        ends(b, token): whether that token ends beam b's grammar (structured outputs), a finish as EOS is.

        Returns the next running beams as (parent beam, token); empty once the search is done.
        """
        cands = []  # (score, beam, token, logprob)
        for b, (ids, lps) in enumerate(tops):
            for token, lp in zip(ids[: self.num_candidates], lps[: self.num_candidates]):
                if np.isfinite(lp):  # -inf: a token the beam's grammar forbids (fewer allowed than candidates)
                    cands.append((np.float32(self.scores[b] + np.float32(lp)), b, int(token), float(lp)))
        cands.sort(key=lambda c: -c[0])  # stable: ties keep beam order, as a flattened top-k would
        cands = cands[: self.num_candidates]
        if not cands:  # every beam's grammar is spent: nothing can follow
            self.done = True
            return []
        length = self.generated + 1
        stops = [token in self.eos_ids or (ends is not None and ends(b, token)) for _, b, token, _ in cands]
        hits = [stop or length >= self.max_tokens for stop in stops]

        # Finished hypotheses: only the top `width` candidates may enter, and only while improvement is possible.
        full = all(h.finished for h in self.finished) and self.early_stopping is True
        entries = list(self.finished)
        for i, (score, b, token, lp) in enumerate(cands):
            normalised = np.float32(score / np.float32(length**self.length_penalty))
            enters = i < self.width and hits[i]
            if full or not self.improvable or not enters:
                normalised = np.float32(normalised + NEG)
            tokens = outputs[b] + [token]
            entries.append(_Hypothesis(normalised, tokens, self.cum_logprobs[b] + lp, enters, stops[i]))
        entries.sort(key=lambda h: -h.score)
        self.finished = entries[: self.width]

        # Running beams: the best `width` candidates, finished ones pushed out of the way.
        ranked = sorted(
            ((np.float32(c[0] + NEG) if hit else c[0], c) for c, hit in zip(cands, hits)), key=lambda x: -x[0]
        )[: self.width]
        next_cum = [self.cum_logprobs[c[1]] + c[3] for _, c in ranked]
        self.scores = [s for s, _ in ranked]
        self.cum_logprobs = next_cum
        self.generated = length

        best_length = self.max_tokens if self.early_stopping == "never" and self.length_penalty > 0 else length
        best_possible = np.float32(self.scores[0] / np.float32(best_length**self.length_penalty))
        worst = min(h.score for h in self.finished)
        self.improvable = self.improvable and any(best_possible > (worst if h.finished else NEG) for h in self.finished)
        all_finished = all(h.finished for h in self.finished) and self.early_stopping is True
        self.done = not self.improvable or all_finished or all(hits)
        return [] if self.done else [(c[1], c[2]) for _, c in ranked]

    def best(self, n: int) -> list[_Hypothesis]:
        """The n best hypotheses (transformers returns the finished list's head, placeholders included)."""
        return [h for h in self.finished[:n] if h.tokens is not None]

    def completions(self, n: int, decode) -> list[CompletionOutput]:
        return [
            CompletionOutput(
                index=i, text=decode(h.tokens), token_ids=list(h.tokens), cumulative_logprob=h.cum_logprob,
                logprobs=None, finish_reason=self.finish_reason(h),
            )
            for i, h in enumerate(self.best(n))
        ]  # fmt: skip

    def finish_reason(self, h: _Hypothesis) -> str:
        return "stop" if h.stopped else "length"

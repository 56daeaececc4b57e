"""Token ids to what callers see: detokenizing (and stop strings), logprob dicts and RequestOutputs.

The output processor keeps, per sequence, what only the caller needs (its text so far, its
logprobs); the scheduler keeps what scheduling needs. It finds stop strings before the
scheduler takes a step's tokens, so the scheduler's `check_stop` decides every stop in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxpaged.core.request import POOL_ALL, POOL_MEAN, ParentRequest, Request, RequestStatus
from jaxpaged.core.scheduler import ScheduledSequence, SchedulerOutput
from jaxpaged.engine.beam_search import BeamSearch
from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.outputs import CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind
from jaxpaged.worker.step_output import StepResult


def _no_text(token: int) -> None:
    """A logprob's decoded token with detokenize=False."""
    return None


@dataclasses.dataclass(eq=False)
class SequenceOutputState:
    """One sequence's caller-facing state."""

    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # per prompt position; None for the first
    cumulative_logprob: float = 0.0
    final_only: bool = False  # output_kind FINAL_ONLY: no output until the request ends
    # FINAL_ONLY without stop strings: nothing needs the text before the end, so the tokens are decoded then, at once
    deferred_text: bool = False
    quiet: bool = False  # final_only, and no logprobs to record: a step that does not end it has nothing to do for it
    pooled: np.ndarray | None = None  # a pooling request's sum of its pooled hidden states so far (engine/pooling.py)
    pooled_tokens: list[np.ndarray] | None = None  # a token task's (ALL): its prompt's hidden states, chunk by chunk


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: Sequence[int] = (), pooler=None):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)  # the EOS token's text is left out of the output, as vLLM does
        self.parents: dict[str, ParentRequest] = {}  # unfinished requests by id
        self.beams: dict[str, BeamSearch] = {}  # use_beam_search requests' search state, by request id
        self._states: dict[Request, SequenceOutputState] = {}
        # how many of those need each step's tokens: detokenized token by token (streamed, or with stop strings),
        # and not quiet; with none, a step's rows are passed over in bulk (LLM.generate's FINAL_ONLY requests)
        self._num_detokenized = 0
        self._num_loud = 0
        self.pooler = pooler  # a pooling engine's (engine/pooling.py): turns a finished request's pooled sum into its output

    def add_request(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent

    def add_sequence(self, seq: Request) -> None:
        """A sampled sequence (not a beam): its detokenizer and logprob lists."""
        params, ids = seq.params, seq.parent.shown_prompt_ids  # (an embeds prompt: detokenized from nothing)
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens, stop=params.stop or (),
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                include_stop_str_in_output=params.include_stop_str_in_output, prompt_token_ids=ids,
                min_tokens=params.min_tokens,
                stop_token_ids=(*(() if params.ignore_eos else self.eos_token_ids), *(params.stop_token_ids or ())),
            )  # fmt: skip
        final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        prompt_logprobs = [None] if seq.wants_prompt_logprobs else None
        state = self._states[seq] = SequenceOutputState(
            detok, logprobs=[] if params.logprobs is not None else None, prompt_logprobs=prompt_logprobs,
            final_only=final_only, deferred_text=final_only and not params.stop,
            quiet=final_only and params.logprobs is None and prompt_logprobs is None,
        )  # fmt: skip
        if seq.parent.pooling is not None:  # every chunk's pooled sum is read, so it is never quiet
            state.pooled, state.quiet = np.zeros(self.pooler.hidden_size, np.float32), False
            if seq.parent.pool_code == POOL_ALL:
                state.pooled_tokens = []
        seq.quiet = state.quiet  # the scheduler may then keep its newest tokens in arrays until it ends
        self._count(state, 1)

    def _count(self, state: SequenceOutputState, sign: int) -> None:
        self._num_detokenized += sign * (state.detokenizer is not None and not state.deferred_text)
        self._num_loud += sign * (not state.quiet)

    def add_beam_search(self, parent: ParentRequest, search: BeamSearch) -> None:
        self.parents[parent.request_id] = parent
        self.beams[parent.request_id] = search

    def detokenize(self, output: SchedulerOutput, result: StepResult) -> dict[Request, str]:
        """Push each live sampling sequence's new token through its detokenizer; returns the stop strings hit."""
        stops = {}
        if not self._num_detokenized:
            return stops
        tokens = None
        for item in output.scheduled:
            req = item.request
            state = self._states.get(req)  # None: a beam
            if state is None or state.deferred_text or state.detokenizer is None or not item.samples or req.finished:
                continue
            if tokens is None:
                tokens = result.tokens.tolist()
            detok = state.detokenizer
            detok.push(tokens[item.row])
            if detok.finished:
                stops[req] = detok.stop_reason
        return stops

    def process(self, live: list[ScheduledSequence], result: StepResult, finished_beams: Sequence[str] = (),
                ended: list[ScheduledSequence] | None = None) -> list[RequestOutput]:  # fmt: skip
        """Logprobs of the scheduled sequences the scheduler took, then the outputs of every request that moved.
        ended: the rows of `live` whose sequences the scheduler ended in this update, where it kept them."""
        touched: dict[str, ParentRequest] = {}
        if not self._num_loud:  # every sequence quiet: only those that ended have anything to do
            live = ended if ended is not None else [item for item in live if item.request.finished]
        for item in live:
            req = item.request
            state = self._states.get(req)
            if state is None:  # a beam: its outputs come when the search ends
                continue
            if state.quiet and not req.finished:
                continue
            if result.prompt is not None and state.prompt_logprobs is not None:
                self._record_prompt_logprobs(req, state, item.start, item.num_tokens, item.first_token_row, result.prompt)
            if state.pooled_tokens is not None:
                self._record_pooled_tokens(req, state, item, result.pooled_tokens)
            elif state.pooled is not None and result.pooled is not None:
                self._record_pooled(req, state, item, result.pooled)
            if not item.samples:
                continue
            token = int(result.tokens[item.row])
            if state.logprobs is not None:
                self._record_logprobs(req, state, token, result, item.row)
            if req.finished and state.detokenizer is not None:
                self._catch_up(req, state)
                state.detokenizer.flush()
            if not state.final_only or req.parent.finished:
                touched[req.parent.request_id] = req.parent
        for request_id in finished_beams:
            touched[request_id] = self.parents[request_id]
        outputs = []
        for parent in touched.values():
            outputs.append(self.output(parent))
            if parent.finished:
                self._forget(parent)
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        """The final output of a request the engine just aborted."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for seq in parent.sequences:
            state = self._states.get(seq)
            if state is not None and state.detokenizer is not None:
                self._catch_up(seq, state)
        out = self.output(parent)
        self._forget(parent)
        return out

    @staticmethod
    def _catch_up(req: Request, state: SequenceOutputState) -> None:
        """A deferred sequence's text: every output token not decoded yet, in one decode."""
        detok = state.detokenizer
        if state.deferred_text and detok.num_tokens < req.num_sampled_tokens:
            detok.push_many(req.output_token_ids[detok.num_tokens : req.num_sampled_tokens])

    def _forget(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        self.beams.pop(parent.request_id, None)
        for seq in parent.sequences:
            state = self._states.pop(seq, None)
            if state is not None:
                self._count(state, -1)

    def _record_logprobs(self, req: Request, state: SequenceOutputState, token: int, result: StepResult, row: int) -> None:
        lp = float(result.logprobs[row])
        state.cumulative_logprob += lp
        decode = self._decode_one if req.params.detokenize else _no_text
        entry = {token: Logprob(lp, None, decode(token))}
        if result.top_ids is None:
            state.logprobs.append(entry)
            return
        top_ids, top_lps = result.top_ids[row], result.top_logprobs[row]
        where = np.flatnonzero(top_ids == token)
        if where.size:  # the sampled token's rank, as vLLM gives it (even for logprobs=0), when it is in the step's top 20
            entry[token].rank = int(np.sum(top_lps > top_lps[where[0]])) + 1
        for rank, (tid, tlp) in enumerate(zip(top_ids[: req.params.logprobs], top_lps)):
            tid = int(tid)
            if tid != token:
                entry[tid] = Logprob(float(tlp), rank + 1, decode(tid))
        state.logprobs.append(entry)

    def _record_prompt_logprobs(self, req: Request, state: SequenceOutputState, start: int, count: int, row: int, prompt) -> None:
        """Entries for the prompt tokens this chunk predicts (recomputed chunks after a preemption add nothing)."""
        chosen, rank, top_ids, top_lps = prompt
        wanted = req.params.prompt_logprobs
        decode = self._decode_one if req.params.detokenize else _no_text
        for offset in range(count):
            position = start + offset + 1  # the prompt token row `row + offset` predicts
            if position >= len(req.prompt_token_ids) or position < len(state.prompt_logprobs):
                continue
            token, r = req.prompt_token_ids[position], row + offset
            entry = {token: Logprob(float(chosen[r]), int(rank[r]), decode(token))}
            for rank_i, (tid, tlp) in enumerate(zip(top_ids[r, :wanted], top_lps[r, :wanted])):
                if int(tid) != token:
                    entry[int(tid)] = Logprob(float(tlp), rank_i + 1, decode(int(tid)))
            state.prompt_logprobs.append(entry)

    @staticmethod
    def _record_pooled(req: Request, state: SequenceOutputState, item: ScheduledSequence, pooled: np.ndarray) -> None:
        """A chunk's pooled sum: MEAN adds its chunks (one starting at 0 is a recompute after a preemption: the sum
        starts again), LAST and CLS take the chunk holding their position."""
        start = item.start
        if req.parent.pool_code == POOL_MEAN:
            if start == 0:
                state.pooled[:] = 0.0
            state.pooled += pooled[item.row]
            return
        lo, hi = req.pooled_span()
        if start < hi and lo < start + item.num_tokens:  # the chunk holds its position
            state.pooled[:] = pooled[item.row]

    @staticmethod
    def _record_pooled_tokens(req: Request, state: SequenceOutputState, item: ScheduledSequence, hidden) -> None:
        """A token task's chunk: its prompt positions' rows of the step's hidden states, kept in order (a chunk
        starting at 0 is a recompute after a preemption: the rows start again)."""
        start, n = item.start, item.num_tokens
        if start == 0:
            state.pooled_tokens.clear()
        lo, hi = req.pooled_span()
        lo, hi = max(lo, start), min(hi, start + n)
        if lo < hi:  # (the step fetched its hidden states: input_batch's pool_tokens)
            first = item.first_token_row - start
            state.pooled_tokens.append(np.array(hidden[first + lo : first + hi], np.float32))  # (a copy: not the step's)

    def _decode_one(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if self.tokenizer is not None else ""

    # -- RequestOutputs ------------------------------------------------------------------------

    def output(self, parent: ParentRequest) -> RequestOutput:
        search = self.beams.get(parent.request_id)
        if search is not None:
            params = parent.params
            decode = (lambda ids: self._decode(ids, params.skip_special_tokens)) if params.detokenize else (lambda ids: "")
            return RequestOutput(
                request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=list(parent.shown_prompt_ids),
                outputs=search.completions(params.n, decode) if search.done else [], finished=search.done,
            )  # fmt: skip
        first = self._states[parent.sequences[0]]
        if first.pooled is not None:
            return self._pooling_output(parent, first)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=list(parent.shown_prompt_ids),
            outputs=[self._completion(seq) for seq in parent.sequences],
            finished=parent.finished,
            prompt_logprobs=first.prompt_logprobs,
            num_cached_tokens=parent.sequences[0].num_cached_tokens,
        )

    def _pooling_output(self, parent: ParentRequest, state: SequenceOutputState) -> PoolingRequestOutput:
        seq = parent.sequences[0]
        done = seq.finished and seq.status is not RequestStatus.FINISHED_ABORTED
        data = None
        if done and state.pooled_tokens is not None:
            rows = np.concatenate(state.pooled_tokens) if state.pooled_tokens else np.zeros((0, self.pooler.hidden_size), np.float32)
            data = self.pooler.finish_tokens(rows, seq.prompt_token_ids, parent.pooling)
        elif done:
            data = self.pooler.finish(state.pooled, len(seq.prompt_token_ids), parent.pooling)
        return PoolingRequestOutput(parent.request_id, None if data is None else PoolingOutput(data),
                                    list(parent.prompt_token_ids), parent.finished, prompt=parent.prompt)  # fmt: skip

    def _completion(self, seq: Request) -> CompletionOutput:
        state = self._states[seq]
        return CompletionOutput(
            index=seq.index,
            text=state.detokenizer.output_text if state.detokenizer is not None else "",  # after the final flush, all of it
            token_ids=seq.output_token_ids[: seq.num_sampled_tokens],
            cumulative_logprob=state.cumulative_logprob if seq.params.logprobs is not None else None,
            logprobs=state.logprobs,
            finish_reason=seq.status.value if seq.finished else None,
            stop_reason=seq.stop_reason,
        )

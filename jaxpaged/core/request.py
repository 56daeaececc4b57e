"""A request's state as the scheduler and the engine see it.

A user request with n > 1 becomes n sequences (`Request`s) sharing a `RequestGroup`; the
scheduler only ever deals with single sequences.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

from jaxpaged.core.kv_cache_manager import hash_block
from jaxpaged.engine.beam_search import BeamSearch
from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


PLACEHOLDER = -1  # an output token sampled by a step still running on the device


@dataclasses.dataclass(eq=False)
class Request:
    seq_id: str
    parent: ParentRequest  # the user's request: its n samples or its beams
    index: int  # which of the parent's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what the context leaves
    seed: int  # this sequence's sampling seed
    detokenizer: IncrementalDetokenizer | None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # per prompt position; None for the first
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    hold_at: int | None = None  # n > 1: compute no further until the parent's other samples fork from here
    _block_hashes: list[bytes] = dataclasses.field(default_factory=list, repr=False)
    beam_top: tuple | None = None  # beam search: (top ids, top logprobs) of the next position, once computed
    num_in_flight: int = 0  # trailing output tokens still on the device (async scheduling): PLACEHOLDER until read

    @property
    def num_sampled_tokens(self) -> int:
        """Output tokens known on the host."""
        return len(self.output_token_ids) - self.num_in_flight

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens_at(self, start: int, count: int) -> list[int]:
        """(prompt + outputs)[start:start + count], without building the whole list (decode asks for one)."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : start - prompt_len + count]
        return self.prompt_token_ids[start : start + count] + self.output_token_ids[: max(0, start + count - prompt_len)]

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_schedulable_tokens(self) -> int:
        if len(self.output_token_ids) >= self.max_tokens:  # its last token is sampled (in flight): nothing to feed
            return 0
        pending = self.num_pending_tokens
        return pending if self.hold_at is None else min(pending, self.hold_at - self.num_computed_tokens)

    def block_hashes(self, block_size: int, count: int) -> list[bytes]:
        """Chained hashes of the first `count` full blocks of this sequence's tokens (append-only, so cached)."""
        while len(self._block_hashes) < count:
            i = len(self._block_hashes)
            parent = self._block_hashes[-1] if i else None
            self._block_hashes.append(hash_block(parent, self.tokens_at(i * block_size, block_size)))
        return self._block_hashes[:count]

    @property
    def finished(self) -> bool:
        return self.status.finished

    def text(self) -> str:
        # what has been safely released so far; after the final flush, the whole text
        return self.detokenizer.output_text if self.detokenizer is not None else ""

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text(),
            token_ids=self.output_token_ids[: self.num_sampled_tokens],
            cumulative_logprob=self.cumulative_logprob if self.params.logprobs is not None else None,
            logprobs=self.logprobs,
            finish_reason=self.status.value if self.finished else None,
            stop_reason=self.stop_reason,
        )


@dataclasses.dataclass(eq=False)
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Request] = dataclasses.field(default_factory=list)
    unforked: list[Request] = dataclasses.field(default_factory=list)  # samples waiting to fork from the first
    beam: BeamSearch | None = None  # use_beam_search: the search state; its running beams are the sequences
    decode: Callable[[list[int]], str] | None = None  # beam search: final text of each hypothesis

    @property
    def live_sequences(self) -> list[Request]:
        return self.beam.running if self.beam is not None else self.sequences

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(seq.finished for seq in self.sequences)

    def output(self) -> RequestOutput:
        if self.beam is not None:
            decode = self.decode or (lambda ids: "")
            return RequestOutput(
                request_id=self.request_id, prompt=self.prompt, prompt_token_ids=list(self.prompt_token_ids),
                outputs=self.beam.completions(self.params.n, decode) if self.beam.done else [],
                finished=self.beam.done,
            )  # fmt: skip
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[seq.completion() for seq in self.sequences],
            finished=self.finished,
            prompt_logprobs=self.sequences[0].prompt_logprobs,
            num_cached_tokens=self.sequences[0].num_cached_tokens,
        )

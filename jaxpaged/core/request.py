"""A request's scheduling state: what the scheduler and the KV cache manager read and change.

A user request with n > 1 (or beam search) becomes several sequences (`Request`s, vLLM V1's
meaning) under one `ParentRequest`; the scheduler only ever deals with single sequences.
Detokenizing, logprobs and beams live on the engine side (engine/output_processor.py,
engine/beam_search.py), so this module depends on nothing above core/.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools

from jaxpaged.core.kv_cache_manager import hash_block
from jaxpaged.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


# a tuple: membership compares by identity in C, where a set would call Enum.__hash__ in Python
_FINISHED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)
PLACEHOLDER = -1  # an output token sampled by a step still running on the device
# a pooling request's type (ParentRequest.pool_code; 0: it does not pool): engine/pooling.py's LAST, MEAN and CLS,
# and ALL (the token tasks: every prompt position's hidden state, handed back whole rather than summed)
POOL_LAST, POOL_MEAN, POOL_CLS, POOL_ALL = 1, 2, 3, 4


@dataclasses.dataclass(eq=False)
class Request:
    seq_id: str
    parent: ParentRequest  # the user's request: its n samples or its beams
    index: int  # which of the parent's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what the context leaves
    seed: int  # this sequence's sampling seed
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    hold_at: int | None = None  # n > 1: compute no further until the parent's other samples fork from here
    _block_hashes: list[bytes] = dataclasses.field(default_factory=list, repr=False)
    num_in_flight: int = 0  # trailing output tokens still on the device (async scheduling): PLACEHOLDER until read
    grammar: object | None = None  # structured outputs: the engine's GrammarState, advanced by each sampled token
    controls: object | None = None  # logit_bias, allowed_token_ids, bad_words: engine/token_controls.TokenControls
    slot: int = -1  # while running: its row in the scheduler's and the input batch's per-sequence arrays
    state_slot: int = -1  # hybrid models, while running: its slot in the linear layers' state cache (core/state_slots.py)
    sampled_row: int = -1  # its row in the sampled tokens of the step its in-flight token comes from (async scheduling)
    # length-dependent RoPE: the regime its KV is computed in (core/rope_regime.py), a root of its block hashes
    rope_key: bytes = b""

    # its outputs are read only when it ends (FINAL_ONLY, no logprobs): it may decode in the scheduler's DecodeLanes
    quiet: bool = False

    # a running beam: asks for its next position's top candidates and is never sampled from (read per row per step)
    is_beam: bool = dataclasses.field(init=False, repr=False)
    # set while the scheduler's DecodeLanes hold this sequence's counters and newest tokens (decode_lanes.py): the
    # four fields below read them back first (a class attribute until then)
    _lanes = None

    def __post_init__(self):
        self.is_beam = self.parent.params.use_beam_search

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are computed once per parent, by its first sample (which then skips the prefix cache)."""
        return self.params.prompt_logprobs is not None and self.index == 0 and not self.is_beam

    @property
    def reads_every_position(self) -> bool:
        """Prompt logprobs, or MEAN/CLS/ALL pooling: every prompt position computed, so the prefix cache is skipped."""
        return self.wants_prompt_logprobs or self.parent.pool_code in (POOL_MEAN, POOL_CLS, POOL_ALL)

    def pooled_span(self) -> tuple[int, int]:
        """[lo, hi): the prompt positions its pooling type reads: the last, every one, or the first (the step's
        pool_rows and the host's sums both read it)."""
        n = len(self.prompt_token_ids)
        return {POOL_LAST: (n - 1, n), POOL_MEAN: (0, n), POOL_CLS: (0, 1), POOL_ALL: (0, n)}[self.parent.pool_code]

    @property
    def sampler_reads_tokens(self) -> bool:
        """Sampling it reads its latest tokens on the host: its grammar's mask, its penalties' history, or the bad
        words its outputs may be completing."""
        return (self.grammar is not None or self.params.has_penalties
                or (self.controls is not None and self.controls.reads_tokens))  # fmt: skip

    @property
    def sampler_reads_request(self) -> bool:
        """Its sampling row is built from the request each step, not from its slot's constants alone."""
        return self.controls is not None or self.sampler_reads_tokens

    @property
    def num_sampled_tokens(self) -> int:
        """Output tokens known on the host."""
        return len(self.output_token_ids) - self.num_in_flight

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens_at(self, start: int, count: int) -> list[int]:
        """(prompt + outputs)[start:start + count], without building the whole list (decode asks for one)."""
        return _tokens_at(self.prompt_token_ids, self.output_token_ids, start, count)

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_schedulable_tokens(self) -> int:
        num_outputs = len(self.output_token_ids)  # read once per running sequence per step: kept to a few lookups
        if num_outputs >= self.max_tokens:  # its last token is sampled (in flight): nothing to feed
            return 0
        pending = len(self.prompt_token_ids) + num_outputs - self.num_computed_tokens
        return pending if self.hold_at is None else min(pending, self.hold_at - self.num_computed_tokens)

    def set_rope_key(self, key: bytes) -> None:
        """Its KV is (re)computed from scratch in this RoPE regime: the block hashes, rooted in it, start again."""
        if key != self.rope_key:
            self.rope_key, self._block_hashes = key, []

    def block_hashes(self, block_size: int, count: int) -> list[bytes]:
        """Chained hashes of the first `count` full blocks of this sequence's tokens (append-only, so cached). Only
        known tokens are ever hashed (in the lanes, read there: it stays in them)."""
        lanes = self._lanes
        while len(self._block_hashes) < count:
            i = len(self._block_hashes)
            # the root: an adapter's prefixes are its own, and a length-dependent RoPE regime's
            parent = self._block_hashes[-1] if i else (self.parent.cache_salt or b"") + self.rope_key or None
            if self.parent.mm is not None:  # the images it holds part of (placeholder tokens alike for any image)
                parent = (parent or b"") + self.parent.mm.block_salt(i * block_size, block_size) or None
            if self.parent.prompt_embeds is not None:  # its prompt's vectors (engine/prompt_embeds.py)
                parent = (parent or b"") + self.parent.prompt_embeds.block_salt(i * block_size, block_size) or None
            if lanes is None:
                tokens = _tokens_at(self.prompt_token_ids, self._output_token_ids, i * block_size, block_size)
            else:
                tokens = lanes.tokens_at(self, i * block_size, block_size)
            self._block_hashes.append(hash_block(parent, tokens))
        return self._block_hashes[:count]

    @property
    def finished(self) -> bool:
        return self.status in _FINISHED  # read several times per row per step


def _tokens_at(prompt: list[int], outputs: list[int], start: int, count: int) -> list[int]:
    prompt_len = len(prompt)
    if start >= prompt_len:
        return outputs[start - prompt_len : start - prompt_len + count]
    return prompt[start : start + count] + outputs[: max(0, start + count - prompt_len)]


# Four fields the scheduler's DecodeLanes may hold in its arrays while the sequence decodes: a count is read from
# there; the list, or a write, takes the sequence out of the lanes first, so whoever uses a Request sees it up to
# date. (Set after the dataclass is made, whose __init__ assigns through them; written out, since a generic
# getattr(self, name) doubles a read's cost.)
def _get_outputs(self):
    if self._lanes is not None:
        self._lanes.release(self)
    return self._output_token_ids


def _set_outputs(self, value):
    if self._lanes is not None:
        self._lanes.release(self)
    self._output_token_ids = value


def _get_computed(self):
    lanes = self._lanes
    return self._num_computed_tokens if lanes is None else int(lanes.computed[self.slot])


def _set_computed(self, value):
    if self._lanes is not None:
        self._lanes.release(self)
    self._num_computed_tokens = value


def _get_in_flight(self):
    lanes = self._lanes
    return self._num_in_flight if lanes is None else int(lanes.in_flight[self.slot])


def _set_in_flight(self, value):
    if self._lanes is not None:
        self._lanes.release(self)
    self._num_in_flight = value


def _get_sampled_row(self):
    lanes = self._lanes
    return self._sampled_row if lanes is None else int(lanes.sampled_row[self.slot])


def _set_sampled_row(self, value):
    if self._lanes is not None:
        self._lanes.release(self)
    self._sampled_row = value


Request.output_token_ids = property(_get_outputs, _set_outputs, doc="Its sampled tokens, a PLACEHOLDER for each still on the device.")
Request.num_computed_tokens = property(_get_computed, _set_computed, doc="Its tokens whose K/V are in the cache.")
Request.num_in_flight = property(_get_in_flight, _set_in_flight, doc="Its trailing output tokens still on the device.")
Request.sampled_row = property(_get_sampled_row, _set_sampled_row, doc="Its row in the step its in-flight token comes from.")


@dataclasses.dataclass(eq=False)
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Request] = dataclasses.field(default_factory=list)  # the n samples, or the running beams
    unforked: list[Request] = dataclasses.field(default_factory=list)  # samples waiting to fork from the first
    lora_request: object | None = None  # a LoRARequest (jaxpaged/lora): the adapter it runs with, None for the base
    lora_slot: int = -1  # the device slot of its LoRA adapter, held until it finishes (-1: the base model)
    cache_salt: bytes | None = None  # salts its first block's hash: a LoRA adapter's cached prefixes serve it alone
    mm: object | None = None  # its prompt's images (jaxpaged/multimodal/inputs.py: MultimodalInputs), for all its sequences
    # a prompt given as embeddings (engine/prompt_embeds.py: PromptEmbeds): prompt_token_ids are then placeholders
    prompt_embeds: object | None = None
    # a pooling engine's request (engine/pooling.py): its PoolingParams, and the step's code for its pooling type
    pooling: object | None = None
    pool_code: int = 0
    # scheduling_policy "priority": lower is served first, ties in arrival order (its samples and beams share both)
    priority: int = 0
    arrival: int = dataclasses.field(default_factory=itertools.count().__next__)

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)

    @property
    def shown_prompt_ids(self) -> list[int]:
        """Its prompt token ids as outputs and penalties see them: none for a prompt given as embeddings."""
        return [] if self.prompt_embeds is not None else self.prompt_token_ids

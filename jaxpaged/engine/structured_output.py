"""Structured outputs: each constrained sequence's grammar state, and the token bitmask of its next step.

As vLLM V1's StructuredOutputManager, with llguidance as the backend: a request's
`StructuredOutputsParams` becomes an llguidance grammar, compiled once per (kind, text) for this
engine's tokenizer (the manager belongs to one engine, so to one tokenizer) and kept in a cache; each
sequence gets a copy of the compiled matcher, advanced by every token it samples. Before a step the
host writes each constrained row's allowed tokens as a packed bitmask ([vocab / 32] int32, bit i of
word w allows token 32 w + i); the jitted sampler masks the logits with it (worker/sampler.py).
A grammar that has finished ends its sequence with finish_reason "stop", as EOS does; EOS itself is
allowed exactly where the grammar accepts.

With a reasoning model's markers (StructuredOutputsParams.reasoning_end), the grammar waits for the thinking to
end, as vLLM's does with a reasoning parser: `AfterReasoning` allows every token until the output's text has
written the end marker (or the prompt already closed the thinking), then hands over to the grammar.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from jaxpaged.sampling_params import StructuredOutputsParams

logger = logging.getLogger("jaxpaged.structured_output")

MAX_CACHED_GRAMMARS = 256


def _grammar_text(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, text): the cache key, and what is compiled (a JSON schema with its options in llguidance's x-guidance)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs.json must be a JSON schema object")
        if params.disable_additional_properties:
            schema = _closed_objects(schema)
        options = {"whitespace_flexible": params.disable_any_whitespace is False}
        if params.whitespace_pattern is not None:
            options = {"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern}
        return kind, json.dumps({**schema, "x-guidance": options}, sort_keys=True)
    if kind == "regex":
        return kind, params.regex
    if kind == "choice":
        return kind, json.dumps(params.choice)
    return kind, params.grammar


def _closed_objects(schema):
    """vLLM's disable_additional_properties: every object schema that does not say otherwise takes no other keys."""
    if isinstance(schema, list):
        return [_closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed_objects(value) for key, value in schema.items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


class GrammarState:
    """One sequence's matcher: where its output stands in the grammar."""

    __slots__ = ("matcher", "manager", "num_consumed")

    def __init__(self, matcher, manager: StructuredOutputManager):
        self.matcher = matcher
        self.manager = manager
        self.num_consumed = 0  # output tokens consumed: the mask is for output token num_consumed

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the tokens allowed next into one bitmask row ([vocab / 32] int32)."""
        self.manager.fill_row(self, row)

    def copy(self) -> GrammarState:
        """A beam's child: the parent's grammar as it stands, to be advanced on its own."""
        state = GrammarState(self.matcher.deep_copy(), self.manager)
        state.num_consumed = self.num_consumed
        return state

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar accepts from where it stands (speculative proposals are cut there)."""
        return int(self.matcher.validate_tokens([int(t) for t in tokens])) if tokens else 0

    def after(self, tokens: Sequence[int]) -> GrammarAfter:
        """This grammar as it would stand after `tokens` (a verified proposal's prefix), for one bitmask row."""
        return GrammarAfter(self, tuple(int(t) for t in tokens))

    def ends_after(self, token: int) -> bool:
        """Whether `token` would end the grammar (left where it is): a beam candidate that finishes."""
        if self.matcher.validate_tokens([int(token)]) != 1 or not self.matcher.consume_token(int(token)):
            return False
        ended = bool(self.matcher.is_stopped())
        self.matcher.rollback(1)
        return ended

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar refuses it (the sequence is then ended)."""
        self.num_consumed += 1
        return bool(self.matcher.consume_token(int(token)))

    @property
    def is_terminated(self) -> bool:
        """Nothing more can follow (the grammar ended, EOS consumed, or an error)."""
        return bool(self.matcher.is_stopped() or self.matcher.is_error())


class GrammarAfter:
    """A speculative row's grammar: the sequence's, advanced by the proposals before that row only while its mask is
    filled (consume, fill, roll back), so the sequence's own matcher never moves ahead of its accepted tokens."""

    __slots__ = ("state", "tokens")

    def __init__(self, state: GrammarState, tokens: tuple[int, ...]):
        self.state, self.tokens = state, tokens

    @property
    def num_consumed(self) -> int:
        return self.state.num_consumed + len(self.tokens)

    def fill_bitmask(self, row: np.ndarray) -> None:
        matcher, consumed = self.state.matcher, 0
        try:
            for token in self.tokens:
                if not matcher.consume_token(token):
                    raise RuntimeError(f"a proposal the grammar refuses reached verification: {self.tokens}")
                consumed += 1
            self.state.fill_bitmask(row)
        finally:
            if consumed:
                matcher.rollback(consumed)


def thinking_closed(prompt_text: str, start: str | None, end: str) -> bool:
    """Whether a prompt has already closed the thinking: its last marker is `end` (a template that turned thinking
    off writes an empty `<think></think>`). A prompt with no marker, or one that opens it, leaves it open."""
    at_end = prompt_text.rfind(end)
    return at_end >= 0 and (start is None or prompt_text.rfind(start) < at_end)


class AfterReasoning:
    """A sequence's grammar that starts once its thinking has ended: until the output's text holds the end marker
    every token is allowed; from the token that completes it on, `inner` masks and consumes as usual. The marker is
    matched on the tokens' text, so it may span tokens (or share one with other text)."""

    __slots__ = ("end", "inner", "num_consumed", "tail", "thinking", "token_text")

    def __init__(self, inner: GrammarState, end: str, token_text, thinking: bool = True):
        self.inner, self.end, self.token_text = inner, end, token_text
        self.thinking = thinking
        self.tail = ""  # the thinking's last len(end) - 1 characters: a marker may begin there
        self.num_consumed = 0

    def _scan(self, tail: str, tokens: Sequence[int]) -> tuple[str, int | None]:
        """(the tail after `tokens`, how many of them the thinking takes: the marker ends at that one; None: all)."""
        for k, token in enumerate(tokens):
            text = tail + self.token_text(int(token))
            if self.end in text:
                return "", k + 1
            tail = text[len(text) - len(self.end) + 1 :] if len(self.end) > 1 else ""
        return tail, None

    def fill_bitmask(self, row: np.ndarray) -> None:
        if self.thinking:
            row[:] = -1
        else:
            self.inner.fill_bitmask(row)

    def copy(self) -> AfterReasoning:
        state = AfterReasoning(self.inner.copy(), self.end, self.token_text, self.thinking)
        state.tail, state.num_consumed = self.tail, self.num_consumed
        return state

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        if not self.thinking:
            return self.inner.valid_prefix(tokens)
        _, taken = self._scan(self.tail, tokens)
        return len(tokens) if taken is None else taken + self.inner.valid_prefix(tokens[taken:])

    def after(self, tokens: Sequence[int]) -> AfterReasoning:
        """A view for one speculative row's mask: the thinking's or, once the marker is in `tokens`, the grammar's
        after what follows it."""
        tail, taken = ("", 0) if not self.thinking else self._scan(self.tail, tokens)
        inner = self.inner if taken is None else self.inner.after(tokens[taken:])
        state = AfterReasoning(inner, self.end, self.token_text, thinking=taken is None)
        state.tail, state.num_consumed = tail, self.num_consumed + len(tokens)
        return state

    def ends_after(self, token: int) -> bool:
        return False if self.thinking else self.inner.ends_after(token)

    def accept(self, token: int) -> bool:
        self.num_consumed += 1
        if not self.thinking:
            return self.inner.accept(token)
        self.tail, taken = self._scan(self.tail, [token])
        self.thinking = taken is None
        return True

    @property
    def is_terminated(self) -> bool:
        return not self.thinking and self.inner.is_terminated


class StructuredOutputManager:
    """One engine's grammars: compiles and caches them, and fills the bitmask rows of a step."""

    def __init__(self, tokenizer, eos_token_ids: Sequence[int], vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width, which the mask must cover
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._ll_tokenizer = None
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()  # (kind, text) -> a fresh LLMatcher
        self._scratch: np.ndarray | None = None
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (reasoning markers are matched on text)

    @property
    def ll_tokenizer(self):
        """The tokenizer as llguidance sees it, built on first use (about a second for a large vocabulary)."""
        if self._ll_tokenizer is None:
            import llguidance.hf

            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer, and this model has none")
            n_vocab = max(self.vocab_size, len(self.tokenizer))
            eos = [t for t in self.eos_token_ids if t < n_vocab]
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=n_vocab, eos_token=eos or None)
            self._scratch = np.full((1, -(-n_vocab // 32)), -1, np.int32)
        return self._ll_tokenizer

    def _compile(self, params: StructuredOutputsParams):
        from llguidance import LLMatcher

        kind, text = _grammar_text(params)
        key = (kind, text)
        cached = self._compiled.get(key)
        if cached is not None:
            self._compiled.move_to_end(key)
            return cached
        try:
            if kind in ("json", "json_object"):  # options in x-guidance (compact unless asked: _grammar_text)
                grammar = LLMatcher.grammar_from_json_schema(text)
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(text)
            elif kind == "choice":
                grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
            else:
                grammar = LLMatcher.grammar_from_lark(text)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {e}") from None
        error = LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {error.strip().splitlines()[0]}")
        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {matcher.get_error().splitlines()[0]}")
        self._compiled[key] = matcher
        if len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return matcher

    def new_state(self, params: StructuredOutputsParams, prompt_ids: Sequence[int] = ()) -> GrammarState | AfterReasoning:
        """A sequence's own matcher (a copy of the cached compiled one), behind the thinking when the params name
        its markers and the prompt leaves it open. Raises ValueError naming the field."""
        state = GrammarState(self._compile(params).deep_copy(), self)
        if params.reasoning_end is None:
            return state
        prompt_text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False) if len(prompt_ids) else ""
        thinking = not thinking_closed(prompt_text, params.reasoning_start, params.reasoning_end)
        return AfterReasoning(state, params.reasoning_end, self.token_text, thinking)

    def token_text(self, token: int) -> str:
        """One token's text with special tokens kept (markers such as gpt-oss's are special), cached."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    @property
    def num_cached(self) -> int:
        return len(self._compiled)

    def fill_row(self, state: GrammarState, row: np.ndarray) -> None:
        """Write the tokens `state` allows next into one bitmask row (sampler.bitmask_words(vocab) int32)."""
        from llguidance.numpy import fill_next_token_bitmask

        self.ll_tokenizer  # noqa: B018 - sizes the scratch row
        scratch = self._scratch
        fill_next_token_bitmask(state.matcher, scratch, 0)
        n = min(scratch.shape[1], row.shape[0])
        row[:n] = scratch[0, :n]
        row[n:] = 0

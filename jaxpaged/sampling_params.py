"""How one request wants its tokens chosen, under vLLM's names and defaults.

Every field is checked here, once, on the host: the sampler runs inside a fixed-shape jitted step
where a bad value would surface as a NaN or a silent clamp, so a bad value is refused up front
with a ValueError that names the field and the range it must lie in.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import numbers
from collections.abc import Sequence

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries of logit_bias
MAX_BAD_WORDS = 64
# a row's biased ids in one step: its logit_bias, then at most one id each bad word's token sequences bans (a word is
# tokenized alone and after a space, as vLLM does: two sequences at most)
LOGIT_BIAS_WIDTH = MAX_LOGIT_BIAS + 2 * MAX_BAD_WORDS
MAX_SEED = 2**63
# vLLM samples greedily below this temperature: dividing logits by it would overflow float32.
_GREEDY_EPS = 1e-5



class RequestOutputKind(enum.IntEnum):
    """Which RequestOutputs a request yields (vLLM's names): every step's cumulative output, or the final one only.
    LLM.generate asks for FINAL_ONLY, so the step loop builds no output (and decodes no text) until a request ends."""

    CUMULATIVE = 0
    FINAL_ONLY = 2

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# vLLM's JSON options beside the constraint (structural_tag, also vLLM's, is refused)
STRUCTURED_OUTPUT_OPTIONS = ("disable_any_whitespace", "whitespace_pattern", "disable_additional_properties", "disable_fallback")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one constraint on what the request may generate.

    json: a JSON schema (a dict, or its text); json_object: any JSON object; regex: the whole output
    matches it; choice: the output is one of these strings; grammar: a Lark (EBNF) grammar. They are
    compiled (llguidance) when the request is added: one llguidance cannot compile is refused there
    with a ValueError naming the field (engine/structured_output.py).

    vLLM's JSON options: disable_any_whitespace (None: this engine's default, compact JSON, because a weak
    model can pad with whitespace forever; False: whitespace allowed between tokens, vLLM's default),
    whitespace_pattern (a regex for that whitespace), disable_additional_properties (objects take only the
    properties their schema lists). disable_fallback is accepted and has no effect: there is one backend.
    structural_tag is refused.

    reasoning_start / reasoning_end: a reasoning model's thinking markers (e.g. "<think>", "</think>"; the server's
    reasoning parser sets them): the constraint then applies to the answer only, from the moment the output has
    written reasoning_end, or at once when the prompt already closed the thinking (its last marker is the end one).
    """

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    structural_tag: str | None = None
    reasoning_start: str | None = None
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        for name in ("reasoning_start", "reasoning_end"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string (got {value!r})")
        if self.reasoning_start is not None and self.reasoning_end is None:
            raise ValueError("structured_outputs.reasoning_start needs reasoning_end")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported")
        given = [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)} "
                f"(got {', '.join(given) or 'none'})"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a dict or a JSON string (got {type(self.json).__name__})")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool (got {self.json_object!r})")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string (got {value!r})")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, Sequence) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings (got {self.choice!r})")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must hold non-empty strings (got {self.choice!r})")
            object.__setattr__(self, "choice", list(self.choice))
        self._check_json_options()

    def _check_json_options(self) -> None:
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name} must be a bool (got {value!r})")
        pattern = self.whitespace_pattern
        if pattern is not None and (not isinstance(pattern, str) or not pattern):
            raise ValueError(f"structured_outputs.whitespace_pattern must be a non-empty string (got {pattern!r})")
        json_kind = self.kind in ("json", "json_object")
        for name in ("disable_any_whitespace", "whitespace_pattern", "disable_additional_properties"):
            if getattr(self, name) not in (None, False) and not json_kind:
                raise ValueError(f"structured_outputs.{name} applies to json and json_object only")
        if pattern is not None and self.disable_any_whitespace:
            raise ValueError("structured_outputs.whitespace_pattern cannot be combined with disable_any_whitespace=True")

    @property
    def kind(self) -> str:
        """Which field is set."""
        return next(name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False))


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _int(name: str, value: object) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int (got {value!r})")
    return int(value)


def _float(name: str, value: object) -> float:
    """A finite float; ints are welcome, bools and strings are not (they are almost always a typo)."""
    if not _is_real(value):
        raise ValueError(f"{name} must be a number (got {value!r})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite (got {value!r})")
    return value


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (got {value!r})")
    return value


def _in_range(name: str, value: float, lo: float, hi: float, allowed: str) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be {allowed} (got {value!r})")


def _optional_logprobs(name: str, value: object) -> int | None:
    if value is None:
        return None
    value = _int(name, value)
    _in_range(name, value, 0, MAX_LOGPROBS, f"None or in [0, {MAX_LOGPROBS}]")
    return value


def _stop_strings(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Sequence):
        raise ValueError(f"stop must be None, a str or a list of str (got {value!r})")
    stops = list(value)
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings (got {len(stops)})")
    for s in stops:
        if not isinstance(s, str):
            raise ValueError(f"stop must be None, a str or a list of str (got an item {s!r})")
        if not 1 <= len(s) <= MAX_STOP_STRING_LEN:
            raise ValueError(f"stop strings must be non-empty and at most {MAX_STOP_STRING_LEN} chars (got {s!r})")
    return stops


def _id_list(name: str, value: object) -> list[int]:
    """A list of token ids, each an int >= 0."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be None or a list of int (got {value!r})")
    ids = [_int(name, t) for t in value]
    for t in ids:
        if t < 0:
            raise ValueError(f"{name} must be >= 0 (got {t})")
    return ids


def _stop_token_ids(value: object) -> list[int]:
    if value is None:
        return []
    ids = _id_list("stop_token_ids", value)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids (got {len(ids)})")
    return ids


def _logit_bias(value: object) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be None or a dict of token id to bias (got {value!r})")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS} entries (got {len(value)})")
    bias = {}
    for token, b in value.items():
        token = _int("logit_bias's keys (token ids)", token)
        if token < 0:
            raise ValueError(f"logit_bias's keys (token ids) must be >= 0 (got {token})")
        bias[token] = _float(f"logit_bias[{token}]", b)
    return bias or None


def _allowed_token_ids(value: object) -> list[int] | None:
    if value is None:
        return None
    ids = _id_list("allowed_token_ids", value)
    if not ids:
        raise ValueError("allowed_token_ids must not be empty (None allows every token)")
    return ids


def _bad_words(value: object) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"bad_words must be None or a list of str (got {value!r})")
    words = list(value)
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words must hold at most {MAX_BAD_WORDS} words (got {len(words)})")
    for w in words:
        if not isinstance(w, str) or not w.strip():
            raise ValueError(f"bad_words must hold non-blank strings (got an item {w!r})")
    return words or None


@dataclasses.dataclass
class SamplingParams:
    """vLLM's SamplingParams, minus what this engine does not do yet (those fields are refused, not ignored)."""

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = 0  # 0, -1 or None: no limit (stored as 0)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None  # stored as a list
    stop_token_ids: list[int] | None = None  # stored as a list
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False  # older vLLM: beam width = best_of, the n best beams come back
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # beam search: True, False or "never", as in transformers
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar to follow
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # outputs every step, or FINAL_ONLY
    logit_bias: dict[int, float] | None = None  # added to these ids' logits before penalties (vLLM's order)
    allowed_token_ids: list[int] | None = None  # only these ids may be sampled
    bad_words: list[str] | None = None  # never completed: a word's last token is banned once the rest precedes it
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the last max_model_len)
    detokenize: bool = True  # False: token ids only (no text, logprobs without decoded tokens)
    spaces_between_special_tokens: bool = True  # read by slow tokenizers' decode only, as in transformers and vLLM
    # vLLM's: the most tokens a reasoning model may think (between its markers) before the end marker is forced
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        self.n = _int("n", self.n)
        _in_range("n", self.n, 1, MAX_N, f"in [1, {MAX_N}]")
        if self.best_of is not None:
            self.best_of = _int("best_of", self.best_of)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be None or >= n={self.n} (got {self.best_of})")

        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature!r})")
        self.top_p = _float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p!r})")
        top_k = 0 if self.top_k is None else _int("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1 (got {top_k})")
        self.top_k = max(top_k, 0)
        self.min_p = _float("min_p", self.min_p)
        _in_range("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            _in_range(name, value, -2.0, 2.0, "in [-2, 2]")
            setattr(self, name, value)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (got {self.repetition_penalty!r})")

        if self.seed is not None:
            self.seed = _int("seed", self.seed)
            if not 0 <= self.seed < MAX_SEED:
                raise ValueError(f"seed must be None or in [0, 2**63) (got {self.seed})")

        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        self.logit_bias = _logit_bias(self.logit_bias)
        self.allowed_token_ids = _allowed_token_ids(self.allowed_token_ids)
        if self.thinking_token_budget is not None:
            self.thinking_token_budget = _int("thinking_token_budget", self.thinking_token_budget)
            if self.thinking_token_budget < 0:
                raise ValueError(f"thinking_token_budget must be >= 0 (got {self.thinking_token_budget})")
        self.bad_words = _bad_words(self.bad_words)

        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be None or >= 1 (got {self.max_tokens})")
        self.min_tokens = _int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0 (got {self.min_tokens})")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens} (got {self.min_tokens})")

        self.logprobs = _optional_logprobs("logprobs", self.logprobs)
        self.prompt_logprobs = _optional_logprobs("prompt_logprobs", self.prompt_logprobs)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "use_beam_search", "detokenize",
                     "spaces_between_special_tokens"):
            setattr(self, name, _bool(name, getattr(self, name)))
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need detokenize=True (the text they are found in)")
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(f"truncate_prompt_tokens must be None, -1 or >= 1 (got {self.truncate_prompt_tokens})")
        self.length_penalty = _float("length_penalty", self.length_penalty)
        from jaxpaged.engine.beam_search import check_early_stopping

        check_early_stopping(self.early_stopping)  # checked even without beam search: a typo is an error, not a no-op

        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be None or a StructuredOutputsParams (got {type(self.structured_outputs).__name__})"
            )

        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            kinds = ", ".join(f"{k.name} ({k.value})" for k in RequestOutputKind)
            raise ValueError(f"output_kind must be a RequestOutputKind: {kinds} (got {self.output_kind!r})") from None

        if self.use_beam_search:
            self._check_beam_search()
        elif self.best_of is not None and self.best_of > self.n:
            raise NotImplementedError("best_of > n is only supported with use_beam_search=True")

        if self.is_greedy:
            # As vLLM: truncation cannot change an argmax, and neutral values let the sampler skip its sort.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_beam_search(self) -> None:
        """Beam search ranks by logprob alone: every knob that would change the distribution is refused."""
        if self.temperature != 0:
            raise ValueError(f"temperature must be 0 when use_beam_search=True (got {self.temperature!r})")
        self.best_of = self.n if self.best_of is None else self.best_of
        unsupported = {
            "stop": self.stop, "stop_token_ids": self.stop_token_ids, "min_tokens": self.min_tokens,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty != 1.0, "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None, "logit_bias": self.logit_bias,
            "allowed_token_ids": self.allowed_token_ids, "bad_words": self.bad_words,
        }  # fmt: skip
        for name, value in unsupported.items():
            if value:
                raise ValueError(f"{name} is not supported with use_beam_search=True")

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's SamplingParams.clone): changing the copy's lists (stop, stop_token_ids) leaves this one
        as it was."""
        return copy.deepcopy(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler needs the row's token history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def has_token_controls(self) -> bool:
        """Whether some ids' logits are moved or banned for this request: logit_bias, allowed_token_ids, bad_words."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    @property
    def uses_truncation(self) -> bool:
        """Whether the sampler needs its sort (top-k, top-p or min-p)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

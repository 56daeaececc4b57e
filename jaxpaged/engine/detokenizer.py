"""Output token ids to streamed text: incremental, UTF-8 safe, with stop strings.

Decoding the whole output after every token costs O(n) per token, O(n^2) per request. Like
vLLM, we decode only a short window: `prefix_offset:read_offset` is text already returned
(decoded again only as context, so a token's leading space and byte merges come out as they
would in the full text), `read_offset:` is new. The difference of the two decodes is the new
text. While the window's text ends in U+FFFD a multi-byte character is still incomplete, so
nothing is returned and the offsets stay put until a later token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence

# Prompt tokens decoded as context for the first output token (vLLM's value).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text pieces as they arrive.

    `push` returns the text that is safe to show now; `flush` returns the rest when the request
    ends for another reason (length, EOS). The pieces joined equal `text`. A stop string ends the
    output: `finished` becomes True, `stop_reason` names it, and nothing after it is returned.
    """

    def __init__(
        self,
        tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: str | Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        prompt_token_ids: Sequence[int] | None = None,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        spaces_between_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop: tuple[str, ...] = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens  # as vLLM: no stop string can end the output before min_tokens + 1 tokens
        # the tokens that end the output by themselves (EOS unless ignored, stop_token_ids): as in vLLM, the one that
        # does is counted but adds no text (with skip_special_tokens off, "<|im_end|>" would end every answer), unless
        # include_stop_str_in_output asks for it (vLLM's detokenizer then renders it as any other token)
        self._stop_token_ids = frozenset() if include_stop_str_in_output else frozenset(int(t) for t in stop_token_ids)
        self._num_tokens = 0
        self.finished = False
        self.stop_reason: str | None = None
        # transformers may "clean up" spaces before punctuation, which would differ between a
        # window and the full text; the raw `tokenizers` decode has no such option.
        self._decode_kwargs = {"clean_up_tokenization_spaces": False} if hasattr(tokenizer, "clean_up_tokenization_spaces") else {}
        if not spaces_between_special_tokens:  # (a slow tokenizer's option: a fast one's decode has none, as in vLLM)
            self._decode_kwargs["spaces_between_special_tokens"] = False
        # a fast tokenizer decodes with its Rust backend directly: the same text, without transformers' per-id checks
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode = backend.decode if callable(getattr(backend, "decode", None)) else None

        # The window seeds from the prompt's tail so the first output token decodes in context.
        context = [] if prompt_token_ids is None else prompt_token_ids[len(prompt_token_ids) - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET :]
        self._ids: list[int] = [int(i) for i in context]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode of ids[prefix_offset:read_offset], cached

        # Longest stop minus one: a match ending in new text starts at most this far back.
        self._lookback = max(map(len, self.stop), default=1) - 1
        self._tail = ""  # the last `_lookback` chars of the decoded text
        self._pending = ""  # decoded but held back: it may be the start of a stop string
        self._returned: list[str] = []
        self._flushed = False

    @property
    def text(self) -> str:
        """The output text so far, truncated at a stop string; held-back text included."""
        return "".join(self._returned) + self._pending

    @property
    def output_text(self) -> str:
        """What push/flush have returned so far; equals `text` once flushed or stopped."""
        return "".join(self._returned)

    def push(self, token_id: int) -> str:
        """Add one output token; return the new text now safe to show (may be "")."""
        if self._flushed:
            raise RuntimeError("push() after flush(): the request's output is already complete")
        if self.finished:
            return ""  # a token sampled in the same step as the stop string is dropped
        self._num_tokens += 1
        if self._ends_output(int(token_id), self._num_tokens):
            return ""
        self._ids.append(int(token_id))
        return self._accept(self._decode_new(final=False), final=False)

    def push_many(self, token_ids: Sequence[int]) -> str:
        """Add several output tokens at once (one decode for all): a request whose text nobody reads until it ends
        and that has no stop strings (which must be found token by token) is decoded this way when it finishes."""
        if self.stop:
            raise ValueError("push_many() would miss where a stop string ends: push() token by token")
        if self._flushed:
            raise RuntimeError("push_many() after flush(): the request's output is already complete")
        ids = [int(t) for t in token_ids]
        self._num_tokens += len(ids)
        if ids and self._ends_output(ids[-1], self._num_tokens):
            ids.pop()
        self._ids.extend(ids)
        return self._accept(self._decode_new(final=False), final=False)

    def _ends_output(self, token_id: int, num_tokens: int) -> bool:
        """Whether this token, the num_tokens-th, ends the output by itself (the scheduler's check_stop rule)."""
        return token_id in self._stop_token_ids and num_tokens >= self.min_tokens

    @property
    def num_tokens(self) -> int:
        """Output tokens pushed so far."""
        return self._num_tokens

    def flush(self) -> str:
        """End the output: return everything still held back (an incomplete character decodes as U+FFFD, as in a full decode)."""
        if self._flushed or self.finished:
            self._flushed = True
            return ""
        self._flushed = True
        return self._accept(self._decode_new(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens, **self._decode_kwargs)

    def _decode_new(self, *, final: bool) -> str:
        """The text the tokens after `read_offset` add, or "" while it ends in a partial character."""
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) <= len(self._prefix_text) or (window.endswith(_REPLACEMENT) and not final):
            return ""
        new = window[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        return new

    def _accept(self, new: str, *, final: bool) -> str:
        """Append decoded text, look for a stop string in it, and return what may be shown."""
        if not new and not final:
            return ""
        search = self._tail + new
        hit = self._find_stop(search, len(self._tail)) if self._num_tokens > self.min_tokens else None
        if hit is not None:
            start, end, stop = hit
            cut = end if self.include_stop_str_in_output else start
            # The cut never reaches text already returned: a stop string's start is held back.
            visible = self._pending + new
            visible = visible[: len(visible) - (len(search) - cut)]
            self.finished, self.stop_reason = True, stop
            self._pending = ""
            return self._return(visible)
        if self._lookback:
            self._tail = search[-self._lookback :]
        pending = self._pending + new
        hold = 0 if final or self.include_stop_str_in_output else self._stop_prefix_len(pending)
        self._pending = pending[len(pending) - hold :]
        return self._return(pending[: len(pending) - hold])

    def _find_stop(self, search: str, old_len: int) -> tuple[int, int, str] | None:
        """The stop string that completes first in `search` (ending after `old_len`), as (start, end, stop).

        Earliest end, then earliest start: the same answer however the text was split into tokens.
        """
        best = None
        for stop in self.stop:
            start = search.find(stop, max(0, old_len - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best[1::-1]):
                best = (start, start + len(stop), stop)
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that some stop string starts with."""
        for n in range(min(self._lookback, len(text)), 0, -1):
            suffix = text[-n:]
            if any(stop.startswith(suffix) for stop in self.stop):
                return n
        return 0

    def _return(self, piece: str) -> str:
        if piece:
            self._returned.append(piece)
        return piece

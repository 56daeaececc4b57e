"""Per-token logprobs in the two shapes OpenAI uses (completions' parallel lists, chat's objects)."""

from __future__ import annotations

from jaxpaged.outputs import CompletionOutput, Logprob


class TokenBytes:
    """A token's exact bytes: byte-level BPE vocabularies spell bytes as printable characters (GPT-2's map),
    so a token holding part of a UTF-8 character still reports its real bytes, not U+FFFD."""

    def __init__(self, tokenizer):
        from jaxpaged.models.gguf_io import _bytes_to_unicode

        self.tokenizer = tokenizer
        self.byte_of = {ch: b for b, ch in _bytes_to_unicode().items()}
        self._cache: dict[int, list[int]] = {}  # bounded by the vocabulary

    def __call__(self, token_id: int, decoded: str) -> list[int]:
        cached = self._cache.get(token_id)
        if cached is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) if self.tokenizer is not None else None
            if isinstance(piece, str) and piece and all(ch in self.byte_of for ch in piece):
                cached = [self.byte_of[ch] for ch in piece]
            else:
                cached = list(decoded.encode("utf-8"))
            self._cache[token_id] = cached
        return list(cached)


def _ranked(entry: dict[int, Logprob], limit: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(((tid, lp) for tid, lp in entry.items() if lp.rank is not None), key=lambda item: item[1].rank)
    return ranked[:limit]


FLOOR = -9999.0  # JSON has no -inf: a token a grammar forbids reports this, as vLLM's server does


def _value(lp: Logprob) -> float:
    return max(lp.logprob, FLOOR)


def _text(lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


def _completion_lists() -> dict[str, list]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _completion_top(chosen: Logprob, entry: dict[int, Logprob], top: int) -> dict[str, float]:
    """The chosen token first, then the `top` most likely: k+1 entries when it is not among them (vLLM's and
    OpenAI's legacy shape; chat's list keeps the top k alone, the chosen token having its own fields)."""
    return {_text(chosen): _value(chosen), **{_text(lp): _value(lp) for _, lp in _ranked(entry, top)}}


def _add_token(lists: dict, token_id: int, entry: dict[int, Logprob], top: int, offset: int) -> int:
    chosen = entry[token_id]
    lists["tokens"].append(_text(chosen))
    lists["token_logprobs"].append(_value(chosen))
    lists["top_logprobs"].append(_completion_top(chosen, entry, top))
    lists["text_offset"].append(offset)
    return offset + len(_text(chosen))


def completion_logprobs(c: CompletionOutput, start: int, end: int, top: int, offset: int) -> tuple[dict, int]:
    """Completions' shape for tokens [start, end) of a choice, and the offset after them.

    `text_offset` adds up the tokens' own texts from `offset` (0 at the first generated token, or at the
    first prompt token with echo).
    """
    lists = _completion_lists()
    for k in range(start, end):
        offset = _add_token(lists, c.token_ids[k], c.logprobs[k], top, offset)
    return lists, offset


def prompt_completion_logprobs(token_ids: list[int], entries: list, top: int, first_text: str) -> tuple[dict, int]:
    """Completions' shape for an echoed prompt: as in OpenAI's API, the first token has no logprob or alternatives."""
    lists = {"tokens": [first_text], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    offset = len(first_text)
    for token_id, entry in zip(token_ids[1:], entries[1:]):
        offset = _add_token(lists, token_id, entry, top, offset)
    return lists, offset


def join_logprobs(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(c: CompletionOutput, start: int, end: int, top: int, token_bytes: TokenBytes) -> list[dict]:
    """Chat's shape: one object per token, with its top alternatives."""
    content = []
    for k in range(start, end):
        entry = c.logprobs[k]
        tid = c.token_ids[k]
        chosen = entry[tid]
        content.append({
            "token": _text(chosen), "logprob": _value(chosen), "bytes": token_bytes(tid, _text(chosen)),
            "top_logprobs": [
                {"token": _text(lp), "logprob": _value(lp), "bytes": token_bytes(t, _text(lp))} for t, lp in _ranked(entry, top)
            ],
        })
    return content


def vllm_prompt_logprobs(entries: list | None, top: int) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt position (None first) the prompt token's {logprob, rank, decoded_token}
    and the `top` most likely tokens', keyed by token id."""
    if entries is None:
        return None
    out = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        token, lp = next(iter(entry.items()))  # the prompt's own token comes first
        shown = {token: lp, **dict(_ranked(entry, top))}
        out.append({str(t): {"logprob": _value(v), "rank": v.rank, "decoded_token": v.decoded_token} for t, v in shown.items()})
    return out

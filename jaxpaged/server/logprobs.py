"""Per-token logprobs in the two shapes OpenAI uses (completions' parallel lists, chat's objects)."""

from __future__ import annotations

from jaxpaged.outputs import CompletionOutput, Logprob


class TokenBytes:
    """A token's exact bytes: byte-level BPE vocabularies spell bytes as printable characters (GPT-2's map),
    so a token holding part of a UTF-8 character still reports its real bytes, not U+FFFD."""

    def __init__(self, tokenizer):
        from models.gguf_io import _bytes_to_unicode

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


def _text(lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


def completion_logprobs(c: CompletionOutput, start: int, end: int, top: int, offset: int) -> tuple[dict, int]:
    """Completions' shape for tokens [start, end) of a choice, and the offset after them.

    `text_offset` adds up the tokens' own texts from `offset` (0 at the first generated token).
    """
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for k in range(start, end):
        entry = c.logprobs[k]
        chosen = entry[c.token_ids[k]]
        tokens.append(_text(chosen))
        token_logprobs.append(chosen.logprob)
        top_logprobs.append({_text(lp): lp.logprob for _, lp in _ranked(entry, top)})
        text_offset.append(offset)
        offset += len(_text(chosen))
    lists = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}
    return lists, offset


def chat_logprobs(c: CompletionOutput, start: int, end: int, top: int, token_bytes: TokenBytes) -> list[dict]:
    """Chat's shape: one object per token, with its top alternatives."""
    content = []
    for k in range(start, end):
        entry = c.logprobs[k]
        tid = c.token_ids[k]
        chosen = entry[tid]
        content.append({
            "token": _text(chosen), "logprob": chosen.logprob, "bytes": token_bytes(tid, _text(chosen)),
            "top_logprobs": [
                {"token": _text(lp), "logprob": lp.logprob, "bytes": token_bytes(t, _text(lp))} for t, lp in _ranked(entry, top)
            ],
        })
    return content

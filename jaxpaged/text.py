"""Prompts in, text out: chat templates, stop tokens and UTF-8-safe streaming."""

from __future__ import annotations

from models.loader import LoadedModel


def encode_prompt(tokenizer, prompt: str, *, chat: bool = False, system: str | None = None) -> list[int]:
    if not chat:
        return list(tokenizer.encode(prompt))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; drop --chat")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def stop_token_ids(loaded: LoadedModel) -> list[int]:
    stops = set(loaded.config.eos_token_ids)
    eos = getattr(loaded.tokenizer, "eos_token_id", None)
    if eos is not None:
        stops.add(int(eos))
    return sorted(stops)


class StreamingDecoder:
    """Yields the new text as tokens arrive, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[self.emitted :], len(text)
        return new

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        new, self.emitted = text[self.emitted :], len(text)
        return new

"""A request's logit_bias, allowed_token_ids and bad_words, checked against the model's vocabulary and put in the
form the sampler's rows take (worker/sampler.py): once, when the request is added.

As vLLM: allowed_token_ids masks the logits (not the logprobs a request gets back), bad_words bans a word's last token
once the output ends with the rest of it, logit_bias is added after both and before the penalties.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpaged.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class TokenControls:
    bias_ids: np.ndarray  # [k] i32 logit_bias's ids
    bias_values: np.ndarray  # [k] f32 their biases
    allowed_mask: np.ndarray | None  # [ceil(V / 32)] i32 allowed_token_ids as the sampler's packed bitmask words
    bad_words: tuple[tuple[int, ...], ...]  # token sequences; the last id of each is banned after the others

    @property
    def reads_tokens(self) -> bool:
        """A bad word of more than one token is banned depending on the latest outputs."""
        return any(len(word) > 1 for word in self.bad_words)

    def banned(self, output_ids) -> list[int]:
        """The ids the bad words ban after these outputs."""
        out = []
        for word in self.bad_words:
            prefix = len(word) - 1
            if prefix == 0:
                out.append(word[0])
            elif len(output_ids) >= prefix and list(output_ids[len(output_ids) - prefix :]) == list(word[:-1]):
                out.append(word[-1])
        return out


def token_controls(params: SamplingParams, vocab_size: int, tokenizer) -> TokenControls | None:
    """None when the request has none; a ValueError naming the parameter for ids outside the vocabulary."""
    if not params.has_token_controls:
        return None
    bias = params.logit_bias or {}
    outside = sorted(t for t in bias if t >= vocab_size)
    if outside:
        raise ValueError(f"logit_bias holds token ids outside the vocabulary [0, {vocab_size}): {outside[:8]}")
    allowed_mask = None
    if params.allowed_token_ids:
        ids = np.asarray(params.allowed_token_ids, np.int64)
        if ids.max() >= vocab_size:
            raise ValueError(f"allowed_token_ids holds token ids outside the vocabulary [0, {vocab_size}): "
                             f"{sorted(set(ids[ids >= vocab_size].tolist()))[:8]}")  # fmt: skip
        bits = np.zeros(-(-vocab_size // 32) * 32, bool)
        bits[ids] = True  # bit i of word w: token 32 w + i
        allowed_mask = np.packbits(bits.reshape(-1, 32), axis=1, bitorder="little").view("<u4")[:, 0].view(np.int32)
    words = _bad_word_ids(params.bad_words or (), vocab_size, tokenizer)
    return TokenControls(np.fromiter(bias, np.int32, len(bias)), np.fromiter(bias.values(), np.float32, len(bias)),
                         allowed_mask, words)  # fmt: skip


def _bad_word_ids(words, vocab_size: int, tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization: each word alone, and after a space where that starts with another token into as many."""
    if not words:
        return ()
    if tokenizer is None:
        raise ValueError("bad_words needs the model's tokenizer, and this model has none")
    out: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not alone:
            raise ValueError(f"bad_words: {word!r} is no token at all")
        out.append(alone)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    outside = sorted({t for word in out for t in word if not 0 <= t < vocab_size})
    if outside:
        raise ValueError(f"bad_words tokenize to ids outside the model's vocabulary [0, {vocab_size}): {outside[:8]}")
    return tuple(out)

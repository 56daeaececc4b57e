"""Proposers: each guesses up to k next tokens per sequence from what the host knows; the target verifies them.

A proposer sees the sequences' known tokens (prompt + outputs), a per-sequence k and the sequences' ids, and returns
a list of proposed ids per sequence (possibly empty). One that keeps state per sequence (draft_model.py: KV blocks)
lists the ids it holds in `held`, and the engine `release`s those that stop running. EAGLE/MTP heads would
implement the same calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

PAD = -1  # left padding of the batched token array; never a token id, so never part of a match


class Proposer(Protocol):
    held: Iterable[str]  # ids of the sequences it keeps state for

    def propose(self, tokens: Sequence[Sequence[int]], ks: Sequence[int], seq_ids: Sequence[str]) -> list[list[int]]: ...

    def release(self, seq_ids: Iterable[str]) -> None: ...


class NgramProposer:
    """Prompt lookup (vLLM's ngram): find the longest suffix of n tokens (prompt_lookup_max down to
    prompt_lookup_min) that occurred earlier in the sequence, and propose the k tokens that followed its most
    recent earlier occurrence. The whole batch is one padded array and each n one vectorized comparison."""

    held = ()  # stateless: it searches each sequence's tokens afresh

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def release(self, seq_ids: Iterable[str]) -> None:
        pass

    def propose(self, tokens: Sequence[Sequence[int]], ks: Sequence[int], seq_ids: Sequence[str] = ()) -> list[list[int]]:
        b = len(tokens)
        if b == 0:
            return []
        lengths = np.fromiter((len(t) for t in tokens), np.int64, b)
        width = int(lengths.max())
        batch = np.full((b, width), PAD, np.int64)  # right-aligned: every row's suffix is the last columns
        for i, t in enumerate(tokens):
            batch[i, width - len(t) :] = t
        found = np.full(b, -1, np.int64)  # column where the proposal starts, per row
        for n in range(min(self.max_n, width - 1), self.min_n - 1, -1):
            todo = (found < 0) & (lengths > n)
            if not todo.any():
                break
            rows = np.flatnonzero(todo)
            suffix = batch[rows, width - n :]
            windows = sliding_window_view(batch[rows, : width - 1], n, axis=1)  # [r, width - n, n], ends before the last
            hit = (windows == suffix[:, None, :]).all(axis=2)
            last = width - n - 1 - np.argmax(hit[:, ::-1], axis=1)  # the most recent match's start
            ok = hit.any(axis=1)
            found[rows[ok]] = last[ok] + n
        out = []
        for i in range(b):
            start = found[i]
            out.append([] if start < 0 else batch[i, start : min(start + ks[i], width)].tolist())
        return out

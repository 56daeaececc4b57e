"""The encoder cache's bookkeeping and the scheduling of encoder work (vLLM's encoder cache and
max_num_encoder_input_tokens), on the host.

The device holds one array of embedding rows (multimodal/runner.py); an image's embeddings take some of its rows,
found by the image's content hash, so the same image in another request (or the same request recomputed after a
preemption) is not encoded again. Entries are kept after use and evicted least recently used first, only when rows
are needed. Nothing holds an entry across steps: device work runs in dispatch order, so a later step's encoder can
only overwrite rows after every earlier step's forward has read them. Within the step being formed, the entries its
tokens read are pinned.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from jaxpaged.models.vision.common import EncoderItem

if TYPE_CHECKING:
    from jaxpaged.core.request import Request


class EncoderCache:
    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self._free = collections.deque(range(num_rows))
        self._entries: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()  # oldest use first
        self.pinned: set[bytes] = set()
        self.hits = 0  # a step's rows found an image's embeddings here (once per step and image)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def rows(self, key: bytes) -> np.ndarray:
        return self._entries[key]

    def touch(self, key: bytes) -> bool:
        """Whether the image is cached; if so it becomes the most recently used."""
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        return True

    def allocate(self, key: bytes, count: int) -> np.ndarray | None:
        """Rows for a new entry, evicting unpinned entries as needed; None when even that leaves too few."""
        if count > self.num_rows:
            return None
        if len(self._free) < count:
            evictable = sum(len(rows) for k, rows in self._entries.items() if k not in self.pinned)
            if len(self._free) + evictable < count:
                return None
            for k in [k for k in self._entries if k not in self.pinned]:
                self._free.extend(self._entries.pop(k).tolist())
                if len(self._free) >= count:
                    break
        rows = np.array([self._free.popleft() for _ in range(count)], np.int32)
        self._entries[key] = rows
        return rows

    def drop(self, key: bytes) -> None:
        rows = self._entries.pop(key, None)
        if rows is not None:
            self._free.extend(rows.tolist())

    @property
    def num_used(self) -> int:
        return self.num_rows - len(self._free)


@dataclasses.dataclass
class EncodeWork:
    """An image to encode before the step runs, and the cache rows its output goes to."""

    item: EncoderItem
    rows: np.ndarray


class EncoderScheduler:
    """The scheduler's part for images: before a row of a step covers image tokens, their embeddings are cached or
    encoded in this step, within `budget` patches a step and the cache's rows; a row that cannot have them stops before
    the image. With `bidirectional` (Gemma 3) a step never ends inside an image's span: its tokens attend to each
    other, so all of them are computed together."""

    def __init__(self, cache: EncoderCache, budget: int, bidirectional: bool):
        self.cache = cache
        self.budget_per_step = budget
        self.bidirectional = bidirectional
        self.budget = budget
        self.work: list[EncodeWork] = []
        self.num_encoded = 0  # images encoded
        self.num_patches_encoded = 0

    def begin(self) -> None:
        self.budget = self.budget_per_step
        self.work = []
        self.cache.pinned.clear()

    def fit(self, req: Request, start: int, n: int) -> int:
        """How many of the n tokens from `start` the row may take: up to the first image it cannot have."""
        stop = start + n
        for image in req.parent.mm.images:
            if image.end <= start:
                continue
            if image.offset >= stop:
                break
            if self.bidirectional and image.end > stop:  # the step would end inside the span
                stop = max(start, image.offset)
                break
            key = image.key
            if key in self.cache.pinned:
                continue
            if self.cache.touch(key):
                self.cache.pinned.add(key)
                self.cache.hits += 1
                continue
            rows = None if image.item.num_patches > self.budget else self.cache.allocate(key, image.length)
            if rows is None:  # no budget or rows left in this step: up to the image
                stop = max(start, image.offset)
                break
            self.cache.pinned.add(key)
            self.budget -= image.item.num_patches
            self.work.append(EncodeWork(image.item, rows))
        return stop - start

    def end(self, scheduled: bool) -> list[EncodeWork]:
        """The step's encoder work; a step that runs nothing encodes nothing (its entries are given back)."""
        work, self.work = self.work, []
        if not scheduled:
            for w in work:
                self.cache.drop(w.item.key)
            return []
        self.num_encoded += len(work)
        self.num_patches_encoded += sum(w.item.num_patches for w in work)
        return work

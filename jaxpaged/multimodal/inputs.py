"""A request's images as the engine keeps them: each one's encoder input and the span of placeholder tokens its
embeddings replace, and, for M-RoPE models, the prompt's 3-D positions."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxpaged.models.vision.common import EncoderItem


@dataclasses.dataclass
class PlacedImage:
    item: EncoderItem
    offset: int  # its first placeholder token in the prompt

    @property
    def length(self) -> int:
        return self.item.num_rows

    @property
    def end(self) -> int:
        return self.offset + self.item.num_rows

    @property
    def key(self) -> bytes:
        return self.item.key


@dataclasses.dataclass
class MultimodalInputs:
    """What a prompt's images add to its token ids (shared by the request's sequences: n > 1 samples, beams)."""

    images: list[PlacedImage]
    mrope_positions: np.ndarray | None = None  # [3, prompt length] M-RoPE models
    mrope_delta: int = 0  # a generated token at sequence position p has M-RoPE position p + delta (all three)
    end: int = dataclasses.field(init=False)  # the last image's end: rows past it carry no image

    def __post_init__(self):
        self.end = max((image.end for image in self.images), default=0)

    def overlapping(self, start: int, stop: int) -> list[PlacedImage]:
        """The images whose spans meet positions [start, stop)."""
        return [image for image in self.images if image.offset < stop and image.end > start]

    def block_salt(self, start: int, count: int) -> bytes:
        """What a KV block over positions [start, start + count) hashes beside its tokens: the keys of the images it
        holds part of, so equal placeholder tokens of different images never share K/V (prefix caching)."""
        return b"".join(b"img:" + image.key for image in self.overlapping(start, start + count))

    @property
    def num_images(self) -> int:
        return len(self.images)


def place_images(input_ids, image_token_ids: int | Sequence[int], items: list[EncoderItem]) -> list[PlacedImage]:
    """Each item's span among the prompt's placeholder tokens (image_token_ids: the placeholder, or every token an
    image's span is made of: ImageAdapter.placeholder_tokens), in order: item i takes the next num_rows of them, which
    must be contiguous. ValueError when the prompt and the images disagree (the processor expands each image's
    placeholder, so they agree unless the prompt wrote expanded placeholders itself)."""
    at = np.flatnonzero(np.isin(np.asarray(input_ids), image_token_ids))
    need = sum(item.num_rows for item in items)
    if len(at) != need:
        raise ValueError(f"the prompt holds {len(at)} image placeholder tokens where its {len(items)} image(s) need {need}; "
                         "write one placeholder per image as the model's chat template does")  # fmt: skip
    placed, cursor = [], 0
    for item in items:
        span = at[cursor : cursor + item.num_rows]
        if len(span) and span[-1] - span[0] != len(span) - 1:
            raise ValueError("an image's placeholder tokens are not contiguous in the prompt")
        placed.append(PlacedImage(item, int(span[0]) if len(span) else 0))
        cursor += item.num_rows
    return placed

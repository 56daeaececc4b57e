"""Whether the LM head reads the embedding table, decided from the config and the checkpoint as transformers 5 does.

The config's flag is `config.head_tied` (the top-level config's, as transformers reads it). With it set,
transformers' from_pretrained (PreTrainedModel.tie_weights) still looks at the checkpoint: a stored head equal to
the embeddings is a copy and stays tied; a different one unties the two (with a warning) and both are used; a head
without embeddings gives the embeddings its values. The port follows suit, so no stored head is silently dropped.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.weights import WeightSpec, checkpoint_name

logger = logging.getLogger("jaxpaged.loader")

HEAD_PATH, EMBEDDING_PATH = "lm_head.kernel", "embed_tokens.embedding"
COPY = "a copy of the embeddings: the head is tied to them (tie_word_embeddings)"


@dataclasses.dataclass(frozen=True)
class HeadTying:
    config: ModelConfig  # with tie_word_embeddings as decided
    head: str | None = None  # the head's checkpoint name (the port's spelling) where the checkpoint holds one
    embedding: str | None = None
    head_fills_embedding: bool = False  # tied, and the checkpoint holds the head only
    head_is_copy: bool = False  # tied, and the stored head equals the embeddings

    def specs(self, specs: dict[str, WeightSpec]) -> dict[str, WeightSpec]:
        if not self.head_fills_embedding:
            return specs
        specs = dict(specs)
        specs[self.head] = specs.pop(self.embedding)
        return specs


def _names(port: type, cfg: ModelConfig) -> tuple[str, str]:
    """(head, embedding): the checkpoint names the port reads them from when untied."""
    untied = port.weight_specs(dataclasses.replace(cfg, tie_word_embeddings=False))
    by_path = {spec.paths: name for name, spec in untied.items()}
    return by_path[(HEAD_PATH,)], by_path[(EMBEDDING_PATH,)]


def decide(port: type, cfg: ModelConfig, stored: list[str], read: Callable[[str], np.ndarray]) -> HeadTying:
    """stored: the checkpoint's tensor names as written; read(name written) -> its array."""
    if not cfg.tie_word_embeddings:
        return HeadTying(cfg)
    head, embedding = _names(port, cfg)
    specs = port.weight_specs(dataclasses.replace(cfg, tie_word_embeddings=False))
    written = {checkpoint_name(port, name, specs): name for name in stored}
    if head not in written:
        return HeadTying(cfg)
    if embedding not in written:
        logger.info("tie_word_embeddings with %s stored and %s not: the embeddings are the head's values, as in "
                    "transformers", head, embedding)  # fmt: skip
        return HeadTying(cfg, head, embedding, head_fills_embedding=True)
    a, b = read(written[head]), read(written[embedding])
    same = a.shape == b.shape and np.array_equal(a, b if a.dtype == b.dtype else b.astype(a.dtype))
    if same:
        return HeadTying(cfg, head, embedding, head_is_copy=True)
    logger.warning("the config ties %s to %s, but the checkpoint holds both with different values: loading them "
                   "untied, as transformers does (set tie_word_embeddings=false to silence this)", head, embedding)  # fmt: skip
    return HeadTying(dataclasses.replace(cfg, tie_word_embeddings=False), head, embedding)

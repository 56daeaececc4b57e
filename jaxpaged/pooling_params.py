"""How one request wants a pooling model's output (vLLM's PoolingParams), and how the engine pools (PoolerConfig).

Checked here, on the host, as SamplingParams is: a bad value is a ValueError naming the field.
"""

from __future__ import annotations

import dataclasses

from jaxpaged.sampling_params import _int
from jaxpaged.utils.json_option import json_object

POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")
TOKEN_TASKS = ("token_embed", "token_classify")  # one output row per prompt position (vLLM's tokenwise poolers)
SEQUENCE_POOLING = ("LAST", "MEAN", "CLS")  # the last token's hidden state, the prompt's mean, the first token's
# the token tasks': every prompt position, or those holding step_tag_id (a process reward model's step marks)
TOKEN_POOLING = ("ALL", "STEP")
POOLING_TYPES = SEQUENCE_POOLING + TOKEN_POOLING


def _optional_bool(name: str, value) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool or None (got {value!r})")
    return value


def _step_fields(owner, prefix: str = "", kind: type = list) -> None:
    """step_tag_id (a token id, >= 0) and returned_token_ids (a non-empty list of them, >= 0), checked in place."""
    if owner.step_tag_id is not None:
        object.__setattr__(owner, "step_tag_id", _int(f"{prefix}step_tag_id", owner.step_tag_id))
        if owner.step_tag_id < 0:
            raise ValueError(f"{prefix}step_tag_id must be >= 0 (got {owner.step_tag_id})")
    if owner.returned_token_ids is not None:
        ids = owner.returned_token_ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"{prefix}returned_token_ids must be a list of ints (got {ids!r})")
        ids = [_int(f"{prefix}returned_token_ids", i) for i in ids]
        if not ids or min(ids) < 0:
            raise ValueError(f"{prefix}returned_token_ids must be a non-empty list of ints >= 0 (got {ids})")
        object.__setattr__(owner, "returned_token_ids", kind(ids))


@dataclasses.dataclass
class PoolingParams:
    """vLLM's fields: dimensions (an embedding's first `dimensions` values, before normalizing: Matryoshka models),
    normalize (embeddings to unit length; None: the model's default), activation (a classifier's softmax, or sigmoid
    for one label; None: on), truncate_prompt_tokens (the prompt's last k tokens; -1: the last max_model_len),
    step_tag_id and returned_token_ids (STEP pooling only: the positions holding that token, the output columns
    kept), task (set by LLM.embed / classify / score / reward / encode)."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    task: str | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    use_activation: dataclasses.InitVar[bool | None] = None  # vLLM's later name for activation

    def __post_init__(self, use_activation: bool | None) -> None:
        if use_activation is not None:
            if self.activation is not None and self.activation != use_activation:
                raise ValueError("activation and use_activation disagree; pass one")
            self.activation = use_activation
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(f"truncate_prompt_tokens must be None, -1 or >= 1 (got {self.truncate_prompt_tokens})")
        if self.dimensions is not None:
            self.dimensions = _int("dimensions", self.dimensions)
            if self.dimensions < 1:
                raise ValueError(f"dimensions must be >= 1 (got {self.dimensions})")
        _optional_bool("normalize", self.normalize)
        _optional_bool("activation", self.activation)
        _step_fields(self)
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS} (got {self.task!r})")

    def clone(self) -> PoolingParams:
        return dataclasses.replace(self)  # (returned_token_ids is never changed in place: shared safely)


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How a pooling engine pools (vLLM's `pooler_config`): None fields come from the checkpoint (its
    sentence-transformers modules.json), else LAST with normalized embeddings, as vLLM pools a decoder. pooling_type
    LAST/MEAN/CLS sets the sequence tasks' pooling, ALL/STEP the token tasks' (vLLM's seq_ and tok_pooling_type);
    step_tag_id and returned_token_ids are STEP's defaults for requests that set neither."""

    pooling_type: str | None = None
    normalize: bool | None = None
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            kind = str(self.pooling_type).upper()
            if kind not in POOLING_TYPES:
                raise ValueError(f"pooler_config.pooling_type must be one of {POOLING_TYPES} (got {self.pooling_type!r})")
            object.__setattr__(self, "pooling_type", kind)
        _optional_bool("pooler_config.normalize", self.normalize)
        _step_fields(self, "pooler_config.", tuple)
        if (self.step_tag_id is not None or self.returned_token_ids is not None) and self.pooling_type != "STEP":
            raise ValueError("pooler_config.step_tag_id and returned_token_ids need pooling_type 'STEP'")

    @classmethod
    def parse(cls, value) -> PoolerConfig | None:
        """A PoolerConfig, a dict of its fields, their JSON text (the CLIs' flag), or None."""
        if value is None or isinstance(value, cls):
            return value
        return cls(**json_object("pooler_config", value, (f.name for f in dataclasses.fields(cls))))

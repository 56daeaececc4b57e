"""SpeculativeConfig: vLLM's `speculative_config` fields, validated once (a ValueError naming the field)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpaged.utils.json_option import json_object

METHODS = ("ngram", "draft_model", "mtp", "eagle3")
# vLLM's older names for "mtp" (it maps them the same way)
MTP_ALIASES = ("deepseek_mtp", "glm4_moe_mtp", "qwen3_next_mtp", "qwen3_5_mtp", "ernie_mtp", "mimo_mtp")
# batch 1 gains, batch 64 forced on loses 0.31 on free text (docs/speculative_decoding.md); 8 is between, not tuned
DEFAULT_DISABLE_BY_BATCH_SIZE = 8  # vLLM has no default


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model: the draft's folder or id; eagle3: the head's folder
    # speculation is off for a step with at least this many running sequences (vLLM's disable_by_batch_size)
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """From a dict, a JSON string (the CLIs' --speculative-config), a SpeculativeConfig or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object("speculative_config", value, (f.name for f in dataclasses.fields(cls)))
        if "method" not in value:
            value["method"] = "draft_model" if value.get("model") else "ngram"
        if value["method"] in MTP_ALIASES:
            value["method"] = "mtp"
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        return cls(**value)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS} (got {self.method!r})")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer (got {v!r})")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")  # fmt: skip
        if self.method in ("draft_model", "eagle3") and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_config.model is required for method {self.method!r} (the draft's folder or id)")
        if self.model is not None and self.method in ("ngram", "mtp"):
            raise ValueError(f"speculative_config.model is for method 'draft_model'; {self.method} needs no model")

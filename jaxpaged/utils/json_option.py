"""Engine options that are small objects (speculative_config, pooler_config, override_generation_config,
limit_mm_per_prompt, mm_processor_kwargs, hf_overrides): a dict, or its JSON text as the CLIs' flags pass it."""

from __future__ import annotations

import json
from collections.abc import Iterable


def json_object(name: str, value, known: Iterable[str] | None) -> dict:
    """value as a dict whose keys are all in `known` (None: any string keys); anything else is a ValueError naming
    the option."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be a JSON object (got {value!r}: {e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (got {type(value).__name__})")
    if known is None:
        if not all(isinstance(key, str) for key in value):
            raise ValueError(f"{name}'s keys must be strings (got {sorted(map(repr, value))})")
        return dict(value)
    known = sorted(known)
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{name} has unknown field(s) {unknown}; known: {known}")
    return dict(value)

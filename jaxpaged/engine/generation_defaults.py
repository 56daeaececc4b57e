"""A model's own sampling defaults, as vLLM takes them (`--generation-config auto`, its default): the values its
generation_config.json sets apart from transformers' defaults, for the fields vLLM reads, become the defaults of
requests that leave them unset (LLM.generate without SamplingParams, the server's fields left out).
Qwen3 ships temperature 0.6, top_p 0.95, top_k 20: without them it loops where its authors' settings would not.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from jaxpaged.utils.json_option import json_object

logger = logging.getLogger("jaxpaged.engine")

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json's field -> SamplingParams', and transformers' default (a value equal to it is not a choice)
FIELDS = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "top_k": ("top_k", 50),
    "min_p": ("min_p", None),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "max_new_tokens": ("max_tokens", None),
}


def _folder(source: str | None) -> Path | None:
    """Where a checkpoint's generation_config.json would be: its folder (a bare config.json's too); a GGUF has none."""
    if source is None:
        return None
    path = Path(source)
    if path.is_dir():
        return path
    return path.parent if path.name == "config.json" else None


def check_generation_config(value: str, overrides) -> dict:
    """EngineConfig's check: "auto", "vllm" or a folder holding generation_config.json; the overrides as a dict."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder (got {value!r})")
    if value not in ("auto", "vllm") and not (Path(value) / GENERATION_CONFIG_FILE).is_file():
        raise ValueError(f"generation_config: {value!r} holds no {GENERATION_CONFIG_FILE}")
    return {} if overrides is None else json_object("override_generation_config", overrides, FIELDS)


def default_sampling_kwargs(generation_config: str, overrides: dict, source: str | None) -> dict:
    """SamplingParams' keyword arguments the model chooses (its generation_config.json, then the overrides): empty
    for "vllm" (vLLM's own defaults) or a checkpoint without the file."""
    folder = None if generation_config == "vllm" else (
        _folder(source) if generation_config == "auto" else Path(generation_config))  # fmt: skip
    stored = {}
    if folder is not None and (folder / GENERATION_CONFIG_FILE).is_file():
        stored = json.loads((folder / GENERATION_CONFIG_FILE).read_text())
    chosen = {}
    for name, (param, hf_default) in FIELDS.items():
        value = overrides.get(name, stored.get(name))
        if value is not None and (name in overrides or value != hf_default):
            chosen[param] = value
    if chosen:
        logger.info("default sampling parameters from the model's generation config (vLLM's generation_config "
                    "'auto'; 'vllm' ignores it): %s", chosen)  # fmt: skip
    return chosen

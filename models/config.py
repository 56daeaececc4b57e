"""ModelConfig: the hashable, static view of an HF config that model code reads.

HF configs differ across transformers releases (4.x keeps `rope_theta`/`rope_scaling`,
5.x folds both into `rope_parameters`); this is the one place that smooths that over.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None


def _get(hf_config: Any, name: str, default=None):
    value = getattr(hf_config, name, None)
    return default if value is None else value


def rope_from_hf(hf_config: Any) -> RopeConfig:
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) if not params else None
    if scaling:
        params.update(scaling)
    theta = params.get("rope_theta", _get(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0) or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(hf_config: Any) -> tuple[int, ...]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def model_config_from_hf(hf_config: Any, architecture: str) -> ModelConfig:
    text = getattr(hf_config, "get_text_config", None)
    if text is not None:
        hf_config = text()
    num_heads = int(hf_config.num_attention_heads)
    hidden = int(hf_config.hidden_size)
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(hf_config.vocab_size),
        hidden_size=hidden,
        intermediate_size=int(hf_config.intermediate_size),
        num_layers=int(hf_config.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(_get(hf_config, "num_key_value_heads", num_heads)),
        head_dim=int(_get(hf_config, "head_dim", hidden // num_heads)),
        max_position_embeddings=int(_get(hf_config, "max_position_embeddings", 2048)),
        rms_norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        rope=rope_from_hf(hf_config),
        tie_word_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
        attention_bias=bool(_get(hf_config, "attention_bias", False)),
        mlp_bias=bool(_get(hf_config, "mlp_bias", False)),
        hidden_act=str(_get(hf_config, "hidden_act", "silu")),
        eos_token_ids=_eos_ids(hf_config),
        bos_token_id=getattr(hf_config, "bos_token_id", None),
    )

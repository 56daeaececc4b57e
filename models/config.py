"""ModelConfig: the hashable, static view of an HF config that model code reads.

HF configs differ across transformers releases (4.x keeps `rope_theta`/`rope_scaling`,
5.x folds both into `rope_parameters`); this is the one place that smooths that over.
One class serves every family: fields most families share are typed fields, and knobs only
one family has (OPT's embedding projection, Falcon's layer-norm layout...) sit in `options`,
so the config stays frozen and hashable (it is part of each port's static graph).
Each port builds its own with `config_from_hf` (starting from `model_config_from_hf`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")  # frequencies depend on the sequence's length


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """transformers' rope_parameters, resolved (factor filled in as transformers infers it); see layers.rope_table."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    max_position_embeddings: int = 0  # dynamic: the length past which the base grows
    attention_factor: float | None = None  # yarn/longrope: cos/sin scale; None: inferred from factor
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to original_max_position_embeddings
    long_factor: tuple[float, ...] = ()  # ... and past it


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
    attention_out_bias: bool | None = None  # o_proj bias; None: same as attention_bias (q/k/v)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    sliding_windows: tuple[int | None, ...] = ()  # per layer; () means no layer has a window
    layer_norm_eps: float = 1e-5
    position_embedding: str = "rope"  # "rope", "learned" (absolute table) or "alibi"
    rotary_dim: int | None = None  # partial rotary: rotate only the first rotary_dim of head_dim
    rope_interleaved: bool = False  # GPT-J: rotate (even, odd) pairs rather than the two halves
    lm_head_bias: bool = False
    # hybrid models (models/hybrid.py): the layers that keep K/V, their attention layers (the others keep a state per
    # sequence, or nothing); None: every layer
    kv_layers: tuple[int, ...] | None = None
    options: tuple[tuple[str, Any], ...] = ()  # family-specific knobs, see option()

    def option(self, name: str, default=None):
        return dict(self.options).get(name, default)

    def window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def num_kv_layers(self) -> int:
        """Layers whose K/V the paged cache holds: every layer, or a hybrid model's attention layers."""
        return self.num_layers if self.kv_layers is None else len(self.kv_layers)

    @property
    def out_bias(self) -> bool:
        return self.attention_bias if self.attention_out_bias is None else self.attention_out_bias


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
    if rope_type in ("su", "yarn") and params.get("long_factor") is not None:  # Phi-3's old names for longrope
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    max_pos = int(_get(hf_config, "max_position_embeddings", 2048))
    # Phi-3 keeps it beside rope_scaling, and transformers prefers that one
    original = _get(hf_config, "original_max_position_embeddings", params.get("original_max_position_embeddings"))
    if original is None:
        original = max_pos if rope_type in ("yarn", "longrope") else 8192
    factor = params.get("factor")
    if factor is None:
        factor = max_pos / int(original) if rope_type in ("yarn", "longrope") else 1.0
    optional = lambda name: None if params.get(name) is None else float(params[name])  # noqa: E731
    factors = {}
    for name in ("short_factor", "long_factor"):
        factors[name] = tuple(float(f) for f in params.get(name) or ())
        if rope_type == "longrope" and not factors[name]:
            raise ValueError(f"rope_scaling type 'longrope' needs {name}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(factor or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
        max_position_embeddings=max_pos,
        attention_factor=optional("attention_factor"),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        **factors,
    )


def context_length(max_position_embeddings: int, rope: RopeConfig) -> int:
    """The longest sequence the model serves: dynamic NTK and YaRN exist to run past the trained length, so, as in
    vLLM, their context is that length times `factor` (YaRN: original_max_position_embeddings times it)."""
    if rope.rope_type == "dynamic":
        return max(max_position_embeddings, int(max_position_embeddings * rope.factor))
    if rope.rope_type == "yarn":
        return max(max_position_embeddings, int(rope.original_max_position_embeddings * rope.factor))
    return max_position_embeddings


def _eos_ids(hf_config: Any) -> tuple[int, ...]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def sliding_windows_from_hf(hf_config: Any) -> tuple[int | None, ...]:
    """Per-layer windows: Mistral windows every layer; Qwen2/3 only layers typed "sliding_attention"."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return ()
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        return (int(window),) * int(hf_config.num_hidden_layers)
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    return windows if any(windows) else ()


def text_config(hf_config: Any) -> Any:
    text = getattr(hf_config, "get_text_config", None)
    return text() if text is not None else hf_config


def head_tied(hf_config: Any) -> bool:
    """transformers 5's rule (PreTrainedModel.get_expanded_tied_weights_keys): the head is tied when the config of
    the class holding it says `tie_word_embeddings`, default False. That is the top-level config: a multimodal
    wrapper's (Gemma3ForConditionalGeneration), whose text_config's flag transformers never reads for the head."""
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def model_config_from_hf(hf_config: Any, architecture: str, **overrides) -> ModelConfig:
    """The fields Llama-style configs name the same way; ports override what their config spells differently."""
    tied = head_tied(hf_config)  # the top-level config's flag: pass the config the port was given
    hf_config = text_config(hf_config)
    num_heads = int(hf_config.num_attention_heads)
    hidden = int(hf_config.hidden_size)
    rope = rope_from_hf(hf_config)
    fields = dict(
        architecture=architecture,
        vocab_size=int(hf_config.vocab_size),
        hidden_size=hidden,
        intermediate_size=int(_get(hf_config, "intermediate_size", 4 * hidden)),
        num_layers=int(hf_config.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(_get(hf_config, "num_key_value_heads", num_heads)),
        head_dim=int(_get(hf_config, "head_dim", hidden // num_heads)),
        max_position_embeddings=context_length(int(_get(hf_config, "max_position_embeddings", 2048)), rope),
        rms_norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        rope=rope,
        tie_word_embeddings=tied,
        attention_bias=bool(_get(hf_config, "attention_bias", False)),
        mlp_bias=bool(_get(hf_config, "mlp_bias", False)),
        hidden_act=str(_get(hf_config, "hidden_act", "silu")),
        eos_token_ids=_eos_ids(hf_config),
        bos_token_id=getattr(hf_config, "bos_token_id", None),
        sliding_windows=sliding_windows_from_hf(hf_config),
        layer_norm_eps=float(_get(hf_config, "layer_norm_eps", _get(hf_config, "layer_norm_epsilon", 1e-5))),
    )
    fields.update(overrides)
    if isinstance(fields.get("options"), dict):
        fields["options"] = tuple(sorted(fields["options"].items()))
    return ModelConfig(**fields)

"""Gemma, Gemma 2 and Gemma 3 (text), one port for the three, as transformers 5.24's modeling code computes them:

- all: embeddings times sqrt(hidden_size) (rounded to the hidden dtype first), RMSNorm as x * (1 + w) in float32,
  GeGLU (tanh GELU), an LM head tied unless the (top-level) config unties it;
- Gemma 2 and 3: norms before and after both attention and MLP ("sandwich" norms), q.k scaled by
  query_pre_attn_scalar ** -0.5, sliding-window layers (`layer_types`) among global ones, final logit soft-cap;
  Gemma 2 also soft-caps attention scores (transformers' Gemma 3 attention never applies its config's
  attn_logit_softcapping, nor its image-text model the final cap, so neither does this port; released Gemma 3
  configs set neither);
- Gemma 3: q/k RMSNorm (1 + w), and RoPE per layer type: local layers their own base (`rope_local_base_freq`),
  global layers `rope_theta` with their scaling (linear, factor 8 on the larger models).

`Gemma3ForConditionalGeneration` checkpoints: the language model is this port (Gemma3ForConditionalGeneration below
reads its spellings), the vision tower and projector models/vision/gemma3.py's. Its head is tied by the top-level
`tie_word_embeddings`, as transformers reads it, not by its text_config's.
"""

from __future__ import annotations

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxpaged.models.config import ModelConfig, RopeConfig, model_config_from_hf, rope_from_hf, text_config
from jaxpaged.models.layers import (
    REFERENCE_ATTENTION, Attention, CausalLM, Embedding, GatedMLP, RMSNorm, module_list, rope_table,
)  # fmt: skip
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.weights import WeightSpec, linear_specs
from jaxpaged.models.llama import attention_specs
from jaxpaged.pallas_kernels import AttentionBackend, stack_new_kv

GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
GEMMA3_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # transformers' defaults


class GemmaRMSNorm(RMSNorm):
    """x * (1 + w), multiplied in float32 and rounded once (Llama rounds x first, then multiplies by w)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return (h * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


def _gemma_attention(cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend) -> Attention:
    attn = Attention(cfg, layer, dtype=dtype, attention=attention, scale=cfg.option("attention_scale"))
    if cfg.qk_norm:
        attn.q_norm = GemmaRMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps, dtype=dtype)
        attn.k_norm = GemmaRMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps, dtype=dtype)
    attn.spec = dataclasses.replace(attn.spec, soft_cap=cfg.option("attn_logit_softcapping"))
    return attn


class GemmaDecoderLayer(nnx.Module):
    """Gemma: x + attn(norm(x)), then + mlp(norm(x)). Gemma 2/3 also norm each branch's output."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = _gemma_attention(cfg, layer, dtype=dtype, attention=attention)
        self.post_attention_layernorm = norm()  # Gemma: before the MLP; Gemma 2/3: after attention
        self.sandwich = cfg.option("sandwich_norms", False)
        self.pre_feedforward_layernorm = norm() if self.sandwich else None
        self.post_feedforward_layernorm = norm() if self.sandwich else None
        self.mlp = GatedMLP(cfg, dtype=dtype)
        self.rope_kind = "local" if layer in cfg.option("local_rope_layers", ()) else "global"

    def __call__(self, x, rope, kv_cache, attn_metadata):
        attn, new_kv = self.self_attn(self.input_layernorm(x), rope, kv_cache, attn_metadata)
        if not self.sandwich:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x)), new_kv
        x = x + self.post_attention_layernorm(attn)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, new_kv


class GemmaForCausalLM(CausalLM):
    SKIPPED_TENSORS = (ROTARY_CACHE,)
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list(
            [GemmaDecoderLayer(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)]
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)
        # transformers keeps sqrt(hidden_size) as a float32 tensor and casts it to the weights' dtype
        self.normalizer = float(np.float32(math.sqrt(cfg.hidden_size)))

    def embed(self, input_ids, positions):
        x = self.embed_tokens(input_ids)
        return x * jnp.asarray(self.normalizer, x.dtype)

    def run_layers(self, x, positions, kv_cache, attn_metadata, layers):
        """As CausalLM's, with one rotary table per RoPE kind the layers use (Gemma 3: local and global)."""
        cfg = self.config
        ropes = {"global": cfg.rope, "local": cfg.option("local_rope")}
        kinds = sorted({layer.rope_kind for layer in layers})
        tables = self.shared(
            lambda: {kind: rope_table(ropes[kind], positions, cfg.head_dim, attn_metadata) for kind in kinds}, positions
        )
        new_kv = []
        for layer in layers:
            x, layer_kv = layer(x, tables[layer.rope_kind], kv_cache, attn_metadata)
            new_kv.append(layer_kv)
        return x, stack_new_kv(new_kv)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        logits = super().compute_logits(hidden)
        cap = self.config.option("final_logit_softcapping")
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        text = text_config(hf_config)
        if getattr(text, "use_bidirectional_attention", None):
            raise ValueError(
                f"use_bidirectional_attention=True ({architecture}): bidirectional (embedding) Gemma models are not "
                "supported; jaxpaged serves causal language models"
            )
        if architecture == "GemmaForCausalLM":  # transformers reads hidden_act here, hidden_activation from Gemma 2 on
            return model_config_from_hf(hf_config, architecture, hidden_act=str(text.hidden_act), mlp_bias=False)
        gemma3 = architecture in GEMMA3_ARCHITECTURES
        image_text = architecture == "Gemma3ForConditionalGeneration"  # transformers applies no final cap there
        rope, local_rope = _gemma3_ropes(text) if gemma3 else (rope_from_hf(text), None)
        types_ = list(getattr(text, "layer_types", None) or [])
        options = {
            "sandwich_norms": True,
            "attention_scale": float(text.query_pre_attn_scalar) ** -0.5,
            "final_logit_softcapping": None if image_text else _float_or_none(text.final_logit_softcapping),
            "attn_logit_softcapping": None if gemma3 else _float_or_none(text.attn_logit_softcapping),
            "local_rope": local_rope,
            "local_rope_layers": tuple(i for i, t in enumerate(types_) if t == "sliding_attention") if gemma3 else (),
        }
        return model_config_from_hf(
            hf_config, architecture, hidden_act=str(text.hidden_activation), mlp_bias=False, rope=rope, qk_norm=gemma3,
            options=options,
        )  # fmt: skip

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        specs = {"model.embed_tokens.weight": WeightSpec("embed_tokens.embedding")}
        specs["model.norm.weight"] = WeightSpec("norm.scale")
        if not cfg.tie_word_embeddings:
            specs["lm_head.weight"] = WeightSpec("lm_head.kernel", transpose=True)
        norms = ["input_layernorm", "post_attention_layernorm"]
        if cfg.option("sandwich_norms", False):
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for i in range(cfg.num_layers):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            for norm in norms:
                specs[f"{hf}.{norm}.weight"] = WeightSpec(f"{ours}.{norm}.scale")
            specs |= attention_specs(cfg, hf, ours)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                specs |= linear_specs(f"{hf}.mlp.{proj}", f"{ours}.mlp.{proj}", bias=False)
        return specs


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    """The language model of a Gemma 3 image-text checkpoint (models/vision/gemma3.py adds the vision tower and
    projector: the registry's port). transformers 5 still writes the 4.x names (`language_model.model.*`);
    checkpoints written in between say `model.language_model.*`."""

    CHECKPOINT_RENAMES = (
        (r"^language_model\.model\.", "model."),
        (r"^model\.language_model\.", "model."),
        (r"^language_model\.lm_head\.", "lm_head."),
    )  # fmt: skip
    SKIPPED_TENSORS = (
        ROTARY_CACHE,
        (r"^(model\.)?(vision_tower|multi_modal_projector)\.", "the vision tower and projector: not ported, prompts are text"),
    )


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)


def _gemma3_ropes(text) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) RoPE. transformers 5 keys `rope_parameters` by layer type; 4.x configs say rope_theta and
    rope_scaling (global layers) and rope_local_base_freq (local layers)."""
    params = dict(getattr(text, "rope_parameters", None) or {})
    if "full_attention" not in params and "sliding_attention" not in params:  # the 4.x spelling
        scaling = getattr(text, "rope_scaling", None) or {}
        params = {
            "full_attention": params or {"rope_theta": getattr(text, "rope_theta", None), **scaling},
            "sliding_attention": {"rope_theta": getattr(text, "rope_local_base_freq", None)},
        }
    ropes = []
    for kind in ("full_attention", "sliding_attention"):
        kind_params = {k: v for k, v in dict(params.get(kind) or {}).items() if v is not None}
        kind_params.setdefault("rope_theta", GEMMA3_DEFAULT_THETA[kind])
        max_pos = text.max_position_embeddings
        ropes.append(rope_from_hf(types.SimpleNamespace(rope_parameters=kind_params, max_position_embeddings=max_pos)))
    return ropes[0], ropes[1]

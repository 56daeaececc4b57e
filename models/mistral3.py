"""Mistral 3 (Mistral Small 3.1/3.2, Magistral Small, Devstral Small, Ministral 3): its language model, text prompts.

- Ministral 3 (transformers' Ministral3ForCausalLM, `ministral3`): Llama with YaRN, and q times
  1 + beta * log(1 + floor(position / original_max_position_embeddings)) after RoPE (`llama_4_scaling_beta` in
  rope_parameters: Llama 4's attention temperature, on every layer); a window where `sliding_window` is set.
- Mistral3ForConditionalGeneration: a Pixtral vision tower, a patch merger and projector, and a Mistral or Ministral 3
  language model (`model.language_model.*`, or the 4.x `language_model.model.*`). This module's class is the
  language model; models/vision/mistral3.py adds the tower and projector (the registry's class).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.config import ModelConfig, model_config_from_hf, text_config
from jaxpaged.models.layers import REFERENCE_ATTENTION, Attention, Embedding, RMSNorm, module_list, rope_table
from jaxpaged.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from jaxpaged.pallas_kernels import AttentionBackend, stack_new_kv

def llama4_query_scale(positions, beta: float, original: int):
    """[T] Llama 4's attention temperature as Ministral 3 applies it to q: 1 + beta * log(1 + floor(pos / original))."""
    return 1.0 + beta * jnp.log1p(jnp.floor(positions.astype(jnp.float32) / original))


class QueryScaledAttention(Attention):
    """Attention whose q is scaled per token after RoPE; `rope` is (cos, sin, scale [T])."""

    def rotate(self, q, k, rope):
        cos, sin, scale = rope
        q, k = super().rotate(q, k, (cos, sin))
        return q * scale[:, None, None].astype(q.dtype), k


class Ministral3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        super().__init__(cfg, layer, dtype=dtype, attention=attention)
        if cfg.option("llama4_scaling") is not None:
            self.self_attn = QueryScaledAttention(cfg, layer, dtype=dtype, attention=attention)


class Ministral3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list(
            [Ministral3DecoderLayer(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    def run_layers(self, x, positions, kv_cache, attn_metadata, layers):
        """CausalLM's, the rotary table carrying each token's q scale where the config asks for one."""
        scaling = self.config.option("llama4_scaling")
        if scaling is None:
            return super().run_layers(x, positions, kv_cache, attn_metadata, layers)
        cfg = self.config
        table = lambda: (*rope_table(cfg.rope, positions, cfg.head_dim, attn_metadata),  # noqa: E731
                         llama4_query_scale(positions, *scaling))
        rope = self.shared(table, positions)
        new_kv = []
        for layer in layers:
            x, layer_kv = layer(x, rope, kv_cache, attn_metadata)
            new_kv.append(layer_kv)
        return x, stack_new_kv(new_kv)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hf = text_config(hf_config)
        params = dict(getattr(hf, "rope_parameters", None) or {})
        beta = params.get("llama_4_scaling_beta")
        scaling = None
        if beta is not None and getattr(hf, "model_type", None) == "ministral3":
            original = int(params.get("original_max_position_embeddings") or hf.max_position_embeddings)
            scaling = None if beta == 0 or math.isnan(beta) else (float(beta), original)
        return model_config_from_hf(hf_config, architecture, options={"llama4_scaling": scaling})


class Mistral3ForConditionalGeneration(Ministral3ForCausalLM):
    """The language model of a Mistral 3 image-text checkpoint (models/vision/mistral3.py's base)."""

    CHECKPOINT_RENAMES = (
        (r"^model\.language_model\.", "model."),
        (r"^language_model\.model\.", "model."),  # the 4.x spelling, as published
        (r"^language_model\.lm_head\.", "lm_head."),
    )
    SKIPPED_TENSORS = (ROTARY_CACHE,)

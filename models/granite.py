"""Granite 3.x (transformers' GraniteForCausalLM): Llama with four multipliers, as transformers 5.24 applies them:
the embeddings times `embedding_multiplier`, q.k times `attention_multiplier` (in place of head_dim^-0.5), each
branch's output times `residual_multiplier` before it is added, and the logits divided by `logits_scaling`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxpaged.models.config import ModelConfig, model_config_from_hf, text_config
from jaxpaged.models.layers import REFERENCE_ATTENTION, Attention, Embedding, RMSNorm, module_list
from jaxpaged.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from jaxpaged.pallas_kernels import AttentionBackend


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        super().__init__(cfg, layer, dtype=dtype, attention=attention)
        self.self_attn = Attention(cfg, layer, dtype=dtype, attention=attention, scale=cfg.option("attention_multiplier"))
        self.residual_multiplier = cfg.option("residual_multiplier")

    def __call__(self, x, rope, kv_cache, attn_metadata):
        attn, new_kv = self.self_attn(self.input_layernorm(x), rope, kv_cache, attn_metadata)
        x = x + attn * self.residual_multiplier
        x = x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier
        return x, new_kv


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list([GraniteDecoderLayer(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    def embed(self, input_ids, positions):
        return self.embed_tokens(input_ids) * self.config.option("embedding_multiplier")

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        return super().compute_logits(hidden) / self.config.option("logits_scaling")

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hf = text_config(hf_config)
        names = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")
        options = {name: float(getattr(hf, name, None) or 1.0) for name in names}
        return model_config_from_hf(hf_config, architecture, options=options)

"""Llama family (Llama 2/3.x, SmolLM2, TinyLlama) and its close relatives, one port for all of them:

- Mistral: a sliding window on every layer (`sliding_window`);
- Qwen2 / Qwen2.5: biases on q/k/v but not on o_proj; optional per-layer windows (`layer_types`);
- Qwen3: q/k RMSNorm over head_dim before RoPE; `attention_bias` on all four projections;
- Seed-OSS: q/k/v biased per `attention_bias`, o_proj per `attention_out_bias`, MLP biases per `mlp_bias`.

The forward pass is pure in the cache: it takes kv_cache and returns the updated one (or, from
`forward`, the new K/V for the runner to write into the donated cache in place).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.config import ModelConfig, model_config_from_hf, text_config
from jaxpaged.models.layers import REFERENCE_ATTENTION, Attention, CausalLM, Embedding, GatedMLP, RMSNorm, module_list
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.weights import (
    WeightSpec, decoder_specs, layer_prefixes, linear_specs, projection_specs, scale_specs,
)  # fmt: skip
from jaxpaged.pallas_kernels import AttentionBackend


def attention_specs(cfg: ModelConfig, hf: str, ours: str) -> dict[str, WeightSpec]:
    """A Llama-style layer's self_attn tensors (q/k/v/o with the config's biases, q/k norms), shared by the ports
    whose attention is Llama's."""
    attn, mine = f"{hf}.self_attn", f"{ours}.self_attn"
    specs = projection_specs(attn, mine, ("q_proj", "k_proj", "v_proj"), bias=cfg.attention_bias)
    specs |= linear_specs(f"{attn}.o_proj", f"{mine}.o_proj", bias=cfg.out_bias)
    if cfg.qk_norm:
        specs |= scale_specs(attn, mine, ("q_norm", "k_norm"))
    return specs


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, layer, dtype=dtype, attention=attention)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP(cfg, dtype=dtype)

    def __call__(self, x, rope, kv_cache, attn_metadata):
        attn, new_kv = self.self_attn(self.input_layernorm(x), rope, kv_cache, attn_metadata)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_kv


class LlamaForCausalLM(CausalLM):
    SKIPPED_TENSORS = (ROTARY_CACHE,)
    # is_causal=false pooling checkpoints (gte-Qwen2): every layer's attention reads AttentionMetadata.key_ends
    BIDIRECTIONAL_POOLING = True
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list(
            [LlamaDecoderLayer(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        if architecture == "Qwen2ForCausalLM":  # q/k/v always biased, o_proj never
            return model_config_from_hf(hf_config, architecture, attention_bias=True, attention_out_bias=False)
        if architecture == "Qwen3ForCausalLM":
            return model_config_from_hf(hf_config, architecture, qk_norm=True)
        if architecture == "SeedOssForCausalLM":  # q/k/v biased per attention_bias, o_proj per attention_out_bias
            out_bias = bool(getattr(text_config(hf_config), "attention_out_bias", False))
            return model_config_from_hf(hf_config, architecture, attention_out_bias=out_bias)
        return model_config_from_hf(hf_config, architecture)

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        """Every HF tensor name this port needs, and where it goes."""
        specs = decoder_specs(cfg.tie_word_embeddings)
        for _, hf, ours in layer_prefixes(cfg.num_layers):
            specs |= scale_specs(hf, ours)
            specs |= attention_specs(cfg, hf, ours)
            specs |= projection_specs(f"{hf}.mlp", f"{ours}.mlp", bias=cfg.mlp_bias)
        return specs

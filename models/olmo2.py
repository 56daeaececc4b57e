"""OLMo 2 and OLMo 3 (transformers' Olmo2ForCausalLM, Olmo3ForCausalLM), as transformers 5.24's modeling code computes
them:

- post-norm layers: x + norm(attn(x)), then x + norm(mlp(x)) (no norm before either branch);
- q/k RMSNorm over the whole projection width (every head at once, OLMoE's attention: models/olmoe.py), then RoPE;
  biases on all four projections per `attention_bias`;
- RMSNorm's weight multiplied in float32 and the product rounded once (Llama rounds first, then multiplies);
- OLMo 3: sliding-window and full layers (`layer_types`, `sliding_window`), each type with its own RoPE
  (`rope_parameters` keyed by layer type: released configs scale only the full layers, with YaRN).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.config import ModelConfig, context_length, model_config_from_hf, rope_from_hf, text_config
from jaxpaged.models.layers import REFERENCE_ATTENTION, CausalLM, Embedding, GatedMLP, RMSNorm, module_list, rope_table
from jaxpaged.models.llama import attention_specs
from jaxpaged.models.olmoe import OlmoeAttention
from jaxpaged.models.weights import WeightSpec, decoder_specs, layer_prefixes, projection_specs, scale_specs
from jaxpaged.pallas_kernels import AttentionBackend, stack_new_kv

POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")


class OlmoRMSNorm(RMSNorm):
    """weight * normed x in float32, rounded once to x's dtype (transformers' Olmo2RMSNorm)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return (self.scale[...].astype(jnp.float32) * h).astype(x.dtype)


class OlmoAttention(OlmoeAttention):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention):
        super().__init__(cfg, layer, dtype=dtype, attention=attention)
        self.q_norm = OlmoRMSNorm(cfg.num_heads * cfg.head_dim, eps=cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = OlmoRMSNorm(cfg.num_kv_heads * cfg.head_dim, eps=cfg.rms_norm_eps, dtype=dtype)


class Olmo2DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        self.self_attn = OlmoAttention(cfg, layer, dtype=dtype, attention=attention)
        self.post_attention_layernorm = OlmoRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP(cfg, dtype=dtype)
        self.post_feedforward_layernorm = OlmoRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.rope_kind = "sliding" if cfg.window(layer) else "full"

    def __call__(self, x, rope, kv_cache, attn_metadata):
        attn, new_kv = self.self_attn(x, rope, kv_cache, attn_metadata)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(x)), new_kv


class Olmo2ForCausalLM(CausalLM):
    SKIPPED_TENSORS = (ROTARY_CACHE,)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list([Olmo2DecoderLayer(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)])
        self.norm = OlmoRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    def run_layers(self, x, positions, kv_cache, attn_metadata, layers):
        """As CausalLM's, with one rotary table per layer type the layers use (OLMo 3: sliding and full)."""
        cfg = self.config
        ropes = {"full": cfg.rope, "sliding": cfg.option("sliding_rope") or cfg.rope}
        kinds = sorted({layer.rope_kind for layer in layers})
        tables = self.shared(
            lambda: {kind: rope_table(ropes[kind], positions, cfg.head_dim, attn_metadata) for kind in kinds}, positions
        )
        new_kv = []
        for layer in layers:
            x, layer_kv = layer(x, tables[layer.rope_kind], kv_cache, attn_metadata)
            new_kv.append(layer_kv)
        return x, stack_new_kv(new_kv)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hf = text_config(hf_config)
        options = {"whole_width_qk_norm": True}
        params = dict(getattr(hf, "rope_parameters", None) or {})
        overrides = {}
        if "full_attention" in params or "sliding_attention" in params:  # OLMo 3: RoPE per layer type
            full, sliding = (_typed_rope(hf, params.get(kind)) for kind in ("full_attention", "sliding_attention"))
            options["sliding_rope"] = None if sliding == full else sliding
            # the context: the full layers' RoPE decides it (YaRN's factor)
            overrides = {"rope": full, "max_position_embeddings": context_length(int(hf.max_position_embeddings), full)}
        return model_config_from_hf(hf_config, architecture, qk_norm=True, options=options, **overrides)

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        specs = decoder_specs(cfg.tie_word_embeddings)
        for _, hf, ours in layer_prefixes(cfg.num_layers):
            specs |= scale_specs(hf, ours, POST_NORMS)
            specs |= attention_specs(cfg, hf, ours)
            specs |= projection_specs(f"{hf}.mlp", f"{ours}.mlp", bias=False)
        return specs


def _typed_rope(hf, params):
    """One layer type's RoPE from its rope_parameters entry."""
    params = {k: v for k, v in dict(params or {}).items() if v is not None}
    params.setdefault("rope_theta", 500000.0)
    return rope_from_hf(types.SimpleNamespace(rope_parameters=params, max_position_embeddings=hf.max_position_embeddings))

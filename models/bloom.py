"""BLOOM: ALiBi (no position embeddings), a LayerNorm on the embeddings, per-head fused QKV, BLOOM's GELU,
and optionally the residual taken after the LayerNorm (apply_residual_connection_post_layernorm)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.config import ModelConfig, model_config_from_hf
from jaxpaged.models.layers import REFERENCE_ATTENTION, MLP, Attention, CausalLM, Embedding, LayerNorm, alibi_slopes, module_list
from jaxpaged.models.weights import QKVSplit, WeightSpec, fused_qkv_specs, linear_specs, norm_specs
from jaxpaged.pallas_kernels import AttentionBackend


class BloomBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        alibi = alibi_slopes(cfg.num_heads)  # added after the 1/sqrt(d) scaling, as is
        self.self_attn = Attention(cfg, layer, dtype=dtype, attention=attention, alibi=alibi)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype=dtype)
        self.residual_after_norm = cfg.option("apply_residual_connection_post_layernorm", False)

    def __call__(self, x, rope, kv_cache, attn_metadata):
        h = self.input_layernorm(x)
        attn, new_kv = self.self_attn(h, rope, kv_cache, attn_metadata)
        x = attn + (h if self.residual_after_norm else x)
        h = self.post_attention_layernorm(x)
        return self.mlp(h) + (h if self.residual_after_norm else x), new_kv


class BloomForCausalLM(CausalLM):
    BASE_PREFIX = "transformer."  # the hub's bloom checkpoints omit it

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.layers = module_list(
            [BloomBlock(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)]
        )
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    def embed(self, input_ids, positions):
        return self.embed_norm(self.embed_tokens(input_ids))

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hidden, heads = int(hf_config.hidden_size), int(hf_config.num_attention_heads)
        post = bool(getattr(hf_config, "apply_residual_connection_post_layernorm", False))
        return model_config_from_hf(
            hf_config, architecture, intermediate_size=4 * hidden, num_kv_heads=heads, head_dim=hidden // heads,
            hidden_act="bloom_gelu", attention_bias=True, mlp_bias=True, position_embedding="alibi",
            max_position_embeddings=int(getattr(hf_config, "seq_length", None) or 2048),
            options={"apply_residual_connection_post_layernorm": post},
        )  # fmt: skip

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        specs = {"transformer.word_embeddings.weight": WeightSpec("embed_tokens.embedding")}
        specs |= norm_specs("transformer.word_embeddings_layernorm", "embed_norm")
        specs |= norm_specs("transformer.ln_f", "norm")
        if not cfg.tie_word_embeddings:
            specs["lm_head.weight"] = WeightSpec("lm_head.kernel", transpose=True)
        split = QKVSplit(cfg.num_heads, cfg.num_heads, cfg.head_dim, "grouped")  # [H, 3, D]
        for i in range(cfg.num_layers):
            hf, ours = f"transformer.h.{i}", f"layers.{i}"
            specs |= norm_specs(f"{hf}.input_layernorm", f"{ours}.input_layernorm")
            specs |= norm_specs(f"{hf}.post_attention_layernorm", f"{ours}.post_attention_layernorm")
            specs |= fused_qkv_specs(f"{hf}.self_attention.query_key_value", f"{ours}.self_attn", split, bias=True)
            specs |= linear_specs(f"{hf}.self_attention.dense", f"{ours}.self_attn.o_proj", bias=True)
            specs |= linear_specs(f"{hf}.mlp.dense_h_to_4h", f"{ours}.mlp.up_proj", bias=True)
            specs |= linear_specs(f"{hf}.mlp.dense_4h_to_h", f"{ours}.mlp.down_proj", bias=True)
        return specs

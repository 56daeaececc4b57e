"""MPT: ALiBi with MPT's own slopes, bias-free Linear and LayerNorm layers, optional clip_qkv and
softmax_scale. As in transformers: always ALiBi with alibi_bias_max 8 (the config's value, and its
learned_pos_emb, expansion_ratio, qk_ln and attn_type, are not read; released MPTs match these)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxpaged.models.config import ModelConfig, model_config_from_hf
from jaxpaged.models.layers import REFERENCE_ATTENTION, MLP, Attention, CausalLM, Embedding, LayerNorm, module_list
from jaxpaged.models.weights import QKVSplit, WeightSpec, fused_qkv_specs, linear_specs
from jaxpaged.pallas_kernels import AttentionBackend


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> np.ndarray:
    """build_mpt_alibi_tensor's slopes: 2^-(k * max / n2) for k = 1..n2, n2 the next power of two, interleaved."""
    n2 = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / np.power(np.float32(2), np.arange(1, n2 + 1, dtype=np.float32) * np.float32(alibi_bias_max / n2))
    if n2 != num_heads:
        slopes = np.concatenate([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes.astype(np.float32)


class MptBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        self.norm_1 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype, bias=False)
        self.self_attn = Attention(
            cfg, layer, dtype=dtype, attention=attention, scale=cfg.option("softmax_scale"),
            alibi=mpt_alibi_slopes(cfg.num_heads), clip_qkv=cfg.option("clip_qkv"),
        )  # fmt: skip
        self.norm_2 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype, bias=False)
        self.mlp = MLP(cfg, dtype=dtype)

    def __call__(self, x, rope, kv_cache, attn_metadata):
        attn, new_kv = self.self_attn(self.norm_1(x), rope, kv_cache, attn_metadata)
        x = x + attn
        return x + self.mlp(self.norm_2(x)), new_kv


class MptForCausalLM(CausalLM):
    BASE_PREFIX = "transformer."

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list(
            [MptBlock(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)]
        )
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype, bias=False)
        self.init_head(cfg, cfg.hidden_size, dtype)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hidden, heads = int(hf_config.hidden_size), int(hf_config.num_attention_heads)
        attn = hf_config.attn_config
        get = (lambda k: attn.get(k)) if isinstance(attn, dict) else (lambda k: getattr(attn, k, None))
        return model_config_from_hf(
            hf_config, architecture, intermediate_size=4 * hidden,  # transformers ignores expansion_ratio
            num_kv_heads=heads, head_dim=hidden // heads, hidden_act="gelu", position_embedding="alibi",
            max_position_embeddings=int(hf_config.max_seq_len),
            options={"softmax_scale": get("softmax_scale"), "clip_qkv": get("clip_qkv")},
        )  # fmt: skip

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        specs = {
            "transformer.wte.weight": WeightSpec("embed_tokens.embedding"),
            "transformer.norm_f.weight": WeightSpec("norm.scale"),
        }
        if not cfg.tie_word_embeddings:
            specs["lm_head.weight"] = WeightSpec("lm_head.kernel", transpose=True)
        split = QKVSplit(cfg.num_heads, cfg.num_heads, cfg.head_dim, "concat")
        for i in range(cfg.num_layers):
            hf, ours = f"transformer.blocks.{i}", f"layers.{i}"
            specs[f"{hf}.norm_1.weight"] = WeightSpec(f"{ours}.norm_1.scale")
            specs[f"{hf}.norm_2.weight"] = WeightSpec(f"{ours}.norm_2.scale")
            specs |= fused_qkv_specs(f"{hf}.attn.Wqkv", f"{ours}.self_attn", split, bias=False)
            specs |= linear_specs(f"{hf}.attn.out_proj", f"{ours}.self_attn.o_proj", bias=False)
            specs |= linear_specs(f"{hf}.ffn.up_proj", f"{ours}.mlp.up_proj", bias=False)
            specs |= linear_specs(f"{hf}.ffn.down_proj", f"{ours}.mlp.down_proj", bias=False)
        return specs

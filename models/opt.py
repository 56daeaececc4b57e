"""OPT: learned positions offset by 2, LayerNorm before (or, for OPT-350m, after) each block, and an
optional projection between a narrower embedding (word_embed_proj_dim) and the hidden size."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.config import ModelConfig, model_config_from_hf
from jaxpaged.models.layers import REFERENCE_ATTENTION, MLP, Attention, CausalLM, Embedding, LayerNorm, Linear, module_list
from jaxpaged.models.weights import WeightSpec, linear_specs, norm_specs
from jaxpaged.pallas_kernels import AttentionBackend

POSITION_OFFSET = 2  # OPT's position table reserves its first two rows


def _norm(cfg: ModelConfig, dtype) -> LayerNorm:
    return LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype, affine=cfg.option("affine_norms", True))


class OPTDecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        self.self_attn_layer_norm = _norm(cfg, dtype)
        self.self_attn = Attention(cfg, layer, dtype=dtype, attention=attention)
        self.final_layer_norm = _norm(cfg, dtype)
        self.mlp = MLP(cfg, dtype=dtype)
        self.pre_norm = cfg.option("do_layer_norm_before", True)

    def __call__(self, x, rope, kv_cache, attn_metadata):
        pre = self.pre_norm
        attn, new_kv = self.self_attn(self.self_attn_layer_norm(x) if pre else x, rope, kv_cache, attn_metadata)
        x = x + attn
        if not pre:
            x = self.self_attn_layer_norm(x)
        x = x + self.mlp(self.final_layer_norm(x) if pre else x)
        if not pre:
            x = self.final_layer_norm(x)
        return x, new_kv


class OPTForCausalLM(CausalLM):
    CHECKPOINT_RENAMES = ((r"^decoder\.", "model.decoder."),)  # some hub checkpoints omit `model.`

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        d, proj = cfg.hidden_size, cfg.option("word_embed_proj_dim", cfg.hidden_size)
        self.embed_tokens = Embedding(cfg.vocab_size, proj, dtype=dtype)
        self.embed_positions = Embedding(cfg.max_position_embeddings + POSITION_OFFSET, d, dtype=dtype)
        self.project_in = Linear(proj, d, bias=False, dtype=dtype) if proj != d else None
        self.project_out = Linear(d, proj, bias=False, dtype=dtype) if proj != d else None
        self.layers = module_list(
            [OPTDecoderLayer(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)]
        )
        self.norm = _norm(cfg, dtype) if cfg.option("final_norm", True) else None
        self.init_head(cfg, proj, dtype)

    def embed(self, input_ids, positions):
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        return x + self.embed_positions(positions + POSITION_OFFSET)

    def final(self, x):
        if self.norm is not None:
            x = self.norm(x)
        return x if self.project_out is None else self.project_out(x)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hidden, heads = int(hf_config.hidden_size), int(hf_config.num_attention_heads)
        pre = bool(getattr(hf_config, "do_layer_norm_before", True))
        bias = bool(getattr(hf_config, "enable_bias", True))
        return model_config_from_hf(
            hf_config, architecture, intermediate_size=int(hf_config.ffn_dim), num_kv_heads=heads,
            head_dim=hidden // heads, hidden_act=str(hf_config.activation_function), position_embedding="learned",
            attention_bias=bias, mlp_bias=bias, layer_norm_eps=1e-5,
            options={
                "word_embed_proj_dim": int(getattr(hf_config, "word_embed_proj_dim", None) or hidden),
                "do_layer_norm_before": pre,
                "final_norm": pre and not getattr(hf_config, "_remove_final_layer_norm", False),
                "affine_norms": bool(getattr(hf_config, "layer_norm_elementwise_affine", True)),
            },
        )  # fmt: skip

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        affine = cfg.option("affine_norms", True)
        norm = lambda hf, ours: norm_specs(hf, ours) if affine else {}
        m = "model.decoder"
        specs = {
            f"{m}.embed_tokens.weight": WeightSpec("embed_tokens.embedding"),
            f"{m}.embed_positions.weight": WeightSpec("embed_positions.embedding"),
        }
        if cfg.option("word_embed_proj_dim", cfg.hidden_size) != cfg.hidden_size:
            specs |= linear_specs(f"{m}.project_in", "project_in", bias=False)
            specs |= linear_specs(f"{m}.project_out", "project_out", bias=False)
        if cfg.option("final_norm", True):
            specs |= norm(f"{m}.final_layer_norm", "norm")
        if not cfg.tie_word_embeddings:
            specs["lm_head.weight"] = WeightSpec("lm_head.kernel", transpose=True)
        for i in range(cfg.num_layers):
            hf, ours = f"{m}.layers.{i}", f"layers.{i}"
            specs |= norm(f"{hf}.self_attn_layer_norm", f"{ours}.self_attn_layer_norm")
            specs |= norm(f"{hf}.final_layer_norm", f"{ours}.final_layer_norm")
            for theirs, proj in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj")):
                specs |= linear_specs(f"{hf}.self_attn.{theirs}", f"{ours}.self_attn.{proj}", bias=cfg.attention_bias)
            specs |= linear_specs(f"{hf}.fc1", f"{ours}.mlp.up_proj", bias=cfg.mlp_bias)
            specs |= linear_specs(f"{hf}.fc2", f"{ours}.mlp.down_proj", bias=cfg.mlp_bias)
        return specs

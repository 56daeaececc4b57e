"""Microsoft's Phi family.

- Phi-3, Phi-3.5, Phi-4-mini (`Phi3ForCausalLM`): Llama's layer with fused `qkv_proj` and `gate_up_proj` (split at
  load), LongRoPE (short factors up to original_max_position_embeddings, long ones past it), partial rotary where
  the config says (`partial_rotary_factor`, Phi-4-mini), a sliding window on every layer if set.
- Phi-1/1.5/2 (`PhiForCausalLM`): attention and MLP in parallel off one LayerNorm, biases everywhere, partial
  rotary, optional per-head q/k LayerNorm (`qk_layernorm`), a final LayerNorm and an LM head with a bias.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.config import ModelConfig, model_config_from_hf
from jaxpaged.models.layers import REFERENCE_ATTENTION, MLP, Attention, CausalLM, Embedding, LayerNorm, module_list
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.weights import QKVSplit, WeightSpec, fused_qkv_specs, linear_specs, norm_specs
from jaxpaged.pallas_kernels import AttentionBackend


def _rotary_dim(hf_config, head_dim: int) -> int:
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    return int(head_dim * (1.0 if factor is None else float(factor)))


@dataclasses.dataclass(frozen=True)
class HalvesSplit:
    """A fused [.., 2F] output axis -> its first and second halves (Phi-3's gate_up_proj: gate, then up)."""

    def __call__(self, x):
        f = x.shape[-1] // 2
        return x[..., :f], x[..., f:]


class Phi3ForCausalLM(LlamaForCausalLM):
    """The Llama port with Phi-3's config and fused checkpoint layout."""

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads)
        rotary_dim = _rotary_dim(hf_config, head_dim)
        return model_config_from_hf(hf_config, architecture, head_dim=head_dim, rotary_dim=rotary_dim)

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        specs = {"model.embed_tokens.weight": WeightSpec("embed_tokens.embedding")}
        specs["model.norm.weight"] = WeightSpec("norm.scale")
        if not cfg.tie_word_embeddings:
            specs["lm_head.weight"] = WeightSpec("lm_head.kernel", transpose=True)
        split = QKVSplit(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, "concat")
        gate_up = ("gate_proj", "up_proj")
        for i in range(cfg.num_layers):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            specs[f"{hf}.input_layernorm.weight"] = WeightSpec(f"{ours}.input_layernorm.scale")
            specs[f"{hf}.post_attention_layernorm.weight"] = WeightSpec(f"{ours}.post_attention_layernorm.scale")
            specs |= fused_qkv_specs(f"{hf}.self_attn.qkv_proj", f"{ours}.self_attn", split, bias=False)
            specs |= linear_specs(f"{hf}.self_attn.o_proj", f"{ours}.self_attn.o_proj", bias=False)
            kernels = tuple(f"{ours}.mlp.{p}.kernel" for p in gate_up)
            specs[f"{hf}.mlp.gate_up_proj.weight"] = WeightSpec(kernels, transpose=True, split=HalvesSplit())
            specs |= linear_specs(f"{hf}.mlp.down_proj", f"{ours}.mlp.down_proj", bias=False)
        return specs


class PhiDecoderLayer(nnx.Module):
    """x + attn(ln(x)) + mlp(ln(x)): one LayerNorm feeds both branches."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, layer, dtype=dtype, attention=attention)
        if cfg.option("qk_layernorm", False):  # LayerNorm over each head, not the shared layer's RMSNorm
            self.self_attn.q_norm = nnx.data(LayerNorm(cfg.head_dim, eps=cfg.layer_norm_eps, dtype=dtype))
            self.self_attn.k_norm = nnx.data(LayerNorm(cfg.head_dim, eps=cfg.layer_norm_eps, dtype=dtype))
        self.mlp = MLP(cfg, dtype=dtype)

    def __call__(self, x, rope, kv_cache, attn_metadata):
        h = self.input_layernorm(x)
        attn, new_kv = self.self_attn(h, rope, kv_cache, attn_metadata)
        return attn + self.mlp(h) + x, new_kv


class PhiForCausalLM(CausalLM):
    SKIPPED_TENSORS = (ROTARY_CACHE,)
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list(
            [PhiDecoderLayer(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)]
        )
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        head_dim = int(hf_config.hidden_size) // int(hf_config.num_attention_heads)
        return model_config_from_hf(
            hf_config, architecture, head_dim=head_dim, rotary_dim=_rotary_dim(hf_config, head_dim),
            attention_bias=True, mlp_bias=True, lm_head_bias=True,
            hidden_act=str(getattr(hf_config, "hidden_act", "gelu_new")),
            options={"qk_layernorm": bool(getattr(hf_config, "qk_layernorm", False))},
        )  # fmt: skip

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        specs = {"model.embed_tokens.weight": WeightSpec("embed_tokens.embedding")}
        specs |= norm_specs("model.final_layernorm", "norm")
        if cfg.tie_word_embeddings:
            specs["lm_head.bias"] = WeightSpec("lm_head_bias")
        else:
            specs |= linear_specs("lm_head", "lm_head", bias=True)
        for i in range(cfg.num_layers):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            specs |= norm_specs(f"{hf}.input_layernorm", f"{ours}.input_layernorm")
            for proj in ("q_proj", "k_proj", "v_proj"):
                specs |= linear_specs(f"{hf}.self_attn.{proj}", f"{ours}.self_attn.{proj}", bias=True)
            specs |= linear_specs(f"{hf}.self_attn.dense", f"{ours}.self_attn.o_proj", bias=True)
            if cfg.option("qk_layernorm", False):
                specs |= norm_specs(f"{hf}.self_attn.q_layernorm", f"{ours}.self_attn.q_norm")
                specs |= norm_specs(f"{hf}.self_attn.k_layernorm", f"{ours}.self_attn.k_norm")
            specs |= linear_specs(f"{hf}.mlp.fc1", f"{ours}.mlp.up_proj", bias=True)
            specs |= linear_specs(f"{hf}.mlp.fc2", f"{ours}.mlp.down_proj", bias=True)
        return specs

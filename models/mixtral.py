"""Mixture-of-experts families with Llama's attention: Mixtral, Qwen2-MoE, Qwen3-MoE (models/moe.py has the MoE MLP).

- Mixtral: every layer sparse, top-2 renormalized; a sliding window when the config sets one.
- Qwen2-MoE: q/k/v biased; a shared expert behind a sigmoid gate; `norm_topk_prob`; dense layers where
  `mlp_only_layers` / `decoder_sparse_step` say so (their MLP is `intermediate_size` wide).
- Qwen3-MoE: Qwen3's q/k RMSNorm, `attention_bias` on all four projections; many experts, `norm_topk_prob`.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.config import ModelConfig, model_config_from_hf, text_config
from jaxpaged.models.layers import REFERENCE_ATTENTION, Attention, CausalLM, Embedding, GatedMLP, RMSNorm, module_list
from jaxpaged.models.moe import MoeOptions, SparseMoeBlock, moe_mlp_specs, moe_options_from_hf, regroup_expert_tensors
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.weights import WeightSpec, decoder_specs, layer_prefixes, scale_specs
from jaxpaged.models.llama import attention_specs
from jaxpaged.pallas_kernels import AttentionBackend


class MoeDecoderLayer(nnx.Module):
    """Pre-norm attention (`attention_cls`), then a sparse MoE block (`moe_cls`: Mixtral's, DeepSeek's, Llama 4's) on
    the sparse layers and a GatedMLP elsewhere."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend, attention_cls=Attention,
                 moe_cls=SparseMoeBlock):  # fmt: skip
        moe = MoeOptions.of(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = attention_cls(cfg, layer, dtype=dtype, attention=attention)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = moe_cls(cfg, moe, dtype=dtype) if layer in moe.sparse_layers else GatedMLP(cfg, dtype=dtype)

    def __call__(self, x, rope, kv_cache, attn_metadata):
        attn, new_kv = self.self_attn(self.input_layernorm(x), rope, kv_cache, attn_metadata)
        x = x + attn
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, SparseMoeBlock):  # the bucket's padding rows (past the real tokens) take no expert
            x = x + self.mlp(h, num_valid=attn_metadata.query_start_loc[-1])
        else:
            x = x + self.mlp(h)
        return x, new_kv


class MoeForCausalLM(CausalLM):
    SKIPPED_TENSORS = (ROTARY_CACHE,)
    attention_cls = Attention

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list([
            MoeDecoderLayer(cfg, i, dtype=dtype, attention=attention, attention_cls=self.attention_cls)
            for i in range(cfg.num_layers)
        ])  # fmt: skip
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    def regroup_tensors(self, tensors, missing=None):
        return regroup_expert_tensors(tensors, MoeOptions.of(self.config).num_experts, missing)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hf = text_config(hf_config)
        if architecture == "MixtralForCausalLM":
            moe = moe_options_from_hf(
                hf, num_experts=int(hf.num_local_experts), renormalize=True, intermediate_size=int(hf.intermediate_size)
            )
            return model_config_from_hf(hf, architecture, options={"moe": moe.as_option()})
        moe = moe_options_from_hf(
            hf, num_experts=int(hf.num_experts), renormalize=bool(getattr(hf, "norm_topk_prob", False)),
            intermediate_size=int(hf.moe_intermediate_size),
            shared_expert_size=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0),
        )  # fmt: skip
        if architecture == "Qwen2MoeForCausalLM":  # q/k/v biased per qkv_bias, o_proj never
            bias = bool(getattr(hf, "qkv_bias", True))
            return model_config_from_hf(
                hf, architecture, attention_bias=bias, attention_out_bias=False, options={"moe": moe.as_option()}
            )
        return model_config_from_hf(hf, architecture, qk_norm=True, options={"moe": moe.as_option()})  # Qwen3-MoE

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        """Every tensor this port needs, and where it goes; experts by their stacked names (moe.expert_kernel_name)."""
        moe = MoeOptions.of(cfg)
        specs = decoder_specs(cfg.tie_word_embeddings)
        for i, hf, ours in layer_prefixes(cfg.num_layers):
            specs |= scale_specs(hf, ours)
            specs |= attention_specs(cfg, hf, ours)
            specs |= moe_mlp_specs(moe, i, hf, ours)
        return specs


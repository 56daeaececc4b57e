"""GLM-4.5 / 4.6 / 4.7 (transformers' Glm4MoeForCausalLM), as transformers 5.24's modeling code computes it:

- attention: Llama's, q/k/v biased per `attention_bias` (o_proj never), per-head q/k RMSNorm when `use_qk_norm`,
  rotate-half RoPE on the first `partial_rotary_factor` (0.5 by default) of each head;
- MLP: dense on the first `first_k_dense_replace` layers, then DeepSeek-V3's MoE block (models/deepseek.py,
  DeepseekMoeBlock): sigmoid scores plus `e_score_correction_bias` for choosing, groups (`n_group`/`topk_group`)
  ranked by their top-2 sum, `norm_topk_prob`, `routed_scaling_factor`, and `n_shared_experts` always-on experts;
- the multi-token-prediction layer (`num_nextn_predict_layers`, stored as `model.layers.{num_hidden_layers}.*`) is
  skipped unread, as DeepSeek-V3's is; speculative method "mtp" reads and runs it (spec_decode/mtp_layers.py).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxpaged.models.config import ModelConfig, model_config_from_hf, text_config
from jaxpaged.models.deepseek import (
    DeepseekForCausalLM, DeepseekMoeBlock, _as_option, deepseek_moe_specs, router_options_from_hf,
)  # fmt: skip
from jaxpaged.models.layers import REFERENCE_ATTENTION, Embedding, RMSNorm, module_list
from jaxpaged.models.llama import attention_specs
from jaxpaged.models.mixtral import MoeDecoderLayer, MoeForCausalLM
from jaxpaged.models.moe import MoeOptions, RouterOptions
from jaxpaged.models.weights import WeightSpec, decoder_specs, layer_prefixes, scale_specs
from jaxpaged.pallas_kernels import AttentionBackend


class RoutedMoeForCausalLM(MoeForCausalLM):
    """MoeForCausalLM with DeepSeek's routed MoE block: the decoder GLM-4.5 and MiniMax-M2 share."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list([self.decoder_layer(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    @classmethod
    def decoder_layer(cls, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend) -> MoeDecoderLayer:
        """Layer `layer` (also GLM-4.5's MTP layer's block: spec_decode/mtp_layers.py)."""
        return MoeDecoderLayer(cfg, layer, dtype=dtype, attention=attention, attention_cls=cls.attention_cls, moe_cls=DeepseekMoeBlock)

    unread_tensors = staticmethod(DeepseekForCausalLM.unread_tensors)  # the MTP layers (option "mtp_layers")
    CORRECTION_BIAS = "gate.e_score_correction_bias"  # where the checkpoint keeps the router's bias, under `mlp.`

    @classmethod
    def weight_specs(cls, cfg: ModelConfig) -> dict[str, WeightSpec]:
        moe, router = MoeOptions.of(cfg), RouterOptions(**dict(cfg.option("router")))
        specs = decoder_specs(cfg.tie_word_embeddings)
        for i, hf, ours in layer_prefixes(cfg.num_layers):
            specs |= scale_specs(hf, ours)
            specs |= attention_specs(cfg, hf, ours)
            specs |= deepseek_moe_specs(moe, router, i, hf, ours, bias=cls.CORRECTION_BIAS)
        return specs


def partial_rotary_dim(hf, head_dim: int, default: float = 1.0) -> int:
    """int(head_dim * partial_rotary_factor), the factor read where transformers 5 keeps it (rope_parameters)."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    return int(head_dim * float(default if factor is None else factor))


class Glm4MoeForCausalLM(RoutedMoeForCausalLM):
    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hf = text_config(hf_config)
        experts = int(hf.n_routed_experts)
        first_dense = int(getattr(hf, "first_k_dense_replace", 0) or 0)
        moe = MoeOptions(
            num_experts=experts, top_k=int(hf.num_experts_per_tok), intermediate_size=int(hf.moe_intermediate_size),
            renormalize=bool(hf.norm_topk_prob),
            shared_expert_size=int(hf.moe_intermediate_size) * int(getattr(hf, "n_shared_experts", 0) or 0),
            sparse_layers=tuple(range(first_dense, int(hf.num_hidden_layers))),
        )  # fmt: skip
        router = router_options_from_hf(hf, True, moe)  # V3's: sigmoid, correction bias, groups by top-2 sum
        mtp = int(getattr(hf, "num_nextn_predict_layers", None) or 0)
        options = {"moe": moe.as_option(), "router": _as_option(router), "mtp_layers": mtp}
        heads = int(hf.num_attention_heads)
        head_dim = int(getattr(hf, "head_dim", None) or int(hf.hidden_size) // heads)
        return model_config_from_hf(
            hf_config, architecture, qk_norm=bool(getattr(hf, "use_qk_norm", False)), attention_out_bias=False,
            rotary_dim=partial_rotary_dim(hf, head_dim, default=0.5), options=options,
        )  # fmt: skip


"""MiniMax-M2, M2.1, M2.5 (transformers' MiniMaxM2ForCausalLM), as transformers 5.24's modeling code computes it:

- attention: no biases; q/k RMSNorm over the whole projection (every head at once, OLMoE's: models/olmoe.py), then
  rotate-half RoPE on the first `rotary_dim` of each head (transformers reads it as `partial_rotary_factor`);
- every layer routed, no shared expert: sigmoid scores, `e_score_correction_bias` (kept beside the router, at
  `mlp.e_score_correction_bias`, `block_sparse_moe.` in the released checkpoints) added for choosing only, top-k,
  the chosen scores renormalized: DeepSeek-V3's router without groups or scaling (models/deepseek.py's block);
- experts stored per expert as Mixtral's `block_sparse_moe.experts.N.w1/w2/w3` (models/moe.py stacks them);
- the multi-token-prediction modules (`num_mtp_modules`, stored after the last layer) are skipped unread.
"""

from __future__ import annotations

from jaxpaged.models.config import ModelConfig, model_config_from_hf, text_config
from jaxpaged.models.deepseek import _as_option
from jaxpaged.models.glm4_moe import RoutedMoeForCausalLM, partial_rotary_dim
from jaxpaged.models.moe import MoeOptions, RouterOptions
from jaxpaged.models.olmoe import OlmoeAttention


class MiniMaxM2ForCausalLM(RoutedMoeForCausalLM):
    attention_cls = OlmoeAttention  # q/k norm over the whole projection width
    CORRECTION_BIAS = "e_score_correction_bias"  # beside mlp.gate, not in it

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hf = text_config(hf_config)
        layers = int(hf.num_hidden_layers)
        moe = MoeOptions(
            num_experts=int(hf.num_local_experts), top_k=int(hf.num_experts_per_tok),
            intermediate_size=int(hf.intermediate_size), renormalize=True, sparse_layers=tuple(range(layers)),
        )  # fmt: skip
        if not 0 < moe.top_k <= moe.num_experts:
            raise ValueError(f"num_experts_per_tok={moe.top_k} must be between 1 and num_local_experts={moe.num_experts}")
        router = RouterOptions(scoring="sigmoid", correction_bias=True, renormalize=True)
        mtp = int(getattr(hf, "num_mtp_modules", None) or 0)
        options = {"moe": moe.as_option(), "router": _as_option(router), "mtp_layers": mtp, "whole_width_qk_norm": True}
        head_dim = int(getattr(hf, "head_dim", None) or int(hf.hidden_size) // int(hf.num_attention_heads))
        rotary = partial_rotary_dim(hf, head_dim)
        if getattr(hf, "rotary_dim", None) and not dict(getattr(hf, "rope_parameters", None) or {}).get("partial_rotary_factor"):
            rotary = int(hf.rotary_dim)  # a config transformers did not convert (its legacy spelling)
        return model_config_from_hf(
            hf_config, architecture, qk_norm=True, attention_bias=False, attention_out_bias=False, rotary_dim=rotary,
            options=options,
        )  # fmt: skip


"""OLMoE: the shared MoE decoder (models/mixtral.py) with OLMo's attention: q/k RMSNorm over the whole projection
width (not per head), then `clip_qkv` on q, k and v when set, then RoPE; biases on all four projections per
`attention_bias`."""

from __future__ import annotations

import jax.numpy as jnp
from jaxpaged.models.config import ModelConfig, model_config_from_hf, text_config
from jaxpaged.models.layers import Attention, RMSNorm, apply_rope
from jaxpaged.models.mixtral import MoeForCausalLM
from jaxpaged.models.moe import moe_options_from_hf
from jaxpaged.pallas_kernels import AttentionMetadata, paged_attention


class OlmoeAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention):
        super().__init__(cfg, layer, dtype=dtype, attention=attention, clip_qkv=cfg.option("clip_qkv"))
        # transformers sizes k_norm (hidden / heads) * kv_heads, which is k_proj's width whenever head_dim = hidden / heads
        self.q_norm = RMSNorm(cfg.num_heads * cfg.head_dim, eps=cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(cfg.num_kv_heads * cfg.head_dim, eps=cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, x, rope, kv_cache, attn_metadata: AttentionMetadata):
        (h, hd), t = self.shape, x.shape[0]
        q, k, v = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x)
        if self.clip_qkv is not None:
            q, k, v = (jnp.clip(a, -self.clip_qkv, self.clip_qkv) for a in (q, k, v))
        q, k, v = q.reshape(t, h, hd), k.reshape(t, -1, hd), v.reshape(t, -1, hd)
        q, k = apply_rope(q, rope, interleaved=self.interleaved), apply_rope(k, rope, interleaved=self.interleaved)
        out = paged_attention(q, k, v, kv_cache, self.layer, attn_metadata, self.spec, None, backend=self.backend)
        return self.o_proj(out.reshape(t, h * hd)), (k, v)


class OlmoeForCausalLM(MoeForCausalLM):
    attention_cls = OlmoeAttention

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hf = text_config(hf_config)
        moe = moe_options_from_hf(
            hf, num_experts=int(hf.num_experts), renormalize=bool(getattr(hf, "norm_topk_prob", False)),
            intermediate_size=int(hf.intermediate_size),
        )  # fmt: skip
        clip = getattr(hf, "clip_qkv", None)
        options = {"moe": moe.as_option(), "clip_qkv": None if clip is None else float(clip), "whole_width_qk_norm": True}
        return model_config_from_hf(hf, architecture, qk_norm=True, options=options)

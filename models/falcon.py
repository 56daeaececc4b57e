"""Falcon, both decoder architectures transformers implements:

- new (Falcon-40B/180B, Falcon2): grouped KV heads, fused QKV laid out per KV group, attention and MLP in
  parallel off two LayerNorms (ln_attn, ln_mlp) or one (num_ln_in_parallel_attn=1);
- old (Falcon-7B, Falcon-RW): multi-query (one K/V head) or multi-head; parallel_attn shares one
  LayerNorm between attention and MLP, else the usual sequential block; RoPE or, with `alibi`, ALiBi.

transformers adds Falcon's ALiBi before the 1/sqrt(head_dim) scaling, so the slopes are divided by it
here. It also rounds the bias slope * key_pos to bfloat16 (build_alibi_tensor); this port keeps it in
float32, which is identical when the head count is a power of two up to 8 and positions stay under
256, and otherwise differs by that rounding (docs/models.md).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.config import ModelConfig, model_config_from_hf
from jaxpaged.models.layers import REFERENCE_ATTENTION, MLP, Attention, CausalLM, Embedding, LayerNorm, alibi_slopes, module_list
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.weights import QKVSplit, WeightSpec, fused_qkv_specs, linear_specs, norm_specs
from jaxpaged.pallas_kernels import AttentionBackend


def _norm_names(cfg: ModelConfig) -> tuple[str, ...]:
    if cfg.option("new_decoder_architecture"):
        return ("ln_attn", "ln_mlp") if cfg.option("num_ln_in_parallel_attn") == 2 else ("input_layernorm",)
    return ("input_layernorm",) if cfg.option("parallel_attn") else ("input_layernorm", "post_attention_layernorm")


class FalconDecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        names = _norm_names(cfg)
        for name in names:
            setattr(self, name, LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype))
        alibi = alibi_slopes(cfg.num_heads) * cfg.head_dim**-0.5 if cfg.position_embedding == "alibi" else None
        self.self_attn = Attention(cfg, layer, dtype=dtype, attention=attention, alibi=alibi)
        self.mlp = MLP(cfg, dtype=dtype)
        self.layout = "two_norms" if "ln_attn" in names else "sequential" if len(names) == 2 else "parallel"

    def __call__(self, x, rope, kv_cache, attn_metadata):
        if self.layout == "two_norms":
            attn, new_kv = self.self_attn(self.ln_attn(x), rope, kv_cache, attn_metadata)
            return x + attn + self.mlp(self.ln_mlp(x)), new_kv
        h = self.input_layernorm(x)
        attn, new_kv = self.self_attn(h, rope, kv_cache, attn_metadata)
        if self.layout == "parallel":
            return x + attn + self.mlp(h), new_kv
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), new_kv


class FalconForCausalLM(CausalLM):
    SKIPPED_TENSORS = (ROTARY_CACHE,)
    BASE_PREFIX = "transformer."

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list(
            [FalconDecoderLayer(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)]
        )
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hidden, heads = int(hf_config.hidden_size), int(hf_config.num_attention_heads)
        new = bool(getattr(hf_config, "new_decoder_architecture", False))
        multi_query = bool(getattr(hf_config, "multi_query", True))
        kv = int(hf_config.num_kv_heads) if new else 1 if multi_query else heads
        num_ln = getattr(hf_config, "num_ln_in_parallel_attn", None) or (2 if new else 1)
        parallel = bool(getattr(hf_config, "parallel_attn", True))
        if new and not (parallel or num_ln == 2):
            raise ValueError("Falcon's new decoder architecture needs parallel_attn or two layer norms (as transformers)")
        bias = bool(getattr(hf_config, "bias", False))
        return model_config_from_hf(
            hf_config, architecture, intermediate_size=int(getattr(hf_config, "ffn_hidden_size", None) or 4 * hidden),
            num_kv_heads=kv, head_dim=hidden // heads, hidden_act=str(getattr(hf_config, "activation", "gelu")),
            attention_bias=bias, mlp_bias=bias, position_embedding="alibi" if hf_config.alibi else "rope",
            options={"new_decoder_architecture": new, "num_ln_in_parallel_attn": int(num_ln), "parallel_attn": parallel},
        )  # fmt: skip

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        specs = {"transformer.word_embeddings.weight": WeightSpec("embed_tokens.embedding")}
        specs |= norm_specs("transformer.ln_f", "norm")
        if not cfg.tie_word_embeddings:
            specs["lm_head.weight"] = WeightSpec("lm_head.kernel", transpose=True)
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        split = QKVSplit(h, kv, d, "concat" if kv == 1 and not cfg.option("new_decoder_architecture") else "grouped")
        for i in range(cfg.num_layers):
            hf, ours = f"transformer.h.{i}", f"layers.{i}"
            for name in _norm_names(cfg):
                specs |= norm_specs(f"{hf}.{name}", f"{ours}.{name}")
            bias = cfg.attention_bias
            specs |= fused_qkv_specs(f"{hf}.self_attention.query_key_value", f"{ours}.self_attn", split, bias=bias)
            specs |= linear_specs(f"{hf}.self_attention.dense", f"{ours}.self_attn.o_proj", bias=bias)
            specs |= linear_specs(f"{hf}.mlp.dense_h_to_4h", f"{ours}.mlp.up_proj", bias=cfg.mlp_bias)
            specs |= linear_specs(f"{hf}.mlp.dense_4h_to_h", f"{ours}.mlp.down_proj", bias=cfg.mlp_bias)
        return specs

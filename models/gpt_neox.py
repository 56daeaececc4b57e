"""GPT-NeoX / Pythia: rotary on the first rotary_pct of each head (rotate-half), fused per-head QKV,
and (by default) the parallel residual x + attn(ln1(x)) + mlp(ln2(x))."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.config import ModelConfig, model_config_from_hf
from jaxpaged.models.layers import REFERENCE_ATTENTION, MLP, Attention, CausalLM, Embedding, LayerNorm, module_list
from jaxpaged.models.accounting import CAUSAL_MASK, ROTARY_CACHE
from jaxpaged.models.weights import QKVSplit, WeightSpec, fused_qkv_specs, linear_specs, norm_specs
from jaxpaged.pallas_kernels import AttentionBackend


class GPTNeoXLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, layer, dtype=dtype, attention=attention)
        self.mlp = MLP(cfg, dtype=dtype)
        self.parallel = cfg.option("use_parallel_residual", True)

    def __call__(self, x, rope, kv_cache, attn_metadata):
        attn, new_kv = self.self_attn(self.input_layernorm(x), rope, kv_cache, attn_metadata)
        if self.parallel:
            return x + attn + self.mlp(self.post_attention_layernorm(x)), new_kv
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), new_kv


class GPTNeoXForCausalLM(CausalLM):
    SKIPPED_TENSORS = (ROTARY_CACHE, CAUSAL_MASK)
    CHECKPOINT_RENAMES = ((r"^lm_head\.", "embed_out."),)  # the hub's name; transformers 5 says lm_head

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list(
            [GPTNeoXLayer(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)]
        )
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hidden, heads = int(hf_config.hidden_size), int(hf_config.num_attention_heads)
        head_dim = hidden // heads
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        factor = rope.get("partial_rotary_factor", getattr(hf_config, "rotary_pct", 1.0))
        return model_config_from_hf(
            hf_config, architecture, num_kv_heads=heads, head_dim=head_dim, rotary_dim=int(head_dim * factor),
            attention_bias=bool(getattr(hf_config, "attention_bias", True)), mlp_bias=True,
            options={"use_parallel_residual": bool(getattr(hf_config, "use_parallel_residual", True))},
        )  # fmt: skip

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        specs = {"gpt_neox.embed_in.weight": WeightSpec("embed_tokens.embedding")}
        specs |= norm_specs("gpt_neox.final_layer_norm", "norm")
        if not cfg.tie_word_embeddings:
            specs["embed_out.weight"] = WeightSpec("lm_head.kernel", transpose=True)
        split = QKVSplit(cfg.num_heads, cfg.num_heads, cfg.head_dim, "grouped")  # [H, 3, D]
        for i in range(cfg.num_layers):
            hf, ours = f"gpt_neox.layers.{i}", f"layers.{i}"
            specs |= norm_specs(f"{hf}.input_layernorm", f"{ours}.input_layernorm")
            specs |= norm_specs(f"{hf}.post_attention_layernorm", f"{ours}.post_attention_layernorm")
            bias = cfg.attention_bias
            specs |= fused_qkv_specs(f"{hf}.attention.query_key_value", f"{ours}.self_attn", split, bias=bias)
            specs |= linear_specs(f"{hf}.attention.dense", f"{ours}.self_attn.o_proj", bias=bias)
            specs |= linear_specs(f"{hf}.mlp.dense_h_to_4h", f"{ours}.mlp.up_proj", bias=True)
            specs |= linear_specs(f"{hf}.mlp.dense_4h_to_h", f"{ours}.mlp.down_proj", bias=True)
        return specs

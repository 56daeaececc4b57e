"""GPT-J: one LayerNorm feeding attention and MLP in parallel, rotary on the first rotary_dim
features of each head with GPT-J's interleaved (rotate-every-two) pairing, an LM head with a bias."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.config import ModelConfig, model_config_from_hf
from jaxpaged.models.layers import REFERENCE_ATTENTION, MLP, Attention, CausalLM, Embedding, LayerNorm, module_list
from jaxpaged.models.accounting import CAUSAL_MASK
from jaxpaged.models.weights import WeightSpec, linear_specs, norm_specs
from jaxpaged.pallas_kernels import AttentionBackend


class GPTJBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        self.ln_1 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, layer, dtype=dtype, attention=attention)
        self.mlp = MLP(cfg, dtype=dtype)

    def __call__(self, x, rope, kv_cache, attn_metadata):
        h = self.ln_1(x)
        attn, new_kv = self.self_attn(h, rope, kv_cache, attn_metadata)
        return x + attn + self.mlp(h), new_kv


class GPTJForCausalLM(CausalLM):
    SKIPPED_TENSORS = (CAUSAL_MASK,)
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list(
            [GPTJBlock(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)]
        )
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hidden, heads = int(hf_config.hidden_size), int(hf_config.num_attention_heads)
        rotary_dim = getattr(hf_config, "rotary_dim", None)
        if not rotary_dim:  # transformers' GPT-J then rotates with embed_dim frequencies, which only fits one head
            raise ValueError("GPT-J configs without rotary_dim are not supported (every released GPT-J sets it)")
        return model_config_from_hf(
            hf_config, architecture,
            intermediate_size=int(getattr(hf_config, "n_inner", None) or 4 * hidden),
            num_kv_heads=heads, head_dim=hidden // heads, hidden_act=str(hf_config.activation_function),
            rotary_dim=int(rotary_dim), rope_interleaved=True, mlp_bias=True, lm_head_bias=True,
        )  # fmt: skip

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        specs = {"transformer.wte.weight": WeightSpec("embed_tokens.embedding")} | norm_specs("transformer.ln_f", "norm")
        if cfg.tie_word_embeddings:
            specs["lm_head.bias"] = WeightSpec("lm_head_bias")
        else:
            specs |= linear_specs("lm_head", "lm_head", bias=True)
        for i in range(cfg.num_layers):
            hf, ours = f"transformer.h.{i}", f"layers.{i}"
            specs |= norm_specs(f"{hf}.ln_1", f"{ours}.ln_1")
            for theirs, proj in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj")):
                specs |= linear_specs(f"{hf}.attn.{theirs}", f"{ours}.self_attn.{proj}", bias=False)
            specs |= linear_specs(f"{hf}.mlp.fc_in", f"{ours}.mlp.up_proj", bias=True)
            specs |= linear_specs(f"{hf}.mlp.fc_out", f"{ours}.mlp.down_proj", bias=True)
        return specs

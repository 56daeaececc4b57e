"""GPT-2 and GPT-BigCode (StarCoder, SantaCoder): LayerNorm pre-norm blocks, learned absolute positions.

They differ in the weight layout: GPT-2 stores Conv1D weights already [in, out] and fuses q|k|v in
`c_attn`; BigCode uses torch Linear ([out, in]) and, with `multi_query`, one shared K/V head
(`c_attn` = q | k | v of widths D, head_dim, head_dim), else per-head q, k, v groups.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.config import ModelConfig, model_config_from_hf
from jaxpaged.models.layers import REFERENCE_ATTENTION, MLP, Attention, CausalLM, Embedding, LayerNorm, module_list
from jaxpaged.models.accounting import CAUSAL_MASK
from jaxpaged.models.weights import QKVSplit, WeightSpec, fused_qkv_specs, linear_specs, norm_specs
from jaxpaged.pallas_kernels import AttentionBackend


class GPT2Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        scale = cfg.head_dim**-0.5 if cfg.option("scale_attn_weights", True) else 1.0
        if cfg.option("scale_attn_by_inverse_layer_idx", False):
            scale /= layer + 1
        self.ln_1 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, layer, dtype=dtype, attention=attention, scale=scale)
        self.ln_2 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype=dtype)

    def __call__(self, x, rope, kv_cache, attn_metadata):
        attn, new_kv = self.self_attn(self.ln_1(x), rope, kv_cache, attn_metadata)
        x = x + attn
        return x + self.mlp(self.ln_2(x)), new_kv


class GPT2LMHeadModel(CausalLM):
    SKIPPED_TENSORS = (CAUSAL_MASK,)
    BASE_PREFIX = "transformer."  # the hub's gpt2 checkpoints omit it
    CONV1D = True  # GPT-2's weights are Conv1D, [in, out]: no transpose

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_positions = Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.layers = module_list(
            [GPT2Block(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)]
        )
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    def embed(self, input_ids, positions):
        return self.embed_tokens(input_ids) + self.embed_positions(positions)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hidden, heads = int(hf_config.hidden_size), int(hf_config.num_attention_heads)
        multi_query = bool(getattr(hf_config, "multi_query", False))
        return model_config_from_hf(
            hf_config, architecture,
            intermediate_size=int(getattr(hf_config, "n_inner", None) or 4 * hidden),
            num_kv_heads=1 if multi_query else heads,
            head_dim=hidden // heads,
            hidden_act=str(hf_config.activation_function),
            position_embedding="learned", attention_bias=True, mlp_bias=True,
            options={
                "scale_attn_weights": bool(getattr(hf_config, "scale_attn_weights", True)),
                "scale_attn_by_inverse_layer_idx": bool(getattr(hf_config, "scale_attn_by_inverse_layer_idx", False)),
            },
        )  # fmt: skip

    @classmethod
    def weight_specs(cls, cfg: ModelConfig) -> dict[str, WeightSpec]:
        t = not cls.CONV1D
        specs = {
            "transformer.wte.weight": WeightSpec("embed_tokens.embedding"),
            "transformer.wpe.weight": WeightSpec("embed_positions.embedding"),
        } | norm_specs("transformer.ln_f", "norm")
        if not cfg.tie_word_embeddings:
            specs["lm_head.weight"] = WeightSpec("lm_head.kernel", transpose=True)
        layout = "concat" if cfg.num_kv_heads == 1 or cls.CONV1D else "grouped"
        split = QKVSplit(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, layout)
        for i in range(cfg.num_layers):
            hf, ours = f"transformer.h.{i}", f"layers.{i}"
            specs |= norm_specs(f"{hf}.ln_1", f"{ours}.ln_1") | norm_specs(f"{hf}.ln_2", f"{ours}.ln_2")
            specs |= fused_qkv_specs(f"{hf}.attn.c_attn", f"{ours}.self_attn", split, bias=True, transpose=t)
            specs |= linear_specs(f"{hf}.attn.c_proj", f"{ours}.self_attn.o_proj", bias=True, transpose=t)
            specs |= linear_specs(f"{hf}.mlp.c_fc", f"{ours}.mlp.up_proj", bias=True, transpose=t)
            specs |= linear_specs(f"{hf}.mlp.c_proj", f"{ours}.mlp.down_proj", bias=True, transpose=t)
        return specs


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    CONV1D = False

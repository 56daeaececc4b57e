"""Llama family (Llama 2/3.x, SmolLM2, TinyLlama): a Flax NNX port over the paged KV cache.

The forward pass is pure in the cache: it takes kv_cache and returns the updated one (or, from
`forward`, the new K/V for the runner to write into the donated cache in place).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import ACTIVATIONS, Embedding, Linear, RMSNorm, apply_rope, rope_inv_freq
from models.weights import WeightSpec
from pallas_kernels import AttentionMetadata, paged_attention, stack_new_kv, write_kv

# Flax >= 0.12 wants module lists wrapped so their arrays count as state.
_module_list = getattr(nnx, "List", list)


class LlamaAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention_backend: str):
        d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(d, h * hd, bias=cfg.attention_bias, dtype=dtype)
        self.k_proj = Linear(d, kv * hd, bias=cfg.attention_bias, dtype=dtype)
        self.v_proj = Linear(d, kv * hd, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = Linear(h * hd, d, bias=cfg.attention_bias, dtype=dtype)
        self.layer = layer
        self.shape = (h, kv, hd)
        self.inv_freq = tuple(rope_inv_freq(cfg.rope, hd).tolist())
        self.backend = attention_backend

    def __call__(self, x, positions, kv_cache, md: AttentionMetadata):
        h, kv, hd = self.shape
        t = x.shape[0]
        q = self.q_proj(x).reshape(t, h, hd)
        k = self.k_proj(x).reshape(t, kv, hd)
        v = self.v_proj(x).reshape(t, kv, hd)
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        out = paged_attention(q, k, v, kv_cache, self.layer, md, scale=hd**-0.5, backend=self.backend)
        return self.o_proj(out.reshape(t, h * hd)), (k, v)


class LlamaMLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, f, bias=cfg.mlp_bias, dtype=dtype)
        self.up_proj = Linear(d, f, bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = Linear(f, d, bias=cfg.mlp_bias, dtype=dtype)
        self.act = cfg.hidden_act

    def __call__(self, x):
        return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention_backend: str):
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(cfg, layer, dtype=dtype, attention_backend=attention_backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = LlamaMLP(cfg, dtype=dtype)

    def __call__(self, x, positions, kv_cache, md):
        attn, new_kv = self.self_attn(self.input_layernorm(x), positions, kv_cache, md)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_kv


class LlamaForCausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "reference"):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = _module_list(
            [LlamaDecoderLayer(cfg, i, dtype=dtype, attention_backend=attention_backend) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)

    def forward(self, input_ids, positions, kv_cache, md: AttentionMetadata):
        """input_ids, positions: [T] -> (final hidden states [T, D], this step's K/V [T, L, 2, H_kv, D]).

        Reads the cache only; the runner writes the new K/V with write_kv in a second jitted call
        that donates the cache (see pallas_kernels/attention.py for why).
        """
        x = self.embed_tokens(input_ids)
        new_kv = []
        for layer in self.layers:
            x, layer_kv = layer(x, positions, kv_cache, md)
            new_kv.append(layer_kv)
        return self.norm(x), stack_new_kv(new_kv)

    def __call__(self, input_ids, positions, kv_cache, md: AttentionMetadata):
        """-> (hidden [T, D], updated kv_cache): forward and write in one call."""
        hidden, new_kv = self.forward(input_ids, positions, kv_cache, md)
        return hidden, write_kv(kv_cache, new_kv, md.slot_mapping)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        if self.lm_head is None:
            return self.embed_tokens.attend(hidden)
        return self.lm_head(hidden).astype(jnp.float32)

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        """Every HF tensor name this port needs, and where it goes."""
        specs = {"model.embed_tokens.weight": WeightSpec("embed_tokens.embedding")}
        specs["model.norm.weight"] = WeightSpec("norm.scale")
        if not cfg.tie_word_embeddings:
            specs["lm_head.weight"] = WeightSpec("lm_head.kernel", transpose=True)
        for i in range(cfg.num_layers):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            specs[f"{hf}.input_layernorm.weight"] = WeightSpec(f"{ours}.input_layernorm.scale")
            specs[f"{hf}.post_attention_layernorm.weight"] = WeightSpec(f"{ours}.post_attention_layernorm.scale")
            projections = [("self_attn", p, cfg.attention_bias) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
            projections += [("mlp", p, cfg.mlp_bias) for p in ("gate_proj", "up_proj", "down_proj")]
            for block, proj, bias in projections:
                specs[f"{hf}.{block}.{proj}.weight"] = WeightSpec(f"{ours}.{block}.{proj}.kernel", transpose=True)
                if bias:
                    specs[f"{hf}.{block}.{proj}.bias"] = WeightSpec(f"{ours}.{block}.{proj}.bias")
        return specs

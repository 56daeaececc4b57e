"""Qwen3-Next and Qwen3.5 (dense and MoE, text): Gated DeltaNet linear attention in most layers, gated full
attention in the rest (`layer_types`), zero-centred RMSNorms.

- Gated attention: q_proj gives each head its query and an output gate (sigmoid); q/k zero-centred RMSNorm; RoPE on
  `partial_rotary_factor` of the head.
- Gated DeltaNet: q, k, v through a depthwise causal convolution (silu), L2-normalized q and k, the gated delta rule
  (pallas_kernels/gated_delta.py) with decay g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), a gated
  RMSNorm by silu(z), out_proj. Qwen3-Next's checkpoints fuse q, k, v, z per key head (`in_proj_qkvz`) and b, a
  (`in_proj_ba`); Qwen3.5's keep `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`. Both are split at load.
- MLP: Qwen3-Next sparse (models/moe.py) with a shared expert behind a sigmoid gate (dense where `mlp_only_layers` /
  `decoder_sparse_step` say); Qwen3.5 dense; Qwen3.5-MoE sparse in every layer, top-k renormalized.

Qwen3.5's image-text checkpoints (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`) are this
language model under a vision tower (models/vision/qwen3_5.py). Every checkpoint's multi-token-prediction head
(`mtp.*`) is skipped unless speculative method "mtp" reads and runs it (spec_decode/mtp_layers.py).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.config import ModelConfig, model_config_from_hf, text_config
from jaxpaged.models.hybrid import (
    CausalConv1d, ConcatSplit, GatedRMSNorm, GroupedSplit, HybridCausalLM, ZeroCenteredRMSNorm,
)  # fmt: skip
from jaxpaged.models.layers import REFERENCE_ATTENTION, Embedding, GatedMLP, Linear, _param, activation, apply_rope, module_list
from jaxpaged.models.llama import attention_specs
from jaxpaged.models.moe import MoeOptions, SparseMoeBlock, moe_mlp_specs, moe_options_from_hf, regroup_expert_tensors
from jaxpaged.models.weights import WeightSpec, decoder_specs, layer_prefixes, linear_specs, scale_specs
from jaxpaged.pallas_kernels import AttentionBackend, AttentionSpec, paged_attention
from jaxpaged.pallas_kernels.gated_delta import gated_delta_rule
from jaxpaged.pallas_kernels.state_cache import StateArray, causal_conv

MTP = (r"^mtp\.", "the multi-token-prediction layers (a draft head for speculative decoding): not part of the model, "
       "read apart by speculative method 'mtp' only")
FUSED_GDN = ("Qwen3NextForCausalLM",)  # checkpoints with in_proj_qkvz / in_proj_ba
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class GdnDims:
    """A Gated DeltaNet layer's sizes (ModelConfig option "gdn")."""

    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_dim

    @staticmethod
    def of(cfg: ModelConfig) -> GdnDims:
        return GdnDims(**dict(cfg.option("gdn")))

    def as_option(self) -> tuple[tuple[str, Any], ...]:
        return tuple(sorted(dataclasses.asdict(self).items()))


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum x^2 + eps) over the last axis, as FLA and transformers normalize q and k."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class GatedAttention(nnx.Module):
    """Full attention with an output gate: q_proj's [H, 2 * head_dim] is each head's query, then its gate."""

    kind = "attention"

    def __init__(self, cfg: ModelConfig, kv_index: int, *, dtype, attention: AttentionBackend):
        d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(d, 2 * h * hd, bias=cfg.attention_bias, dtype=dtype)
        self.k_proj = Linear(d, kv * hd, bias=cfg.attention_bias, dtype=dtype)
        self.v_proj = Linear(d, kv * hd, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = Linear(h * hd, d, bias=cfg.attention_bias, dtype=dtype)
        self.q_norm = ZeroCenteredRMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = ZeroCenteredRMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype)
        self.layer = kv_index  # its layer in the paged KV cache, which holds the attention layers only
        self.head_dim = hd
        self.spec = AttentionSpec(hd**-0.5)
        self.backend = attention

    def __call__(self, x, rope, kv_cache, attn_metadata):
        t, hd = x.shape[0], self.head_dim
        qg = self.q_proj(x).reshape(t, -1, 2 * hd)
        q, gate = self.q_norm(qg[..., :hd]), qg[..., hd:].reshape(t, -1)
        k = self.k_norm(self.k_proj(x).reshape(t, -1, hd))
        v = self.v_proj(x).reshape(t, -1, hd)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = paged_attention(q, k, v, kv_cache, self.layer, attn_metadata, self.spec, backend=self.backend)
        return self.o_proj(out.reshape(t, -1) * jax.nn.sigmoid(gate)), (k, v)


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet linear attention; its state per sequence: the convolution's last K - 1 inputs of q, k and v,
    and a [d_k, d_v] matrix per value head (float32)."""

    kind = "linear"

    def __init__(self, cfg: ModelConfig, state_index: int, *, dtype):
        g = GdnDims.of(cfg)
        d = cfg.hidden_size
        self.in_proj_q = Linear(d, g.key_dim, bias=False, dtype=dtype)
        self.in_proj_k = Linear(d, g.key_dim, bias=False, dtype=dtype)
        self.in_proj_v = Linear(d, g.value_dim, bias=False, dtype=dtype)
        self.in_proj_z = Linear(d, g.value_dim, bias=False, dtype=dtype)
        self.in_proj_b = Linear(d, g.num_v_heads, bias=False, dtype=dtype)
        self.in_proj_a = Linear(d, g.num_v_heads, bias=False, dtype=dtype)
        self.conv_q = CausalConv1d(g.conv_kernel, g.key_dim, bias=False, dtype=dtype)
        self.conv_k = CausalConv1d(g.conv_kernel, g.key_dim, bias=False, dtype=dtype)
        self.conv_v = CausalConv1d(g.conv_kernel, g.value_dim, bias=False, dtype=dtype)
        self.dt_bias = _param((g.num_v_heads,), dtype)
        self.A_log = _param((g.num_v_heads,), dtype)
        self.norm = GatedRMSNorm(g.v_dim, eps=cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(g.value_dim, d, bias=False, dtype=dtype)
        self.state_index = state_index
        self.dims = g
        self.act = cfg.hidden_act
        self.state_dtype = jnp.dtype(dtype).name

    def state_arrays(self) -> tuple[StateArray, ...]:
        g, w = self.dims, self.dims.conv_kernel - 1
        return (
            StateArray("conv_q", (w, g.key_dim), self.state_dtype, 1),
            StateArray("conv_k", (w, g.key_dim), self.state_dtype, 1),
            StateArray("conv_v", (w, g.value_dim), self.state_dtype, 1),
            StateArray("ssm", (g.num_v_heads, g.k_dim, g.v_dim), "float32", 0),
        )

    def __call__(self, x, states, rows):
        t, g, f32 = x.shape[0], self.dims, jnp.float32
        init = {name: rows.initial(states[name][self.state_index]) for name in ("conv_q", "conv_k", "conv_v", "ssm")}
        act = activation(self.act)
        q, conv_q = causal_conv(self.in_proj_q(x), *self.conv_q.arrays(), init["conv_q"], rows, act)
        k, conv_k = causal_conv(self.in_proj_k(x), *self.conv_k.arrays(), init["conv_k"], rows, act)
        v, conv_v = causal_conv(self.in_proj_v(x), *self.conv_v.arrays(), init["conv_v"], rows, act)
        q = l2norm(q.reshape(t, -1, g.k_dim).astype(f32)) * g.k_dim**-0.5
        k = l2norm(k.reshape(t, -1, g.k_dim).astype(f32))
        v = v.reshape(t, -1, g.v_dim)
        repeat = v.shape[1] // q.shape[1]  # value heads per key head
        q, k = jnp.repeat(q, repeat, axis=1), jnp.repeat(k, repeat, axis=1)
        beta = jax.nn.sigmoid(self.in_proj_b(x))
        decay = -jnp.exp(self.A_log[...].astype(f32)) * jax.nn.softplus(self.in_proj_a(x).astype(f32) + self.dt_bias[...])
        o, ssm = gated_delta_rule(q, k, v, decay, beta, init["ssm"], rows)
        z = self.in_proj_z(x).reshape(t, -1, g.v_dim)
        o = self.norm(o.astype(x.dtype), z).reshape(t, -1)
        return self.out_proj(o), {"conv_q": conv_q, "conv_k": conv_k, "conv_v": conv_v, "ssm": ssm}


class Qwen3NextDecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        types = cfg.option("layer_types")
        self.kind = "linear" if types[layer] == "linear_attention" else "attention"
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        if self.kind == "linear":
            index = sum(1 for t in types[:layer] if t == "linear_attention")
            self.linear_attn, self.self_attn = GatedDeltaNet(cfg, index, dtype=dtype), None
        else:
            self.linear_attn, self.self_attn = None, GatedAttention(cfg, cfg.kv_layers.index(layer), dtype=dtype, attention=attention)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        moe = cfg.option("moe")
        sparse = moe is not None and layer in MoeOptions.of(cfg).sparse_layers
        self.mlp = SparseMoeBlock(cfg, MoeOptions.of(cfg), dtype=dtype) if sparse else GatedMLP(cfg, dtype=dtype)

    def state_arrays(self):
        return self.linear_attn.state_arrays()

    def __call__(self, x, rope, cache, attn_metadata, rows):
        h = self.input_layernorm(x)
        if self.kind == "linear":
            out, states = self.linear_attn(h, cache.states, rows)
            kv = None
        else:
            (out, kv), states = self.self_attn(h, rope, cache.kv, attn_metadata), None
        x = x + out
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, SparseMoeBlock):  # the bucket's padding rows take no expert
            return x + self.mlp(h, num_valid=attn_metadata.query_start_loc[-1]), kv, states
        return x + self.mlp(h), kv, states


class Qwen3NextForCausalLM(HybridCausalLM):
    SKIPPED_TENSORS = (ROTARY_CACHE, MTP)
    decoder_layer = Qwen3NextDecoderLayer  # (cfg, layer, *, dtype, attention): also the MTP layer's block (spec_decode)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list([self.decoder_layer(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)])
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    def regroup_tensors(self, tensors, missing=None):
        """Experts stacked (models/moe.py), after the renames: a missing expert is then named as the port spells it."""
        renames = [(re.compile(pattern), repl) for pattern, repl in getattr(self, "CHECKPOINT_RENAMES", ())]
        if renames:
            tensors = ((functools.reduce(lambda n, r: r[0].sub(r[1], n), renames, name), a, src) for name, a, src in tensors)
        moe = self.config.option("moe")
        return tensors if moe is None else regroup_expert_tensors(tensors, MoeOptions.of(self.config).num_experts, missing)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hf = text_config(hf_config)
        types = tuple(str(t) for t in hf.layer_types)
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported by the {architecture} port (known: {LAYER_TYPES})")
        params = dict(getattr(hf, "rope_parameters", None) or {})
        partial = float(params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None) or 1.0))
        head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
        gdn = GdnDims(int(hf.linear_num_key_heads), int(hf.linear_num_value_heads), int(hf.linear_key_head_dim),
                      int(hf.linear_value_head_dim), int(hf.linear_conv_kernel_dim))  # fmt: skip
        if gdn.num_v_heads % gdn.num_k_heads:
            raise ValueError(f"linear_num_value_heads={gdn.num_v_heads} must be a multiple of linear_num_key_heads={gdn.num_k_heads}")
        options: dict[str, Any] = {"layer_types": types, "gdn": gdn.as_option()}
        num_experts = int(getattr(hf, "num_experts", 0) or 0)
        if num_experts:
            moe = moe_options_from_hf(
                hf, num_experts=num_experts, intermediate_size=int(hf.moe_intermediate_size),
                renormalize=architecture.startswith("Qwen3_5Moe") or bool(getattr(hf, "norm_topk_prob", True)),
                shared_expert_size=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0),
            )  # fmt: skip
            options["moe"] = moe.as_option()
        kv_layers = tuple(i for i, t in enumerate(types) if t == "full_attention")
        return model_config_from_hf(hf_config, architecture, qk_norm=True, rotary_dim=int(head_dim * partial),
                                    kv_layers=kv_layers, options=options)  # fmt: skip

    @staticmethod
    def lora_projections(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, int]]]:
        """What LoRA adapters may adapt (models/lora.py): the gated attention layers' q/k/v/o (q_proj gives each head's
        query and gate) and the dense MLPs' gate/up/down; not the linear layers, nor the experts."""
        d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        h, kv = cfg.num_heads, cfg.num_kv_heads
        attention = {"q_proj": (d, 2 * h * hd), "k_proj": (d, kv * hd), "v_proj": (d, kv * hd), "o_proj": (h * hd, d)}
        mlp = {"gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
        sparse = MoeOptions.of(cfg).sparse_layers if cfg.option("moe") is not None else ()
        out = {}
        for i in range(cfg.num_layers):
            blocks = ([("self_attn", attention)] if i in cfg.kv_layers else []) + ([("mlp", mlp)] if i not in sparse else [])
            for block, io in blocks:
                out |= {f"layers.{i}.{block}.{t}": (f"model.layers.{i}.{block}.{t}", shape) for t, shape in io.items()}
        return out

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        """Every tensor this port needs, and where it goes; fused projections split (models/hybrid.py)."""
        g, types = GdnDims.of(cfg), cfg.option("layer_types")
        moe = MoeOptions.of(cfg) if cfg.option("moe") is not None else None
        specs = decoder_specs(cfg.tie_word_embeddings)
        for i, hf, ours in layer_prefixes(cfg.num_layers):
            specs |= scale_specs(hf, ours)
            if types[i] == "linear_attention":
                specs |= _linear_attn_specs(cfg, g, f"{hf}.linear_attn", f"{ours}.linear_attn")
            else:  # Llama's, with q/k norms (qk_norm) and o_proj's bias q/k/v's
                specs |= attention_specs(cfg, hf, ours)
            specs |= moe_mlp_specs(moe, i, hf, ours)
        return specs


def _linear_attn_specs(cfg: ModelConfig, g: GdnDims, hf: str, ours: str) -> dict[str, WeightSpec]:
    kernels = lambda *names: tuple(f"{ours}.in_proj_{n}.kernel" for n in names)  # noqa: E731
    if cfg.architecture in FUSED_GDN:  # per key head: q, k, then its value heads' v and z; b and a likewise
        r = g.num_v_heads // g.num_k_heads
        specs = {
            f"{hf}.in_proj_qkvz.weight": WeightSpec(kernels("q", "k", "v", "z"), transpose=True,
                                                    split=GroupedSplit(g.num_k_heads, (g.k_dim, g.k_dim, r * g.v_dim, r * g.v_dim))),
            f"{hf}.in_proj_ba.weight": WeightSpec(kernels("b", "a"), transpose=True, split=GroupedSplit(g.num_k_heads, (r, r))),
        }  # fmt: skip
    else:
        specs = {f"{hf}.in_proj_qkv.weight": WeightSpec(kernels("q", "k", "v"), transpose=True,
                                                        split=ConcatSplit((g.key_dim, g.key_dim, g.value_dim)))}  # fmt: skip
        for n in ("z", "b", "a"):
            specs |= linear_specs(f"{hf}.in_proj_{n}", f"{ours}.in_proj_{n}", bias=False)
    convs = tuple(f"{ours}.conv_{n}.weight" for n in ("q", "k", "v"))
    specs[f"{hf}.conv1d.weight"] = WeightSpec(convs, transpose=True, split=ConcatSplit((g.key_dim, g.key_dim, g.value_dim)))
    specs[f"{hf}.dt_bias"] = WeightSpec(f"{ours}.dt_bias")
    specs[f"{hf}.A_log"] = WeightSpec(f"{ours}.A_log")
    specs[f"{hf}.norm.weight"] = WeightSpec(f"{ours}.norm.scale")
    specs |= linear_specs(f"{hf}.out_proj", f"{ours}.out_proj", bias=False)
    return specs



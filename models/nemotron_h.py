"""Nemotron-H (Mamba-2 hybrid): a stack of single-mixer blocks, each `x + mixer(RMSNorm(x))`, the mixer a Mamba-2
layer, full attention (no positional encoding: the Mamba layers carry order) or a squared-ReLU MLP, per
`layers_block_type` (the older `hybrid_override_pattern` is read by transformers' config).

The Mamba-2 mixer: in_proj gives the gate z, the SSM input x, B, C and dt; x, B and C pass a depthwise causal
convolution (silu); the SSD scan (pallas_kernels/ssd.py) with dt = softplus(dt + dt_bias) (at least time_step_min, as
transformers' chunked path clamps it) and A = -exp(A_log), plus D x; a grouped RMSNorm of y * silu(z); out_proj.
in_proj and the convolution are split at load into z, x, B, C, dt (x, B, C for the convolution), so tensor
parallelism can split heads and groups. Its state per sequence: the convolution's last K - 1 inputs and a
[head_dim, state_size] matrix per head, in `mamba_ssm_cache_dtype`.

Checkpoints say `backbone.*` (transformers holds `model.*`; both load). transformers never ties its head
(`_tied_weights_keys` is empty), whatever `tie_word_embeddings` says; neither does the port. Nemotron-H's MoE blocks (Nemotron 3 Nano's
sigmoid-routed, grouped top-k experts) are not ported: such a config is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.config import ModelConfig, model_config_from_hf, text_config
from jaxpaged.models.hybrid import CausalConv1d, ConcatSplit, GatedRMSNorm, HybridCausalLM
from jaxpaged.models.layers import MLP, REFERENCE_ATTENTION, Attention, Embedding, Linear, _param, activation, module_list
from jaxpaged.models.weights import (
    WeightSpec, decoder_specs, layer_prefixes, linear_specs, projection_specs, scale_specs,
)  # fmt: skip
from jaxpaged.pallas_kernels import AttentionBackend
from jaxpaged.pallas_kernels.ssd import ssd_scan
from jaxpaged.pallas_kernels.state_cache import StateArray, causal_conv

BLOCK_TYPES = ("linear_attention", "full_attention", "mlp")


@dataclasses.dataclass(frozen=True)
class MambaDims:
    """A Mamba-2 mixer's sizes and knobs (ModelConfig option "mamba")."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    time_step_min: float
    act: str
    state_dtype: str

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def bc(self) -> int:
        return self.n_groups * self.state_size

    @staticmethod
    def of(cfg: ModelConfig) -> MambaDims:
        return MambaDims(**dict(cfg.option("mamba")))

    def as_option(self) -> tuple[tuple[str, Any], ...]:
        return tuple(sorted(dataclasses.asdict(self).items()))


class RMSNormF32(nnx.Module):
    """Nemotron-H's RMSNorm: the weight multiplies in float32, the result is cast back."""

    def __init__(self, features: int, *, eps: float, dtype):
        self.scale = _param((features,), dtype)
        self.eps = eps

    def __call__(self, x):
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return (self.scale[...].astype(jnp.float32) * h).astype(x.dtype)


class Mamba2Mixer(nnx.Module):
    kind = "linear"

    def __init__(self, cfg: ModelConfig, state_index: int, *, dtype):
        m = MambaDims.of(cfg)
        d = cfg.hidden_size
        self.in_proj_z = Linear(d, m.inner, bias=m.proj_bias, dtype=dtype)
        self.in_proj_x = Linear(d, m.inner, bias=m.proj_bias, dtype=dtype)
        self.in_proj_B = Linear(d, m.bc, bias=m.proj_bias, dtype=dtype)
        self.in_proj_C = Linear(d, m.bc, bias=m.proj_bias, dtype=dtype)
        self.in_proj_dt = Linear(d, m.num_heads, bias=m.proj_bias, dtype=dtype)
        self.conv_x = CausalConv1d(m.conv_kernel, m.inner, bias=m.conv_bias, dtype=dtype)
        self.conv_B = CausalConv1d(m.conv_kernel, m.bc, bias=m.conv_bias, dtype=dtype)
        self.conv_C = CausalConv1d(m.conv_kernel, m.bc, bias=m.conv_bias, dtype=dtype)
        self.dt_bias = _param((m.num_heads,), dtype)
        self.A_log = _param((m.num_heads,), dtype)
        self.D = _param((m.num_heads,), dtype)
        self.norm = GatedRMSNorm(m.inner, eps=cfg.layer_norm_eps, dtype=dtype, norm_before_gate=False, group_size=m.inner // m.n_groups)
        self.out_proj = Linear(m.inner, d, bias=m.proj_bias, dtype=dtype)
        self.state_index = state_index
        self.dims = m
        self.conv_dtype = jnp.dtype(dtype).name

    def state_arrays(self) -> tuple[StateArray, ...]:
        m, w = self.dims, self.dims.conv_kernel - 1
        return (
            StateArray("conv_x", (w, m.inner), self.conv_dtype, 1),
            StateArray("conv_B", (w, m.bc), self.conv_dtype),  # (B and C stay whole under tensor parallelism)
            StateArray("conv_C", (w, m.bc), self.conv_dtype),
            StateArray("ssm", (m.num_heads, m.head_dim, m.state_size), m.state_dtype, 0),
        )

    def __call__(self, x, states, rows):
        t, m, f32 = x.shape[0], self.dims, jnp.float32
        init = {name: rows.initial(states[name][self.state_index]) for name in ("conv_x", "conv_B", "conv_C", "ssm")}
        act = activation(m.act)
        xs, conv_x = causal_conv(self.in_proj_x(x), *self.conv_x.arrays(), init["conv_x"], rows, act)
        b, conv_b = causal_conv(self.in_proj_B(x), *self.conv_B.arrays(), init["conv_B"], rows, act)
        c, conv_c = causal_conv(self.in_proj_C(x), *self.conv_C.arrays(), init["conv_C"], rows, act)
        xs = xs.reshape(t, -1, m.head_dim).astype(f32)
        heads = xs.shape[1]
        b, c = (jnp.repeat(v.reshape(t, -1, m.state_size), heads // (v.shape[-1] // m.state_size), axis=1) for v in (b, c))
        dt = jax.nn.softplus(self.in_proj_dt(x).astype(f32) + self.dt_bias[...].astype(f32))
        dt = jnp.maximum(dt, m.time_step_min)
        a = -jnp.exp(self.A_log[...].astype(f32))
        y, ssm = ssd_scan(xs, dt, b, c, a, init["ssm"], rows)
        y = (y + self.D[...].astype(f32)[:, None] * xs).reshape(t, -1)
        y = self.norm(y, self.in_proj_z(x))
        return self.out_proj(y.astype(x.dtype)), {"conv_x": conv_x, "conv_B": conv_b, "conv_C": conv_c, "ssm": ssm}


class NemotronHBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        types = cfg.option("block_types")
        block = types[layer]
        self.kind = {"linear_attention": "linear", "full_attention": "attention"}.get(block, "mlp")
        self.norm = RMSNormF32(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        if block == "linear_attention":
            self.mixer = Mamba2Mixer(cfg, types[:layer].count("linear_attention"), dtype=dtype)
        elif block == "full_attention":
            self.mixer = Attention(cfg, cfg.kv_layers.index(layer), dtype=dtype, attention=attention)
        else:
            self.mixer = MLP(cfg, dtype=dtype)

    def state_arrays(self):
        return self.mixer.state_arrays()

    def __call__(self, x, rope, cache, attn_metadata, rows):
        h = self.norm(x)
        if self.kind == "linear":
            out, states = self.mixer(h, cache.states, rows)
            return x + out, None, states
        if self.kind == "attention":
            out, kv = self.mixer(h, None, cache.kv, attn_metadata)
            return x + out, kv, None
        return x + self.mixer(h), None, None


class NemotronHForCausalLM(HybridCausalLM):
    CHECKPOINT_RENAMES = ((r"^backbone\.", "model."),)  # released checkpoints (and save_pretrained) say backbone.
    SKIPPED_TENSORS = ((r"^mtp\.", "the multi-token-prediction layers (a draft head for speculative decoding): not run"),)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list([NemotronHBlock(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)])
        self.norm = RMSNormF32(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hf = text_config(hf_config)
        types = tuple(str(t) for t in hf.layers_block_type)
        if "moe" in types:
            raise ValueError(f"{architecture}: MoE blocks (layers_block_type 'moe', Nemotron 3 Nano) are not supported; "
                             "Nemotron-H configs of Mamba-2, attention and MLP blocks are")  # fmt: skip
        unknown = sorted(set(types) - set(BLOCK_TYPES))
        if unknown:
            raise ValueError(f"layers_block_type {unknown} are not supported by the {architecture} port (known: {BLOCK_TYPES})")
        mamba = MambaDims(
            int(hf.mamba_num_heads), int(hf.mamba_head_dim), int(hf.ssm_state_size), int(hf.n_groups), int(hf.conv_kernel),
            bool(hf.use_conv_bias), bool(getattr(hf, "use_bias", False)), float(getattr(hf, "time_step_min", 0.0) or 0.0),
            str(getattr(hf, "mamba_hidden_act", "silu")), str(getattr(hf, "mamba_ssm_cache_dtype", None) or "float32"),
        )  # fmt: skip
        if mamba.num_heads % mamba.n_groups:
            raise ValueError(f"mamba_num_heads={mamba.num_heads} must be a multiple of n_groups={mamba.n_groups}")
        eps = float(getattr(hf, "layer_norm_epsilon", 1e-5))
        return model_config_from_hf(
            hf_config, architecture, num_layers=len(types), hidden_act=str(hf.mlp_hidden_act), rms_norm_eps=eps,
            tie_word_embeddings=False,
            layer_norm_eps=eps, position_embedding="none", mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            attention_bias=False, kv_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"),
            options={"block_types": types, "mamba": mamba.as_option()},
        )  # fmt: skip

    @staticmethod
    def lora_projections(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, int]]]:
        """What LoRA adapters may adapt (models/lora.py): the attention blocks' q/k/v/o and the MLP blocks' up/down;
        not the Mamba mixers."""
        d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        io = {"q_proj": (d, cfg.num_heads * hd), "k_proj": (d, cfg.num_kv_heads * hd), "v_proj": (d, cfg.num_kv_heads * hd),
              "o_proj": (cfg.num_heads * hd, d), "up_proj": (d, f), "down_proj": (f, d)}  # fmt: skip
        kinds = {"full_attention": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("up_proj", "down_proj")}
        return {f"layers.{i}.mixer.{t}": (f"model.layers.{i}.mixer.{t}", io[t])
                for i, block in enumerate(cfg.option("block_types")) for t in kinds.get(block, ())}  # fmt: skip

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        m, types = MambaDims.of(cfg), cfg.option("block_types")
        specs = decoder_specs(cfg.tie_word_embeddings, embed="model.embeddings.weight", norm="model.norm_f.weight")
        for i, hf, ours in layer_prefixes(len(types)):
            block = types[i]
            specs |= scale_specs(hf, ours, ("norm",))
            mix, our_mix = f"{hf}.mixer", f"{ours}.mixer"
            if block == "full_attention":
                specs |= projection_specs(mix, our_mix, ("q_proj", "k_proj", "v_proj", "o_proj"), bias=False)
            elif block == "mlp":
                specs |= projection_specs(mix, our_mix, ("up_proj", "down_proj"), bias=cfg.mlp_bias)
            else:
                specs |= _mamba_specs(m, mix, our_mix)
        return specs


def _mamba_specs(m: MambaDims, hf: str, ours: str) -> dict[str, WeightSpec]:
    proj = ("z", "x", "B", "C", "dt")
    split = ConcatSplit((m.inner, m.inner, m.bc, m.bc, m.num_heads))
    specs = {f"{hf}.in_proj.weight": WeightSpec(tuple(f"{ours}.in_proj_{p}.kernel" for p in proj), transpose=True, split=split)}
    if m.proj_bias:
        specs[f"{hf}.in_proj.bias"] = WeightSpec(tuple(f"{ours}.in_proj_{p}.bias" for p in proj), split=split)
    conv = ConcatSplit((m.inner, m.bc, m.bc))
    specs[f"{hf}.conv1d.weight"] = WeightSpec(tuple(f"{ours}.conv_{p}.weight" for p in ("x", "B", "C")), transpose=True, split=conv)
    if m.conv_bias:
        specs[f"{hf}.conv1d.bias"] = WeightSpec(tuple(f"{ours}.conv_{p}.bias" for p in ("x", "B", "C")), split=conv)
    for name in ("dt_bias", "A_log", "D"):
        specs[f"{hf}.{name}"] = WeightSpec(f"{ours}.{name}")
    specs[f"{hf}.norm.weight"] = WeightSpec(f"{ours}.norm.scale")
    specs |= linear_specs(f"{hf}.out_proj", f"{ours}.out_proj", bias=m.proj_bias)
    return specs

"""Layers the model families share. Weights are created abstract and filled by the loader.

Ports name their parameters the same way whatever the checkpoint calls them (`embed_tokens`,
`layers.N.self_attn.{q,k,v,o}_proj`, `layers.N.mlp.{gate,up,down}_proj`, `norm`, `lm_head`):
`weight_specs` maps HF names onto these, and tensor parallelism (models/sharding.py) derives
every parameter's sharding from them alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxpaged.models.config import LENGTH_DEPENDENT_ROPE_TYPES, ModelConfig, RopeConfig
from jaxpaged.pallas_kernels import (
    AttentionBackend, AttentionMetadata, AttentionSpec, ReferenceAttention, paged_attention, stack_new_kv, write_kv,
)  # fmt: skip

REFERENCE_ATTENTION = ReferenceAttention()  # a port's default: the definition, on any device

# Flax >= 0.12 wants module lists wrapped so their arrays count as state.
module_list = getattr(nnx, "List", list)


def _param(shape, dtype) -> nnx.Param:
    """A parameter's shape and dtype only: the loader fills every one (no zeros made, no trace needed)."""
    return nnx.Param(jax.ShapeDtypeStruct(shape, dtype))


def _precision(x):
    return jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None


@dataclasses.dataclass(frozen=True)
class DenseLinear:
    """How a Linear meets its weight: x @ kernel [in, out], accumulated in float32 and rounded once, as torch does
    (asked for a 16-bit result directly, XLA:CPU converts the whole weight on every call). A platform or a quantized
    format swaps in its own method, with the weight in its own layout (platforms/cpu/matmul.py: PackedLinear)."""

    def apply(self, layer: Linear, x: jax.Array) -> jax.Array:
        return jnp.dot(x, layer.kernel[...], precision=_precision(x), preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class DenseEmbedding:
    """How an Embedding reads its [num_embeddings, features] table: row lookups, and a tied head's logits."""

    def lookup(self, layer: Embedding, ids: jax.Array) -> jax.Array:
        return jnp.take(layer.embedding[...], ids, axis=0)

    def attend(self, layer: Embedding, x: jax.Array) -> jax.Array:
        return jnp.dot(x, layer.embedding[...].T, precision=_precision(x), preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Fusible:
    """How a model computes values every layer reads (RoPE's table): left to XLA's fusion, so each consumer may
    recompute them, which is cheap on accelerators. A platform may swap in its own (platforms/cpu: ComputedOnce)."""

    def __call__(self, compute: Callable[[], Any], operand: jax.Array) -> Any:
        return compute()


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel is [in, out], the transpose of torch's weight, as `method` stores it."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype):
        self.kernel = _param((in_features, out_features), dtype)
        self.bias = _param((out_features,), dtype) if bias else None
        self.out_features = out_features
        self.method = DenseLinear()

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.method.apply(self, x).astype(x.dtype)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embedding(nnx.Module):
    """A [num_embeddings, features] table, as `method` stores it."""

    def __init__(self, num_embeddings: int, features: int, *, dtype):
        self.embedding = _param((num_embeddings, features), dtype)
        self.num_embeddings = num_embeddings
        self.method = DenseEmbedding()

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.method.lookup(self, ids)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied output projection: logits against the embedding table, in float32."""
        return self.method.attend(self, x)


class RMSNorm(nnx.Module):
    def __init__(self, features: int, *, eps: float, dtype):
        self.scale = _param((features,), dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * h.astype(x.dtype)


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm, statistics in float32; `bias=False` for MPT, `affine=False` for some OPTs."""

    def __init__(self, features: int, *, eps: float, dtype, bias: bool = True, affine: bool = True):
        self.scale = _param((features,), dtype) if affine else None
        self.bias = _param((features,), dtype) if affine and bias else None
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        mean = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
        h = ((h - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        if self.scale is not None:
            h = h * self.scale[...]
        if self.bias is not None:
            h = h + self.bias[...]
        return h


def rope_inv_freq(rope: RopeConfig, rotary_dim: int) -> np.ndarray:
    """Inverse frequencies as transformers computes them when it builds the model (dynamic: the unscaled base;
    longrope: the short factors); rope_table switches the length-dependent ones per token."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    elif rope.rope_type == "dynamic":
        max_pos, factor = rope.max_position_embeddings, rope.factor
        base = rope.theta * ((factor * max_pos / max_pos) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        inv_freq = 1.0 / (base**exponents)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(rope, rotary_dim, exponents)
    elif rope.rope_type == "longrope":
        inv_freq = _longrope_inv_freq(rope, rope.short_factor, exponents)
    return inv_freq.astype(np.float32)


def _longrope_inv_freq(rope: RopeConfig, factors: tuple[float, ...], exponents: np.ndarray) -> np.ndarray:
    if len(factors) != len(exponents):
        raise ValueError(
            f"rope_scaling longrope factors have {len(factors)} entries; the rotary dims need {len(exponents)}"
        )
    return 1.0 / (np.asarray(factors, np.float32) * rope.theta**exponents)


def _yarn_inv_freq(rope: RopeConfig, dim: int, exponents: np.ndarray) -> np.ndarray:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp between beta_fast and beta_slow."""
    base, original = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = base**exponents
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(rope: RopeConfig) -> float:
    """What transformers multiplies into cos and sin (its `attention_scaling`): YaRN's mscale, LongRoPE's factor."""
    if rope.rope_type not in ("yarn", "longrope"):
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    factor = rope.factor
    if rope.rope_type == "longrope":
        original = rope.original_max_position_embeddings
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
    return mscale(factor)


def token_rope_lens(attn_metadata: AttentionMetadata, positions: jax.Array) -> jax.Array:
    """[T] the sequence length each token's dynamic/longrope frequencies are decided from: max(its position + 1, its
    row's rope_lens), the scheduler's per-sequence rule (jaxpaged/core/rope_regime.py); without rope_lens, its row's
    length after the step (its largest position + 1), as transformers' forward of that one row would."""
    qsl = attn_metadata.query_start_loc
    slot = jnp.searchsorted(qsl, jnp.arange(positions.shape[0], dtype=qsl.dtype), side="right") - 1
    slot = jnp.clip(slot, 0, attn_metadata.seq_lens.shape[0] - 1)
    if attn_metadata.rope_lens is None:
        return attn_metadata.seq_lens[slot]
    return jnp.maximum(attn_metadata.rope_lens[slot], positions.astype(jnp.int32) + 1)


def length_scaled_inv_freq(rope: RopeConfig, rotary_dim: int, seq_lens: jax.Array) -> jax.Array:
    """[T, rotary_dim / 2] per-token inverse frequencies of the length-dependent types, for seq_lens [T]: both
    choices are computed and selected with where, so the step's shapes (and its compiled program) never change.

    longrope: the long factors when the sequence is longer than original_max_position_embeddings, else the short.
    dynamic (NTK): past max_position_embeddings the base grows with the length, in float32 as transformers does."""
    seq_lens = seq_lens.astype(jnp.int32)[:, None]
    default = jnp.asarray(rope_inv_freq(rope, rotary_dim))[None, :]
    exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / rotary_dim
    if rope.rope_type == "longrope":
        long = jnp.asarray(_longrope_inv_freq(rope, rope.long_factor, exponents).astype(np.float32))[None, :]
        return jnp.where(seq_lens > rope.original_max_position_embeddings, long, default)
    if rope.rope_type == "dynamic":
        max_pos, factor = rope.max_position_embeddings, rope.factor
        length = jnp.maximum(seq_lens, max_pos).astype(jnp.float32)
        base = rope.theta * ((factor * length / max_pos) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        grown = 1.0 / (base ** jnp.asarray(exponents)[None, :])
        return jnp.where(seq_lens > max_pos, grown, default)
    return jnp.broadcast_to(default, (seq_lens.shape[0], default.shape[1]))


def rotary_table(positions: jax.Array, inv_freq, *, interleaved: bool = False) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [T, 2 * R] at positions [T], laid out for `apply_rope`; inv_freq is [R], or [T, R] per token.
    Computed once per forward and shared by every layer, as transformers does."""
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    freqs = positions.astype(jnp.float32)[:, None] * (inv_freq if inv_freq.ndim == 2 else inv_freq[None, :])
    emb = jnp.repeat(freqs, 2, axis=-1) if interleaved else jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rope_table(
    rope: RopeConfig, positions: jax.Array, rotary_dim: int, attn_metadata: AttentionMetadata | None = None, *,
    interleaved: bool = False,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """(cos, sin) as transformers' rotary embedding gives them for any supported rope_type: its frequencies (per
    token for dynamic/longrope, from token_rope_lens), times its attention factor."""
    if rope.rope_type in LENGTH_DEPENDENT_ROPE_TYPES and attn_metadata is not None:
        inv_freq = length_scaled_inv_freq(rope, rotary_dim, token_rope_lens(attn_metadata, positions))
    else:
        inv_freq = rope_inv_freq(rope, rotary_dim)
    cos, sin = rotary_table(positions, inv_freq, interleaved=interleaved)
    scale = rope_attention_factor(rope)
    return (cos, sin) if scale == 1.0 else (cos * scale, sin * scale)


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array], *, interleaved: bool = False) -> jax.Array:
    """RoPE on the first rot features of x [T, H, D] (the rest pass through), with rotary_table's (cos, sin) [T, rot].

    Rotate-half pairs feature i with i + rot/2 (Llama, NeoX, Falcon); interleaved pairs 2i with 2i + 1 (GPT-J).
    """
    cos, sin = (r[:, None, :].astype(x.dtype) for r in rope)
    rot = cos.shape[-1]
    xr, rest = x[..., :rot], x[..., rot:]
    if interleaved:
        pairs = xr.reshape(*xr.shape[:-1], rot // 2, 2)
        rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(xr.shape)
    else:
        rotated = jnp.concatenate([-xr[..., rot // 2 :], xr[..., : rot // 2]], axis=-1)
    out = xr * cos + rotated * sin
    return out if rest.shape[-1] == 0 else jnp.concatenate([out, rest], axis=-1)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's slopes as BLOOM and Falcon compute them (geometric, interleaved past a power of two)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = np.float32(2 ** (-(2 ** -(math.log2(closest) - 3))))
    slopes = base ** np.arange(1, 1 + closest, dtype=np.float32)
    if closest != num_heads:
        extra = np.float32(2 ** (-(2 ** -(math.log2(2 * closest) - 3))))
        remaining = min(closest, num_heads - closest)
        slopes = np.concatenate([slopes, extra ** np.arange(1, 1 + 2 * remaining, 2, dtype=np.float32)])
    return slopes.astype(np.float32)


def bloom_gelu(x):
    """BLOOM's tanh GELU with its own rounded constant (0.79788456, not sqrt(2/pi))."""
    return x * 0.5 * (1.0 + jnp.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: 0.5 * x * (1.0 + jnp.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "bloom_gelu": bloom_gelu,
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),  # Nemotron-H's MLP
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


def _merge_units(a: jax.Array) -> jax.Array:
    return a.reshape(*a.shape[:-2], a.shape[-2] * a.shape[-1])


def split_qkv(y: jax.Array, layout: tuple[int, int, int]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A fused q/k/v output [..., units * (q + 2k)] -> q, k, v: each unit (a tensor-parallel device's share) holds
    its q heads' columns, then its k heads', then its v heads'."""
    units, q, k = layout
    y = y.reshape(*y.shape[:-1], units, q + 2 * k)
    return _merge_units(y[..., :q]), _merge_units(y[..., q : q + k]), _merge_units(y[..., q + k :])


def split_gate_up(y: jax.Array, units: int) -> tuple[jax.Array, jax.Array]:
    """A fused gate/up output [..., units * 2 * f / units] -> gate, up: each unit holds its gate columns, then its up."""
    y = y.reshape(*y.shape[:-1], units, 2, y.shape[-1] // (2 * units))
    return _merge_units(y[..., 0, :]), _merge_units(y[..., 1, :])


class Attention(nnx.Module):
    """q/k/v projections, optional q/k RMSNorm, RoPE (full, partial or interleaved) or ALiBi, paged attention, o_proj.

    The KV-head count is read from k_proj's width at run time, not stored, so tensor parallelism can
    widen k/v (replicating KV heads across devices) without rebuilding the module.
    """

    # fuse_projections (models/fused_projections.py): q/k/v as one Linear, q/k/v_proj then None, and its columns'
    # layout, (units, q columns, k columns) per unit; class attributes, so an unfused module's graph is unchanged
    qkv_proj = None
    qkv_layout: tuple[int, int, int] | None = None

    def __init__(
        self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend, scale: float | None = None,
        alibi: np.ndarray | None = None, clip_qkv: float | None = None,
    ):  # fmt: skip
        d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(d, h * hd, bias=cfg.attention_bias, dtype=dtype)
        self.k_proj = Linear(d, kv * hd, bias=cfg.attention_bias, dtype=dtype)
        self.v_proj = Linear(d, kv * hd, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = Linear(h * hd, d, bias=cfg.out_bias, dtype=dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.layer = layer
        self.shape = (h, hd)
        self.spec = AttentionSpec(hd**-0.5 if scale is None else scale, cfg.window(layer))
        self.clip_qkv = clip_qkv
        self.backend = attention
        self.interleaved = cfg.rope_interleaved
        self.alibi = None if alibi is None else tuple(float(s) for s in alibi)
        self.sinks = None  # GPT-OSS: a learned [H] parameter, each head's sink logit (models/gpt_oss.py)

    def __call__(self, x, rope, kv_cache, attn_metadata: AttentionMetadata):
        """rope: rotary_table's (cos, sin) for this step's positions, None for models without RoPE."""
        (h, hd), t = self.shape, x.shape[0]
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = split_qkv(self.qkv_proj(x), self.qkv_layout)
        if self.clip_qkv is not None:
            q, k, v = (jnp.clip(a, -self.clip_qkv, self.clip_qkv) for a in (q, k, v))
        q, k, v = q.reshape(t, h, hd), k.reshape(t, -1, hd), v.reshape(t, -1, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q, k, rope)
        slopes = None if self.alibi is None else jnp.asarray(self.alibi, jnp.float32)
        sinks = None if self.sinks is None else self.sinks[...]
        out = paged_attention(q, k, v, kv_cache, self.layer, attn_metadata, self.spec, slopes, sinks, backend=self.backend)
        return self.o_proj(out.reshape(t, h * hd)), (k, v)


    def rotate(self, q, k, rope):
        """RoPE on q and k [T, H, D]; a port that scales or norms them around it (Ministral 3, Llama 4) overrides this,
        its run_layers passing what it needs as `rope`."""
        if rope is None:
            return q, k
        return apply_rope(q, rope, interleaved=self.interleaved), apply_rope(k, rope, interleaved=self.interleaved)


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)): Llama, Mistral, Qwen."""

    # fuse_projections: gate and up as one Linear over `gate_up_units` column groups (models/fused_projections.py)
    gate_up_proj = None
    gate_up_units = 1

    def __init__(self, cfg: ModelConfig, *, dtype):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, f, bias=cfg.mlp_bias, dtype=dtype)
        self.up_proj = Linear(d, f, bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = Linear(f, d, bias=cfg.mlp_bias, dtype=dtype)
        self.act = cfg.hidden_act

    def __call__(self, x):
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = split_gate_up(self.gate_up_proj(x), self.gate_up_units)
        return self.down_proj(activation(self.act)(gate) * up)


class MLP(nnx.Module):
    """down(act(up(x))): GPT-2, GPT-J, NeoX, OPT, Falcon, BLOOM, MPT."""

    def __init__(self, cfg: ModelConfig, *, dtype):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.up_proj = Linear(d, f, bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = Linear(f, d, bias=cfg.mlp_bias, dtype=dtype)
        self.act = cfg.hidden_act

    def __call__(self, x):
        return self.down_proj(activation(self.act)(self.up_proj(x)))


class CausalLM(nnx.Module):
    """What every port shares: embed -> decoder layers -> final norm, the KV plumbing, and the LM head.

    `shared` computes the values every layer reads (Fusible unless a platform chose otherwise).
    A port sets `config`, `embed_tokens`, `layers`, `norm` (or overrides `final`), `lm_head` (None when tied,
    then `lm_head_bias` may hold a separate bias), and overrides `embed` when positions enter there.
    """

    shared = Fusible()
    # (pattern, reason): checkpoint tensors the port knowingly does not load, logged once (models/accounting.py)
    SKIPPED_TENSORS: tuple[tuple[str, str], ...] = ()

    def init_head(self, cfg: ModelConfig, features: int, dtype) -> None:
        tied, bias = cfg.tie_word_embeddings, cfg.lm_head_bias
        self.lm_head = None if tied else Linear(features, cfg.vocab_size, bias=bias, dtype=dtype)
        self.lm_head_bias = _param((cfg.vocab_size,), dtype) if tied and bias else None

    def embed(self, input_ids, positions):
        return self.embed_tokens(input_ids)

    @classmethod
    def takes_prompt_embeds(cls) -> bool:
        """Whether a prompt may be given as embeddings (enable_prompt_embeds): a port whose input is the token
        embedding alone (CausalLM's embed and forward), where a given vector stands where transformers' inputs_embeds
        does. Ports that scale, norm or add positions to it, or read the ids again (Gemma, GPT-2, OPT, BLOOM,
        Gemma 4, the vision-language ports), override one of them and are refused."""
        return cls.embed is CausalLM.embed and cls.forward is CausalLM.forward

    def final(self, x):
        return self.norm(x)

    def forward(self, input_ids, positions, kv_cache, attn_metadata: AttentionMetadata, prompt_embeds=None):
        """input_ids, positions: [T] -> (final hidden states [T, D], this step's K/V [T, L, 2, H_kv, D]).

        Reads the cache only; the runner writes the new K/V with write_kv in a second jitted call
        that donates the cache (see pallas_kernels/attention.py for why). prompt_embeds: (mask [T], rows [T, D]),
        a step's given embeddings replacing the table's where mask is set (enable_prompt_embeds).
        """
        x = self.embed(input_ids, positions)
        if prompt_embeds is not None:
            mask, rows = prompt_embeds
            x = jnp.where(mask[:, None], rows.astype(x.dtype), x)
        x, new_kv = self.run_layers(x, positions, kv_cache, attn_metadata, self.layers)
        return self.final(x), new_kv

    def forward_with_aux(self, input_ids, positions, kv_cache, attn_metadata: AttentionMetadata, aux_layers):
        """forward, and the residual stream entering each layer of `aux_layers` (0: the embedding) concatenated
        [T, len * D]: an EAGLE-3 head's input (spec_decode/eagle3.py). The layers run in the segments between them,
        through run_layers as forward runs them."""
        x = self.embed(input_ids, positions)
        kept, new_kv, start = {}, [], 0
        for end in sorted(set(aux_layers)) + [len(self.layers)]:
            if end > start:
                x, kv = self.run_layers(x, positions, kv_cache, attn_metadata, self.layers[start:end])
                new_kv.append(kv)
            kept[end], start = x, end
        aux = jnp.concatenate([kept[i] for i in aux_layers], axis=-1)
        return self.final(x), jnp.concatenate(new_kv, axis=1), aux

    def run_layers(self, x, positions, kv_cache, attn_metadata: AttentionMetadata, layers):
        """x [T, D] through `layers` (all of them, or a pipeline stage's) -> (x, their new K/V [T, len(layers), 2, H_kv, D])."""
        cfg = self.config
        rope = None
        if cfg.position_embedding == "rope":
            dim, interleaved = cfg.rotary_dim or cfg.head_dim, cfg.rope_interleaved
            table = lambda: rope_table(cfg.rope, positions, dim, attn_metadata, interleaved=interleaved)  # noqa: E731
            rope = self.shared(table, positions)
        new_kv = []
        for layer in layers:
            x, layer_kv = layer(x, rope, kv_cache, attn_metadata)
            new_kv.append(layer_kv)
        return x, stack_new_kv(new_kv)

    def __call__(self, input_ids, positions, kv_cache, attn_metadata: AttentionMetadata):
        """-> (hidden [T, D], updated kv_cache): forward and write in one call."""
        hidden, new_kv = self.forward(input_ids, positions, kv_cache, attn_metadata)
        return hidden, write_kv(kv_cache, new_kv, attn_metadata.slot_mapping, attn_metadata.layer_groups)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        if self.lm_head is not None:
            return self.lm_head(hidden).astype(jnp.float32)
        logits = self.embed_tokens.attend(hidden)
        if self.lm_head_bias is not None:
            logits = logits + self.lm_head_bias[...].astype(jnp.float32)
        return logits

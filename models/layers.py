"""Layers the model families share. Weights are created abstract and filled by the loader."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import RopeConfig


def _param(shape, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel is [in, out], the transpose of torch's weight."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype):
        self.kernel = _param((in_features, out_features), dtype)
        self.bias = _param((out_features,), dtype) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
        y = jnp.dot(x, self.kernel[...], precision=precision)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embedding(nnx.Module):
    def __init__(self, num_embeddings: int, features: int, *, dtype):
        self.embedding = _param((num_embeddings, features), dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied output projection: logits against the embedding table, in float32."""
        precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
        return jnp.dot(x, self.embedding[...].T, precision=precision, preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    def __init__(self, features: int, *, eps: float, dtype):
        self.scale = _param((features,), dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * h.astype(x.dtype)


def rope_inv_freq(rope: RopeConfig, rotary_dim: int) -> np.ndarray:
    """Inverse frequencies as transformers computes them for each supported rope_type."""
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / rotary_dim))
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
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE (the HF layout) on x [T, H, D] at integer positions [T]."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = jnp.cos(emb)[:, None, :].astype(x.dtype)
    sin = jnp.sin(emb)[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}

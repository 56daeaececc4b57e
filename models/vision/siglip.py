"""SigLIP's (and CLIP's) vision transformer, as transformers 5.24's SiglipVisionModel computes it: a patch
convolution plus learned position embeddings, pre-norm encoder layers (LayerNorm, bidirectional attention with
biased projections, LayerNorm, fc1 -> activation -> fc2), a final LayerNorm. CLIP adds a class token and a LayerNorm
before the layers (`pre_layernorm`) and is read at a chosen layer (LLaVA), so both come as options.

Parameters keep the checkpoint's names under the tower (`embeddings.patch_embedding`, `encoder.layers.N.self_attn.
q_proj`, ...); the patch convolution's weight stays [out, C, p, p] as stored.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.layers import Embedding, LayerNorm, Linear, _param, activation, module_list
from jaxpaged.models.vision.common import dense_attention
from jaxpaged.models.weights import WeightSpec, linear_specs, norm_specs


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    class_token: bool = False  # CLIP: a class embedding before the patches
    pre_layernorm: bool = False  # CLIP: a LayerNorm before the layers
    post_layernorm: bool = True  # SigLIP: after the layers (CLIP's applies to the pooled output only: not read here)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @staticmethod
    def from_hf(vision, *, clip: bool = False) -> ViTConfig:
        return ViTConfig(
            hidden_size=int(vision.hidden_size), intermediate_size=int(vision.intermediate_size),
            num_layers=int(vision.num_hidden_layers), num_heads=int(vision.num_attention_heads),
            image_size=int(vision.image_size), patch_size=int(vision.patch_size),
            num_channels=int(getattr(vision, "num_channels", 3)), layer_norm_eps=float(vision.layer_norm_eps),
            hidden_act=str(vision.hidden_act), class_token=clip, pre_layernorm=clip, post_layernorm=not clip,
        )  # fmt: skip


def patchify(pixels: jax.Array, patch: int) -> jax.Array:
    """[B, C, H, W] -> [B, (H/p) * (W/p), C * p * p], patches row-major, each flattened as (C, p, p): a stride-p
    convolution's input, in the order it reads its weight."""
    b, c, h, w = pixels.shape
    x = pixels.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


class PatchEmbedding(nnx.Module):
    """A Conv2d whose kernel equals its stride, as a matmul over flattened patches; weight [out, C, p, p] as stored."""

    def __init__(self, channels: int, features: int, patch: int, *, bias: bool, dtype):
        self.weight = _param((features, channels, patch, patch), dtype)
        self.bias = _param((features,), dtype) if bias else None
        self.patch = patch

    def __call__(self, pixels: jax.Array) -> jax.Array:
        return self.embed_patches(patchify(pixels.astype(self.weight.dtype), self.patch))

    def embed_patches(self, patches: jax.Array) -> jax.Array:
        """[..., C * p * p] patches flattened as patchify lays them out (a host that cut them already) -> [..., out]."""
        patches = patches.astype(self.weight.dtype)
        w = self.weight[...].reshape(self.weight.shape[0], -1)
        prec = jax.lax.Precision.HIGHEST if patches.dtype == jnp.float32 else None
        y = jnp.einsum("...k,ok->...o", patches, w, precision=prec, preferred_element_type=jnp.float32).astype(patches.dtype)
        return y if self.bias is None else y + self.bias[...]


class ViTAttention(nnx.Module):
    def __init__(self, cfg: ViTConfig, *, dtype):
        d = cfg.hidden_size
        self.q_proj, self.k_proj, self.v_proj = (Linear(d, d, bias=True, dtype=dtype) for _ in range(3))
        self.out_proj = Linear(d, d, bias=True, dtype=dtype)
        self.num_heads = cfg.num_heads
        self.scale = (d // cfg.num_heads) ** -0.5

    def __call__(self, x, mask=None):
        b, n, d = x.shape
        split = lambda y: y.reshape(b, n, self.num_heads, d // self.num_heads)  # noqa: E731
        out = dense_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)), mask, self.scale)
        return self.out_proj(out.reshape(b, n, d))


class ViTMLP(nnx.Module):
    def __init__(self, cfg: ViTConfig, *, dtype):
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True, dtype=dtype)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True, dtype=dtype)
        self.act = cfg.hidden_act

    def __call__(self, x):
        return self.fc2(activation(self.act)(self.fc1(x)))


class ViTLayer(nnx.Module):
    def __init__(self, cfg: ViTConfig, *, dtype):
        self.layer_norm1 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.self_attn = ViTAttention(cfg, dtype=dtype)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.mlp = ViTMLP(cfg, dtype=dtype)

    def __call__(self, x, mask=None):
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class ViTEmbeddings(nnx.Module):
    def __init__(self, cfg: ViTConfig, *, dtype):
        self.patch_embedding = PatchEmbedding(cfg.num_channels, cfg.hidden_size, cfg.patch_size, bias=not cfg.class_token, dtype=dtype)
        self.class_embedding = _param((cfg.hidden_size,), dtype) if cfg.class_token else None
        self.position_embedding = Embedding(cfg.num_patches + int(cfg.class_token), cfg.hidden_size, dtype=dtype)

    def __call__(self, pixels):
        x = self.patch_embedding(pixels)
        if self.class_embedding is not None:
            cls = jnp.broadcast_to(self.class_embedding[...].astype(x.dtype), (x.shape[0], 1, x.shape[-1]))
            x = jnp.concatenate([cls, x], axis=1)
        return x + self.position_embedding.embedding[...][None].astype(x.dtype)


class ViTEncoder(nnx.Module):
    def __init__(self, cfg: ViTConfig, num_layers: int, *, dtype):
        self.layers = module_list([ViTLayer(cfg, dtype=dtype) for _ in range(num_layers)])


class VisionTransformer(nnx.Module):
    """pixels [B, C, S, S] -> the last hidden states [B, N, D] (post-LayerNorm: SigLIP), or, with `select_layer`,
    the hidden states after that many layers' outputs as transformers indexes them (CLIP for LLaVA: -2, the input to
    the last layer). Layers past the one read are not built (`num_layers_used`)."""

    def __init__(self, cfg: ViTConfig, *, dtype, num_layers_used: int | None = None):
        self.config = cfg
        self.embeddings = ViTEmbeddings(cfg, dtype=dtype)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype) if cfg.pre_layernorm else None
        used = cfg.num_layers if num_layers_used is None else num_layers_used
        self.encoder = ViTEncoder(cfg, used, dtype=dtype)
        self.post_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype) if cfg.post_layernorm else None

    def __call__(self, pixels, hidden_states: tuple[int, ...] = ()):
        """-> the post-norm last hidden states; with hidden_states, those entries of transformers' hidden_states
        tuple instead (0: the embeddings, i: after layer i), stacked [len, B, N, D]."""
        x = self.embeddings(pixels)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        kept = {0: x}
        for i, layer in enumerate(self.encoder.layers):
            x = layer(x)
            kept[i + 1] = x
        if hidden_states:
            return jnp.stack([kept[i % (self.config.num_layers + 1)] for i in hidden_states])
        return x if self.post_layernorm is None else self.post_layernorm(x)

    @staticmethod
    def weight_specs(cfg: ViTConfig, hf: str, ours: str, num_layers_used: int | None = None) -> dict[str, WeightSpec]:
        specs = {
            f"{hf}.embeddings.patch_embedding.weight": WeightSpec(f"{ours}.embeddings.patch_embedding.weight"),
            f"{hf}.embeddings.position_embedding.weight": WeightSpec(f"{ours}.embeddings.position_embedding.embedding"),
        }
        if cfg.class_token:
            specs[f"{hf}.embeddings.class_embedding"] = WeightSpec(f"{ours}.embeddings.class_embedding")
        else:
            specs[f"{hf}.embeddings.patch_embedding.bias"] = WeightSpec(f"{ours}.embeddings.patch_embedding.bias")
        if cfg.pre_layernorm:
            specs |= norm_specs(f"{hf}.pre_layrnorm", f"{ours}.pre_layrnorm")
        if cfg.post_layernorm:
            specs |= norm_specs(f"{hf}.post_layernorm", f"{ours}.post_layernorm")
        for i in range(cfg.num_layers if num_layers_used is None else num_layers_used):
            specs |= vit_layer_specs(f"{hf}.encoder.layers.{i}", f"{ours}.encoder.layers.{i}")
        return specs


def vit_layer_specs(hf: str, ours: str, norms: tuple[str, str] = ("layer_norm1", "layer_norm2"),
                    out: str = "out_proj") -> dict[str, WeightSpec]:  # fmt: skip
    """A pre-norm ViT layer's tensors under the same names: two LayerNorms, biased q/k/v/out projections, fc1/fc2."""
    specs = {}
    for norm in norms:
        specs |= norm_specs(f"{hf}.{norm}", f"{ours}.{norm}")
    for proj in ("q_proj", "k_proj", "v_proj", out):
        specs |= linear_specs(f"{hf}.self_attn.{proj}", f"{ours}.self_attn.{proj}", bias=True)
    for fc in ("fc1", "fc2"):
        specs |= linear_specs(f"{hf}.mlp.{fc}", f"{ours}.mlp.{fc}", bias=True)
    return specs

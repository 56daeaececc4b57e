"""Llama 4 reading images, as transformers 5.24's Llama4ForConditionalGeneration computes it. The processor cuts an
image into tiles of the tower's size (and, for more than one, adds the whole image as a last, global tile); each
tile's patches (an unfold and a bias-free linear) take a class token at the end and learned position embeddings,
then a LayerNorm, pre-norm layers (LayerNorm, bidirectional attention with biased projections and 2-D RoPE over the
patch grid (x then y frequencies, complex pairs; the class token unrotated), LayerNorm, exact-GELU MLP), a final
LayerNorm; the class token is dropped, a pixel shuffle folds each 2 x 2 patch block into one token, a two-layer
GELU MLP and the projector make text-width embeddings. They replace the prompt's `<|patch|>` tokens, tile after
tile (separator tokens between tiles stay text); the language model is models/llama4.py's, causal throughout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxpaged.models import llama4
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.layers import REFERENCE_ATTENTION, LayerNorm, Linear, _param, activation, module_list
from jaxpaged.models.vision.common import (
    MultimodalStep, SameSizeImages, VisionSpec, dense_attention, merge_embeddings, placeholder_ids,
)  # fmt: skip
from jaxpaged.models.vision.siglip import patchify, vit_layer_specs
from jaxpaged.models.weights import WeightSpec, linear_specs, norm_specs
from jaxpaged.pallas_kernels import AttentionBackend

LAYER_NORM_EPS = 1e-5  # torch's default: transformers builds the tower's LayerNorms without the config's norm_eps


@dataclasses.dataclass(frozen=True)
class Llama4VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    rope_theta: float
    shuffle_ratio: float
    projector_input_dim: int
    projector_output_dim: int
    vision_output_dim: int
    image_token_id: int

    @property
    def side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        return int(round(self.side**2 * self.shuffle_ratio**2))

    @staticmethod
    def from_hf(hf_config) -> Llama4VisionConfig:
        v = hf_config.vision_config
        rope = getattr(v, "rope_parameters", None) or {}
        return Llama4VisionConfig(
            hidden_size=int(v.hidden_size), intermediate_size=int(v.intermediate_size), num_layers=int(v.num_hidden_layers),
            num_heads=int(v.num_attention_heads), image_size=int(v.image_size), patch_size=int(v.patch_size),
            num_channels=int(v.num_channels), rope_theta=float(rope.get("rope_theta", getattr(v, "rope_theta", 10000.0))),
            shuffle_ratio=float(v.pixel_shuffle_ratio), projector_input_dim=int(v.projector_input_dim),
            projector_output_dim=int(v.projector_output_dim), vision_output_dim=int(v.vision_output_dim),
            image_token_id=int(hf_config.image_token_id),
        )  # fmt: skip


def rope_angles(cfg: Llama4VisionConfig) -> np.ndarray:
    """[patches + 1, head_dim / 2] rotation angles: pair j < head_dim / 4 turns by (x + 1) * f_j, the rest by
    (y + 1) * f_(j - head_dim / 4), the class token (last) not at all (transformers' _compute_freqs_ci)."""
    side, freq_dim = cfg.side, cfg.hidden_size // cfg.num_heads // 2
    freqs = 1.0 / cfg.rope_theta ** (np.arange(0, freq_dim, 2)[: freq_dim // 2].astype(np.float32) / freq_dim)
    index = np.arange(side * side)
    x, y = (index % side + 1).astype(np.float32), (index // side + 1).astype(np.float32)
    angles = np.concatenate([x[:, None] * freqs, y[:, None] * freqs], axis=-1)
    return np.concatenate([angles, np.zeros((1, angles.shape[1]), np.float32)]).astype(np.float32)


def rotate_pairs(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, N, H, D] as D / 2 complex pairs (re, im adjacent) times e^(i angle), in float32."""
    h = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    re, im = h[..., 0], h[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.stack([re * c - im * s, re * s + im * c], axis=-1).reshape(x.shape).astype(x.dtype)


class Llama4VisionAttention(nnx.Module):
    def __init__(self, cfg: Llama4VisionConfig, *, dtype):
        d = cfg.hidden_size
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (Linear(d, d, bias=True, dtype=dtype) for _ in range(4))
        self.num_heads = cfg.num_heads
        self.scale = (d // cfg.num_heads) ** -0.5

    def __call__(self, x, cos, sin):
        b, n, d = x.shape
        split = lambda y: y.reshape(b, n, self.num_heads, d // self.num_heads)  # noqa: E731
        q, k = rotate_pairs(split(self.q_proj(x)), cos, sin), rotate_pairs(split(self.k_proj(x)), cos, sin)
        return self.o_proj(dense_attention(q, k, split(self.v_proj(x)), None, self.scale).reshape(b, n, d))


class Llama4VisionMLP(nnx.Module):
    def __init__(self, d_in: int, d_mid: int, d_out: int, *, bias: bool, dtype, act_out: bool = False):
        self.fc1 = Linear(d_in, d_mid, bias=bias, dtype=dtype)
        self.fc2 = Linear(d_mid, d_out, bias=bias, dtype=dtype)
        self.act_out = act_out  # the adapter's MLP applies GELU after fc2 as well

    def __call__(self, x):
        gelu = activation("gelu")
        y = self.fc2(gelu(self.fc1(x)))
        return gelu(y) if self.act_out else y


class Llama4VisionLayer(nnx.Module):
    def __init__(self, cfg: Llama4VisionConfig, *, dtype):
        d = cfg.hidden_size
        self.input_layernorm = LayerNorm(d, eps=LAYER_NORM_EPS, dtype=dtype)
        self.self_attn = Llama4VisionAttention(cfg, dtype=dtype)
        self.post_attention_layernorm = LayerNorm(d, eps=LAYER_NORM_EPS, dtype=dtype)
        self.mlp = Llama4VisionMLP(d, cfg.intermediate_size, d, bias=True, dtype=dtype)

    def __call__(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama4VisionModel(nnx.Module):
    """tiles [B, C, S, S] -> [B, tokens per tile, vision_output_dim]."""

    def __init__(self, cfg: Llama4VisionConfig, *, dtype):
        d = cfg.hidden_size
        self.config = cfg
        self.patch_embedding = nnx.Dict(linear=Linear(cfg.num_channels * cfg.patch_size**2, d, bias=False, dtype=dtype))
        self.class_embedding = _param((d,), dtype)
        self.positional_embedding_vlm = _param((cfg.side**2 + 1, d), dtype)
        self.layernorm_pre = LayerNorm(d, eps=LAYER_NORM_EPS, dtype=dtype)
        self.layernorm_post = LayerNorm(d, eps=LAYER_NORM_EPS, dtype=dtype)
        self.model = nnx.Dict(layers=module_list([Llama4VisionLayer(cfg, dtype=dtype) for _ in range(cfg.num_layers)]))
        shuffled = int(round(cfg.intermediate_size))  # fc1 reads the shuffled width: hidden / ratio^2 (= intermediate)
        self.vision_adapter = nnx.Dict(mlp=Llama4VisionMLP(shuffled, cfg.projector_input_dim, cfg.projector_output_dim,
                                                           bias=False, dtype=dtype, act_out=True))  # fmt: skip

    def __call__(self, pixels: jax.Array) -> jax.Array:
        cfg = self.config
        x = self.patch_embedding["linear"](patchify(pixels.astype(self.class_embedding.dtype), cfg.patch_size))
        cls = jnp.broadcast_to(self.class_embedding[...].astype(x.dtype), (x.shape[0], 1, x.shape[-1]))
        x = jnp.concatenate([x, cls], axis=1) + self.positional_embedding_vlm[...][None].astype(x.dtype)
        x = self.layernorm_pre(x)
        angles = jnp.asarray(rope_angles(cfg))
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        for layer in self.model["layers"]:
            x = layer(x, cos, sin)
        x = self.layernorm_post(x)[:, :-1]
        return self.vision_adapter["mlp"](pixel_shuffle(x, cfg.shuffle_ratio))

    @staticmethod
    def weight_specs(cfg: Llama4VisionConfig, hf: str, ours: str) -> dict[str, WeightSpec]:
        specs = {f"{hf}.class_embedding": WeightSpec(f"{ours}.class_embedding"),
                 f"{hf}.positional_embedding_vlm": WeightSpec(f"{ours}.positional_embedding_vlm")}  # fmt: skip
        specs |= linear_specs(f"{hf}.patch_embedding.linear", f"{ours}.patch_embedding.linear", bias=False)
        specs |= norm_specs(f"{hf}.layernorm_pre", f"{ours}.layernorm_pre")
        specs |= norm_specs(f"{hf}.layernorm_post", f"{ours}.layernorm_post")
        for fc in ("fc1", "fc2"):
            specs |= linear_specs(f"{hf}.vision_adapter.mlp.{fc}", f"{ours}.vision_adapter.mlp.{fc}", bias=False)
        for i in range(cfg.num_layers):
            specs |= vit_layer_specs(f"{hf}.model.layers.{i}", f"{ours}.model.layers.{i}",
                                     ("input_layernorm", "post_attention_layernorm"), "o_proj")  # fmt: skip
        return specs


def pixel_shuffle(x: jax.Array, ratio: float) -> jax.Array:
    """transformers' pixel_shuffle: [B, side^2, C] -> [B, (side * ratio)^2, C / ratio^2], its reshapes and
    transposes as written there."""
    b, n, c = x.shape
    side = int(round(n**0.5))
    x = x.reshape(b, side, int(side * ratio), int(c / ratio))
    x = x.transpose(0, 2, 1, 3).reshape(b, int(side * ratio), int(side * ratio), int(c / ratio**2))
    return x.transpose(0, 2, 1, 3).reshape(b, -1, x.shape[-1])


class Llama4ForConditionalGeneration(llama4.Llama4ForConditionalGeneration):
    """The language model of models/llama4.py with the vision model and the projector: images in prompts."""

    CHECKPOINT_RENAMES = llama4.Llama4ForConditionalGeneration.CHECKPOINT_RENAMES + (
        (r"^model\.vision_model\.", "vision_model."),
        (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
    )  # fmt: skip
    SKIPPED_TENSORS = (ROTARY_CACHE,)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        super().__init__(cfg, dtype=dtype, attention=attention)
        vision: Llama4VisionConfig = cfg.option("vision")
        self.vision_model = Llama4VisionModel(vision, dtype=dtype)
        self.multi_modal_projector = nnx.Dict(linear_1=Linear(vision.vision_output_dim, cfg.hidden_size, bias=False, dtype=dtype))

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        cfg = llama4.Llama4ForConditionalGeneration.config_from_hf(hf_config, architecture)
        vision = Llama4VisionConfig.from_hf(hf_config)
        if vision.side**2 * vision.shuffle_ratio**2 != vision.tokens_per_tile or vision.side % round(1 / vision.shuffle_ratio):
            raise ValueError(f"pixel_shuffle_ratio {vision.shuffle_ratio} must fold the {vision.side} x {vision.side} patch "
                             "grid into whole tokens")  # fmt: skip
        if vision.hidden_size / vision.shuffle_ratio**2 != vision.intermediate_size:
            raise ValueError("vision_config.intermediate_size must be hidden_size / pixel_shuffle_ratio^2: the adapter's "
                             "first layer reads the shuffled patches")  # fmt: skip
        return dataclasses.replace(cfg, options=tuple(sorted(dict(cfg.options, vision=vision).items())))

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        specs = llama4.Llama4ForConditionalGeneration.weight_specs(cfg)
        specs |= Llama4VisionModel.weight_specs(cfg.option("vision"), "vision_model", "vision_model")
        return specs | linear_specs("multi_modal_projector.linear_1", "multi_modal_projector.linear_1", bias=False)

    # -- images ---------------------------------------------------------------------------------

    @property
    def vision_spec(self) -> VisionSpec:
        return VisionSpec(self.config.option("vision").image_token_id, self.config.hidden_size)

    def encode(self, batch: dict) -> jax.Array:
        """{"pixel_values": [B, C, S, S]} tiles -> [B * tokens per tile, 1, D], tile after tile."""
        features = self.multi_modal_projector["linear_1"](self.vision_model(batch["pixel_values"]))
        return features.reshape(-1, 1, features.shape[-1])

    def forward(self, input_ids, positions, kv_cache, attn_metadata, mm: MultimodalStep | None = None):
        x = merge_embeddings(self.embed(placeholder_ids(input_ids, mm), positions), mm)
        x, new_kv = self.run_layers(x, positions, kv_cache, attn_metadata, self.layers)
        return self.final(x), new_kv


class Llama4Images(SameSizeImages):
    """Every tile has the tower's size: one item per tile (an image's tiles, then its global tile, as the processor
    orders them and the prompt spells them), one patch count, so the buckets count tiles."""

    RETURN_TENSORS = "pt"  # its (torchvision) processor makes bfloat16 pixels, which numpy cannot hold

    def __init__(self, hf_config, spec: VisionSpec):
        super().__init__(hf_config, spec)
        vision = Llama4VisionConfig.from_hf(hf_config)
        self.image_size, self.channels = vision.image_size, vision.num_channels
        self.patches, self.tokens = vision.side**2, vision.tokens_per_tile

    def max_image_patches(self) -> int:
        """The largest image's tiles: the processor's max_patches, plus its global tile."""
        tiles = int(getattr(self.processor.image_processor, "max_patches", 16)) + 1 if self.processor is not None else 17
        return tiles * self.patches


Llama4ForConditionalGeneration.IMAGES = Llama4Images

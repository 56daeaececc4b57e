"""Gemma 4 reading images, as transformers 5.24's Gemma4ForConditionalGeneration computes it.

The tower: each image at its own resolution (the processor resizes it, aspect kept, to at most `max_soft_tokens`
soft tokens of k x k patches, k the `pooling_kernel_size`), its patches already flattened by the processor; pixels
scaled to [-1, 1], a bias-free patch projection plus learned x and y position embeddings; pre- and post-normed layers
(Gemma 4's x * w RMSNorms) with q/k norms, a scale-less v norm, attention scale 1 and 2-D RoPE (the head's first
half rotated by the patch's column, the second by its row), GQA; every linear optionally clamping its input and
output (`use_clipped_linears`). Then each k x k block of patches averaged into one soft token (row-major over the
pooled grid), times sqrt(hidden) in float32, optionally standardized (`std_bias`, `std_scale`), and projected into
the language model (`embed_vision`: a scale-less RMSNorm and a linear). A batch's images attend block-diagonally
(common.batch_attention), as transformers' batch rows do.

The language model (models/gemma4.py) takes the soft tokens in place of the placeholders' embeddings; its per-layer
inputs read the pad token's id there (transformers' `llm_input_ids`, which also puts the pad token wherever an image,
video or audio placeholder id appears, a generated one too) and the merged embeddings. With
`use_bidirectional_attention: vision` (Gemma 4's larger models) an image's tokens attend to each other both ways on
the sliding layers only (AttentionMetadata.key_ends; the full layers stay causal), so an image's span is computed in
one step, as Gemma 3's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxpaged.models import gemma4
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.gemma4 import Gemma4RMSNorm
from jaxpaged.models.layers import REFERENCE_ATTENTION, Linear, _param, activation, apply_rope, module_list
from jaxpaged.models.vision.common import (
    EncoderItem, ImageAdapter, MultimodalStep, VisionSpec, batch_attention, in_prompt_order, merge_embeddings,
    segment_call_patches,
)  # fmt: skip
from jaxpaged.models.weights import WeightSpec, linear_specs
from jaxpaged.pallas_kernels import AttentionBackend

AUDIO = (r"^model\.(audio_tower|embed_audio)\.", "the audio tower and its embedder: not ported, audio is not supported")
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
BOUNDS = ("input_min", "input_max", "output_min", "output_max")


@dataclasses.dataclass(frozen=True)
class Gemma4VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_act: str
    eps: float
    patch_size: int
    pool: int  # pooling_kernel_size: k x k patches make a soft token
    position_embedding_size: int
    rope_theta: float
    clipped: bool  # use_clipped_linears
    standardize: bool
    image_token_id: int

    @staticmethod
    def from_hf(hf_config) -> Gemma4VisionConfig:
        v = hf_config.vision_config
        rope = dict(getattr(v, "rope_parameters", None) or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"Gemma 4's vision tower takes axial RoPE only (rope_type {rope['rope_type']!r})")
        return Gemma4VisionConfig(
            hidden_size=int(v.hidden_size), intermediate_size=int(v.intermediate_size),
            num_layers=int(v.num_hidden_layers), num_heads=int(v.num_attention_heads),
            num_kv_heads=int(v.num_key_value_heads), head_dim=int(v.head_dim), hidden_act=str(v.hidden_activation),
            eps=float(v.rms_norm_eps), patch_size=int(v.patch_size), pool=int(v.pooling_kernel_size),
            position_embedding_size=int(v.position_embedding_size), rope_theta=float(rope.get("rope_theta", 100.0)),
            clipped=bool(v.use_clipped_linears), standardize=bool(v.standardize),
            image_token_id=int(hf_config.image_token_id),
        )  # fmt: skip


class ClippableLinear(nnx.Module):
    """transformers' Gemma4ClippableLinear: a bias-free linear, its input and output clamped to learned bounds."""

    def __init__(self, d_in: int, d_out: int, *, clipped: bool, dtype):
        self.linear = Linear(d_in, d_out, bias=False, dtype=dtype)
        for name in BOUNDS:
            setattr(self, name, _param((), dtype) if clipped else None)
        self.clipped = clipped

    def __call__(self, x):
        if not self.clipped:
            return self.linear(x)
        lo, hi, out_lo, out_hi = (getattr(self, name)[...].astype(x.dtype) for name in BOUNDS)
        return jnp.clip(self.linear(jnp.clip(x, lo, hi)), out_lo, out_hi)

    @staticmethod
    def weight_specs(hf: str, ours: str, clipped: bool) -> dict[str, WeightSpec]:
        specs = linear_specs(f"{hf}.linear", f"{ours}.linear", bias=False)
        if clipped:
            specs |= {f"{hf}.{name}": WeightSpec(f"{ours}.{name}") for name in BOUNDS}
        return specs


def _rope_halves(pos: jax.Array, inv: tuple[float, ...]) -> list[tuple[jax.Array, jax.Array]]:
    """(cos, sin) [P, head_dim / 2] for each half of a head: the patch's column, then its row (pos [P, 2] is x, y)."""
    out = []
    for axis in range(2):
        angles = pos[:, axis : axis + 1].astype(jnp.float32) * jnp.asarray(inv, jnp.float32)
        angles = jnp.concatenate([angles, angles], axis=-1)
        out.append((jnp.cos(angles), jnp.sin(angles)))
    return out


def _apply_rope_2d(x: jax.Array, ropes) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([apply_rope(x[..., :half], ropes[0]), apply_rope(x[..., half:], ropes[1])], axis=-1)


class Gemma4VisionAttention(nnx.Module):
    def __init__(self, cfg: Gemma4VisionConfig, *, dtype):
        d, h, kv, hd, clip = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.clipped
        self.q_proj = ClippableLinear(d, h * hd, clipped=clip, dtype=dtype)
        self.k_proj = ClippableLinear(d, kv * hd, clipped=clip, dtype=dtype)
        self.v_proj = ClippableLinear(d, kv * hd, clipped=clip, dtype=dtype)
        self.o_proj = ClippableLinear(h * hd, d, clipped=clip, dtype=dtype)
        self.q_norm = Gemma4RMSNorm(hd, eps=cfg.eps, dtype=dtype)
        self.k_norm = Gemma4RMSNorm(hd, eps=cfg.eps, dtype=dtype)
        self.v_norm = Gemma4RMSNorm(hd, eps=cfg.eps, dtype=dtype, scaled=False)
        self.shape = (h, kv, hd)

    def __call__(self, x, ropes, seg):
        (h, kv, hd), n = self.shape, x.shape[0]
        q = _apply_rope_2d(self.q_norm(self.q_proj(x).reshape(n, h, hd)), ropes)
        k = _apply_rope_2d(self.k_norm(self.k_proj(x).reshape(n, kv, hd)), ropes)
        v = self.v_norm(self.v_proj(x).reshape(n, kv, hd))
        if kv != h:  # query head j reads KV head j // (h / kv), as transformers' repeat_kv
            k, v = jnp.repeat(k, h // kv, axis=1), jnp.repeat(v, h // kv, axis=1)
        return self.o_proj(batch_attention(q, k, v, seg, 1.0).reshape(n, h * hd))


class Gemma4VisionMLP(nnx.Module):
    def __init__(self, cfg: Gemma4VisionConfig, *, dtype):
        d, f, clip = cfg.hidden_size, cfg.intermediate_size, cfg.clipped
        self.gate_proj = ClippableLinear(d, f, clipped=clip, dtype=dtype)
        self.up_proj = ClippableLinear(d, f, clipped=clip, dtype=dtype)
        self.down_proj = ClippableLinear(f, d, clipped=clip, dtype=dtype)
        self.act = cfg.hidden_act

    def __call__(self, x):
        return self.down_proj(activation(self.act)(self.gate_proj(x)) * self.up_proj(x))


class Gemma4VisionLayer(nnx.Module):
    def __init__(self, cfg: Gemma4VisionConfig, *, dtype):
        for name in LAYER_NORMS:
            setattr(self, name, Gemma4RMSNorm(cfg.hidden_size, eps=cfg.eps, dtype=dtype))
        self.self_attn = Gemma4VisionAttention(cfg, dtype=dtype)
        self.mlp = Gemma4VisionMLP(cfg, dtype=dtype)

    def __call__(self, x, ropes, seg):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ropes, seg))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma4VisionModel(nnx.Module):
    """A batch of patches (Gemma4Images.batch) -> [rows, D] soft tokens: each image's pooled grid, image after image,
    scaled (and standardized) in float32 as transformers' pooler and vision model do, returned in the model's dtype."""

    def __init__(self, cfg: Gemma4VisionConfig, *, dtype):
        self.config = cfg
        d = cfg.hidden_size
        self.input_proj = Linear(3 * cfg.patch_size**2, d, bias=False, dtype=dtype)
        self.position_embedding_table = _param((2, cfg.position_embedding_size, d), dtype)
        self.layers = module_list([Gemma4VisionLayer(cfg, dtype=dtype) for _ in range(cfg.num_layers)])
        self.std_bias = _param((d,), dtype) if cfg.standardize else None
        self.std_scale = _param((d,), dtype) if cfg.standardize else None
        spatial = cfg.head_dim // 2  # transformers' axial frequencies: over half the head, for each of x and y
        self.inv = tuple(float(f) for f in 1.0 / (cfg.rope_theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial)))

    def __call__(self, patches, pos, seg, row, num_rows: int):
        cfg = self.config
        x = self.input_proj((2.0 * (patches - 0.5)).astype(self.input_proj.kernel.dtype))
        table = self.position_embedding_table[...]
        x = x + jnp.where((seg >= 0)[:, None], table[0][pos[:, 0]] + table[1][pos[:, 1]], 0).astype(x.dtype)
        ropes = _rope_halves(pos, self.inv)
        for layer in self.layers:
            x = layer(x, ropes, seg)
        # the pooler: each k x k block's average (padding patches go to a row past the last, dropped)
        h = jnp.where((seg >= 0)[:, None], x, 0).astype(jnp.float32) * (1.0 / cfg.pool**2)
        pooled = jax.ops.segment_sum(h, jnp.where(seg >= 0, row, num_rows), num_segments=num_rows + 1)[:num_rows]
        pooled = pooled.astype(x.dtype).astype(jnp.float32) * cfg.hidden_size**0.5
        if self.std_bias is not None:
            pooled = (pooled - self.std_bias[...].astype(jnp.float32)) * self.std_scale[...].astype(jnp.float32)
        return pooled.astype(x.dtype)

    @staticmethod
    def weight_specs(cfg: Gemma4VisionConfig, hf: str, ours: str) -> dict[str, WeightSpec]:
        specs = linear_specs(f"{hf}.patch_embedder.input_proj", f"{ours}.input_proj", bias=False)
        specs[f"{hf}.patch_embedder.position_embedding_table"] = WeightSpec(f"{ours}.position_embedding_table")
        if cfg.standardize:
            specs |= {f"{hf}.{name}": WeightSpec(f"{ours}.{name}") for name in ("std_bias", "std_scale")}
        for i in range(cfg.num_layers):
            h, o = f"{hf}.encoder.layers.{i}", f"{ours}.layers.{i}"
            specs |= {f"{h}.{norm}.weight": WeightSpec(f"{o}.{norm}.scale") for norm in LAYER_NORMS}
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                specs |= ClippableLinear.weight_specs(f"{h}.self_attn.{proj}", f"{o}.self_attn.{proj}", cfg.clipped)
            for norm in ("q_norm", "k_norm"):
                specs[f"{h}.self_attn.{norm}.weight"] = WeightSpec(f"{o}.self_attn.{norm}.scale")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                specs |= ClippableLinear.weight_specs(f"{h}.mlp.{proj}", f"{o}.mlp.{proj}", cfg.clipped)
        return specs


class Gemma4MultimodalEmbedder(nnx.Module):
    """transformers' embed_vision: a scale-less RMSNorm, then the projection into the language model's width."""

    def __init__(self, d_in: int, d_out: int, *, eps: float, dtype):
        self.embedding_pre_projection_norm = Gemma4RMSNorm(d_in, eps=eps, dtype=dtype, scaled=False)
        self.embedding_projection = Linear(d_in, d_out, bias=False, dtype=dtype)

    def __call__(self, x):
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


class Gemma4ForConditionalGeneration(gemma4.Gemma4ForConditionalGeneration):
    """models/gemma4.py's language model with the vision tower and its embedder: images in prompts. A checkpoint
    without a vision_config is text only, as its parent."""

    SKIPPED_TENSORS = (ROTARY_CACHE, AUDIO, gemma4.SHARED_KV_WEIGHTS)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        super().__init__(cfg, dtype=dtype, attention=attention)
        vision: Gemma4VisionConfig | None = cfg.option("vision")
        self.vision_tower = Gemma4VisionModel(vision, dtype=dtype) if vision else None
        self.embed_vision = (Gemma4MultimodalEmbedder(vision.hidden_size, cfg.hidden_size, eps=vision.eps, dtype=dtype)
                             if vision else None)  # fmt: skip

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        cfg = gemma4.Gemma4ForConditionalGeneration.config_from_hf(hf_config, architecture)
        if getattr(hf_config, "vision_config", None) is None:
            return cfg
        return dataclasses.replace(cfg, options=tuple(sorted(dict(cfg.options, vision=Gemma4VisionConfig.from_hf(hf_config)).items())))

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        specs = gemma4.Gemma4ForCausalLM.weight_specs(cfg)
        vision: Gemma4VisionConfig | None = cfg.option("vision")
        if vision:
            specs |= Gemma4VisionModel.weight_specs(vision, "model.vision_tower", "vision_tower")
            specs |= linear_specs("model.embed_vision.embedding_projection", "embed_vision.embedding_projection", bias=False)
        return specs

    # -- images ---------------------------------------------------------------------------------

    @property
    def vision_spec(self) -> VisionSpec | None:
        vision = self.config.option("vision")
        if not vision:
            return None
        return VisionSpec(vision.image_token_id, self.config.hidden_size, bidirectional=self.config.option("bidirectional_images"))

    def encode(self, batch: dict) -> jax.Array:
        """A batch (Gemma4Images.batch) -> [rows, 1, D]: each image's soft tokens in order."""
        rows = batch["row"].shape[0] // self.config.option("vision").pool ** 2
        pooled = self.vision_tower(batch["patches"], batch["pos"], batch["seg"], batch["row"], rows)
        return self.embed_vision(pooled)[:, None, :]

    def forward(self, input_ids, positions, kv_cache, attn_metadata, mm: MultimodalStep | None = None):
        if mm is None:
            return super().forward(input_ids, positions, kv_cache, attn_metadata)
        ids = self.text_ids(input_ids, mm.rows)
        x = merge_embeddings(self.embed(ids, positions), mm)
        return self.run(ids, x, positions, kv_cache, attn_metadata)


class Gemma4Images(ImageAdapter):
    """Images of any size up to the processor's `max_soft_tokens`: each one's real patches (the processor pads them
    to the largest), their (x, y) positions and the soft token each pools into; buckets count patches in multiples
    of k x k."""

    def __init__(self, hf_config, spec: VisionSpec):
        super().__init__(hf_config, spec)
        v = hf_config.vision_config
        self.patch, self.pool = int(v.patch_size), int(v.pooling_kernel_size)
        self.unit = self.pool * self.pool
        self.features = 3 * self.patch * self.patch
        self.max_tokens = 280  # transformers' default max_soft_tokens, until the processor says

    SETTINGS = ImageAdapter.SETTINGS + ("max_soft_tokens",)  # Gemma 4's token budget per image: 70 to 1120

    def configure(self, processor, settings: dict | None = None) -> None:
        super().configure(processor, settings)
        image_processor = processor.image_processor
        if int(image_processor.patch_size) != self.patch or int(image_processor.pooling_kernel_size) != self.pool:
            raise ValueError(f"the image processor's patch_size {image_processor.patch_size} and pooling_kernel_size "
                             f"{image_processor.pooling_kernel_size} differ from the model's ({self.patch}, {self.pool})")  # fmt: skip
        self.max_tokens = int(self.settings.get("max_soft_tokens", image_processor.max_soft_tokens))

    @property
    def video_token_id(self) -> int | None:
        token = getattr(self.hf_config, "video_token_id", None)
        return None if token is None else int(token)

    def items(self, processed: dict, input_ids: Sequence[int]) -> list[EncoderItem]:
        """Each image, and each video frame (the processor puts each between its timestamp text, and transformers'
        tower reads it as an image), in prompt order."""
        images = self._items(processed["pixel_values"], processed["image_position_ids"]) if "pixel_values" in processed else []
        if "pixel_values_videos" not in processed:
            return images
        frames = self._items(processed["pixel_values_videos"], processed["video_position_ids"])
        return in_prompt_order(input_ids, images, self.spec.image_token_id, frames, self.video_token_id)

    def _items(self, pixels, positions) -> list[EncoderItem]:
        pixels, positions = np.asarray(pixels, np.float32), np.asarray(positions).astype(np.int32)
        k, items = self.pool, []
        for patches, pos in zip(pixels, positions):
            real = (pos != -1).all(-1)
            patches, pos = patches[real], pos[real]
            width = int(pos[:, 0].max()) + 1  # in patches; the pooled grid is width / k tokens wide
            row = (pos[:, 1] // k) * (width // k) + pos[:, 0] // k
            arrays = {"patches": patches, "pos": pos, "row": row.astype(np.int32)}
            items.append(EncoderItem(arrays, len(patches), len(patches) // self.unit))
        return items

    def max_image_patches(self) -> int:
        return self.max_tokens * self.unit

    def call_patches(self, items, largest_bucket: int) -> int:
        return segment_call_patches(self, items, largest_bucket)

    def buckets(self, max_patches: int) -> list[int]:
        return [n * self.unit for n in ImageAdapter.buckets(self, math.ceil(max_patches / self.unit))]

    def rows_for(self, bucket: int) -> int:
        return bucket // self.unit

    def batch(self, items: Sequence[EncoderItem], bucket: int) -> dict[str, np.ndarray]:
        out = {"patches": np.zeros((bucket, self.features), np.float32), "pos": np.zeros((bucket, 2), np.int32),
               "seg": np.full(bucket, -1, np.int32), "row": np.zeros(bucket, np.int32)}  # fmt: skip
        at = r = 0
        for i, item in enumerate(items):
            a, n = item.arrays, item.num_patches
            out["patches"][at : at + n] = a["patches"]
            out["pos"][at : at + n] = a["pos"]
            out["seg"][at : at + n] = i
            out["row"][at : at + n] = a["row"] + r
            at += n
            r += item.num_rows
        return out


Gemma4ForConditionalGeneration.IMAGES = Gemma4Images

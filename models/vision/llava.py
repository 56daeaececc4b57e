"""The LLaVA family reading images, as transformers 5.24 computes it:

- LLaVA-1.5 (`LlavaForConditionalGeneration`): CLIP's vision transformer read at `vision_feature_layer` (-2: the
  input to its last layer), the class token dropped (`vision_feature_select_strategy` "default"), a two-layer GELU
  projector; one image is image_size / patch squared tokens;
- LLaVA-NeXT (`LlavaNextForConditionalGeneration`): any-resolution tiling: the processor cuts the image into tiles
  of the tower's size on the grid `image_grid_pinpoints` picks (select_best_resolution) plus the whole image resized;
  every tile goes through the tower and projector, the grid's features are laid out as one feature map, the padding
  the processor added is cut off (unpad), a learned `image_newline` ends each row, and the whole image's features
  lead;
- LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`): SigLIP read at its last layer with every token, the
  same tiling, and a feature map larger than `anyres_max_N` tiles' worth is resized bilinearly before the newlines; a
  prompt with several images takes each one's whole-image features and one newline only.

The language model is Llama-shaped (Llama, Mistral, Qwen2: models/llama.py). The tiling's layout, the unpad and the
resize are index arithmetic the host does per image (`LlavaImages`): the encoder runs the tower and projector over a
batch of tiles and gathers each output row from up to four feature rows with weights (or the newline), so every image
size runs the same compiled buckets (a bucket counts tiles).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.layers import REFERENCE_ATTENTION, Linear, _param, activation
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.models.vision.common import (
    EncoderItem, ImageAdapter, MultimodalStep, VisionSpec, merge_embeddings, placeholder_ids,
)  # fmt: skip
from jaxpaged.models.vision.siglip import VisionTransformer, ViTConfig
from jaxpaged.models.weights import WeightSpec, linear_specs
from jaxpaged.pallas_kernels import AttentionBackend

UNREAD = (
    r"^vision_tower\.(post_layernorm|head)\.",
    "the tower's final LayerNorm and pooling head: LLaVA reads a layer's hidden states, never the pooled output",
)
KINDS = {"LlavaForConditionalGeneration": "llava", "LlavaNextForConditionalGeneration": "next",
         "LlavaOnevisionForConditionalGeneration": "onevision"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LlavaVisionConfig:
    kind: str  # "llava", "next", "onevision"
    tower: ViTConfig
    feature_layer: int  # transformers' hidden_states index
    drop_cls: bool  # vision_feature_select_strategy "default"
    projector_act: str
    projector_bias: bool
    image_token_id: int
    pinpoints: tuple[tuple[int, int], ...] = ()
    max_tiles: int = 0  # OneVision's anyres_max_N

    @property
    def side(self) -> int:
        """Feature rows per tile side."""
        return self.tower.image_size // self.tower.patch_size

    @staticmethod
    def from_hf(hf_config, architecture: str) -> LlavaVisionConfig:
        v = hf_config.vision_config
        clip = v.model_type.startswith("clip")
        layer = hf_config.vision_feature_layer
        if not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer={layer}: several feature layers are not supported")
        aspect = str(getattr(hf_config, "vision_aspect_ratio", "") or "")
        # the tower is read at a layer's hidden states: its final LayerNorm (SigLIP's) never runs
        tower = dataclasses.replace(ViTConfig.from_hf(v, clip=clip), post_layernorm=False)
        return LlavaVisionConfig(
            kind=KINDS[architecture], tower=tower, feature_layer=int(layer),
            drop_cls=hf_config.vision_feature_select_strategy == "default", projector_act=str(hf_config.projector_hidden_act),
            projector_bias=bool(getattr(hf_config, "multimodal_projector_bias", True)),
            image_token_id=int(hf_config.image_token_id),
            pinpoints=tuple(tuple(int(x) for x in p) for p in getattr(hf_config, "image_grid_pinpoints", None) or ()),
            max_tiles=int(aspect.removeprefix("anyres_max_")) if aspect.startswith("anyres_max_") else 0,
        )  # fmt: skip


class LlavaProjector(nnx.Module):
    """linear_1 -> activation -> linear_2: LLaVA's projector (Pixtral-12B's too), and Mistral 3's after its merger."""

    def __init__(self, features: int, text_hidden: int, *, bias: bool, act: str, dtype):
        self.linear_1 = Linear(features, text_hidden, bias=bias, dtype=dtype)
        self.linear_2 = Linear(text_hidden, text_hidden, bias=bias, dtype=dtype)
        self.act = act

    def __call__(self, x):
        return self.linear_2(activation(self.act)(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """A Llama-shaped language model with a CLIP or SigLIP tower and the LLaVA projector (and NeXT's newline)."""

    CHECKPOINT_RENAMES = (
        (r"^language_model\.model\.", "model."),
        (r"^model\.language_model\.", "model."),
        (r"^language_model\.lm_head\.", "lm_head."),
        (r"^(model\.)?vision_tower\.vision_model\.", "vision_tower."),
        (r"^model\.vision_tower\.", "vision_tower."),
        (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
        (r"^model\.image_newline$", "image_newline"),
    )  # fmt: skip
    SKIPPED_TENSORS = (ROTARY_CACHE, UNREAD)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        super().__init__(cfg, dtype=dtype, attention=attention)
        vision: LlavaVisionConfig = cfg.option("vision")
        self.vision_tower = VisionTransformer(vision.tower, dtype=dtype)
        self.multi_modal_projector = LlavaProjector(vision.tower.hidden_size, cfg.hidden_size, bias=vision.projector_bias,
                                                    act=vision.projector_act, dtype=dtype)
        self.image_newline = _param((cfg.hidden_size,), dtype) if vision.kind != "llava" else None

    @classmethod
    def port_for(cls, hf_config) -> type:
        """The class serving this config (the loader asks): Pixtral-12B's, a Pixtral tower, is models/vision/pixtral.py's."""
        if getattr(getattr(hf_config, "vision_config", None), "model_type", None) == "pixtral":
            from jaxpaged.models.vision.pixtral import PixtralLlavaForConditionalGeneration

            return PixtralLlavaForConditionalGeneration
        return cls

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        text = hf_config.get_text_config()
        qwen2 = text.model_type == "qwen2"  # OneVision's: q/k/v biased, o_proj not
        cfg = (LlamaForCausalLM.config_from_hf(hf_config, "Qwen2ForCausalLM") if qwen2 else
               LlamaForCausalLM.config_from_hf(hf_config, "LlamaForCausalLM"))  # fmt: skip
        vision = LlavaVisionConfig.from_hf(hf_config, architecture)
        options = dict(cfg.options, vision=vision)
        return dataclasses.replace(cfg, architecture=architecture, options=tuple(sorted(options.items())))

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        vision: LlavaVisionConfig = cfg.option("vision")
        specs = LlamaForCausalLM.weight_specs(cfg)
        tower = VisionTransformer.weight_specs(vision.tower, "vision_tower", "vision_tower")
        specs |= {k: v for k, v in tower.items() if not k.startswith("vision_tower.post_layernorm")}
        for name in ("linear_1", "linear_2"):
            specs |= linear_specs(f"multi_modal_projector.{name}", f"multi_modal_projector.{name}", bias=vision.projector_bias)
        if vision.kind != "llava":
            specs["image_newline"] = WeightSpec("image_newline")
        return specs

    # -- images ---------------------------------------------------------------------------------

    @property
    def vision_spec(self) -> VisionSpec:
        return VisionSpec(self.config.option("vision").image_token_id, self.config.hidden_size)

    def encode(self, batch: dict) -> jax.Array:
        """{"pixel_values": [tiles, C, S, S], "idx": [rows, 4], "w": [rows, 4], "newline": [rows]} -> [rows, 1, D]: each
        output row the weighted sum of up to four projected feature rows (tile-major), or the newline."""
        vision: LlavaVisionConfig = self.config.option("vision")
        hidden = self.vision_tower(batch["pixel_values"], hidden_states=(vision.feature_layer,))[0]
        if vision.drop_cls:
            hidden = hidden[:, 1:]
        feats = self.multi_modal_projector(hidden).reshape(-1, self.config.hidden_size)
        taps = feats[batch["idx"]].astype(jnp.float32)  # [rows, 4, D]
        out = jnp.einsum("rk,rkd->rd", batch["w"], taps, precision=jax.lax.Precision.HIGHEST)
        if self.image_newline is not None:
            out = out + batch["newline"][:, None] * self.image_newline[...].astype(jnp.float32)
        return out.astype(feats.dtype)[:, None, :]

    def forward(self, input_ids, positions, kv_cache, attn_metadata, mm: MultimodalStep | None = None):
        x = merge_embeddings(self.embed(placeholder_ids(input_ids, mm), positions), mm)
        x, new_kv = self.run_layers(x, positions, kv_cache, attn_metadata, self.layers)
        return self.final(x), new_kv


LlavaNextForConditionalGeneration = LlavaForConditionalGeneration  # (the registry's names)
LlavaOnevisionForConditionalGeneration = LlavaForConditionalGeneration


# -- the host side ----------------------------------------------------------------------------------


def _unpad(rows: int, cols: int, height: int, width: int) -> tuple[slice, slice]:
    """transformers' unpad_image on a rows x cols feature map of an image of height x width: what is kept."""
    if width / height > cols / rows:
        new_height = int(round(height * (cols / width), 7))
        pad = (rows - new_height) // 2
        return slice(pad, rows - pad), slice(0, cols)
    new_width = int(round(width * (rows / height), 7))
    pad = (cols - new_width) // 2
    return slice(0, rows), slice(pad, cols - pad)


def _bilinear(size_in: int, size_out: int) -> tuple[np.ndarray, np.ndarray]:
    """torch's bilinear interpolation along one axis (align_corners False): ([out, 2] taps, [out, 2] weights)."""
    scale = size_in / size_out
    src = np.maximum((np.arange(size_out) + 0.5) * scale - 0.5, 0.0)
    i0 = np.floor(src).astype(np.int64)
    i1 = np.minimum(i0 + 1, size_in - 1)
    frac = (src - i0).astype(np.float32)
    return np.stack([i0, i1], 1), np.stack([1 - frac, frac], 1).astype(np.float32)


class LlavaImages(ImageAdapter):
    """Each image as its tiles and the gather that lays their features out; buckets count tiles."""

    def __init__(self, hf_config, spec: VisionSpec):
        super().__init__(hf_config, spec)
        self.vision = LlavaVisionConfig.from_hf(hf_config, next(a for a in hf_config.architectures if a in KINDS))
        tower = self.vision.tower
        self.size, self.channels = tower.image_size, tower.num_channels
        self.hw = self.vision.side**2  # projected rows per tile
        self.per_tile = tower.num_patches + int(tower.class_token)  # the encoder's work per tile

    def _tiles_of(self, height: int, width: int) -> tuple[int, int]:
        """(tiles high, tiles wide) of the grid the processor cut the image into."""
        from transformers.image_processing_utils import select_best_resolution

        best_h, best_w = select_best_resolution((height, width), [list(p) for p in self.vision.pinpoints])
        return best_h // self.size, best_w // self.size

    def _gather(self, tiles_hw: tuple[int, int] | None, image_size: tuple[int, int]) -> tuple[np.ndarray, ...]:
        """(idx [rows, 4], w [rows, 4], newline [rows]) over the item's tiles, tile 0 the whole image."""
        s, hw = self.vision.side, self.hw
        base = [([i, 0, 0, 0], [1.0, 0, 0, 0], 0.0) for i in range(hw)]
        if self.vision.kind == "llava":
            rows = base
        elif tiles_hw is None:  # OneVision, a prompt of several images: the whole image and one newline
            rows = base + [([0, 0, 0, 0], [0.0] * 4, 1.0)]
        else:
            nph, npw = tiles_hw
            grid_r, grid_c = np.meshgrid(np.arange(nph * s), np.arange(npw * s), indexing="ij")
            index = (1 + (grid_r // s) * npw + grid_c // s) * hw + (grid_r % s) * s + grid_c % s
            keep_r, keep_c = _unpad(nph * s, npw * s, *image_size)
            index = index[keep_r, keep_c]
            h, w = index.shape
            ratio = math.sqrt(h * w / (self.vision.max_tiles * s * s)) if self.vision.max_tiles else 0.0
            rows = list(base)
            if ratio > 1.1:  # OneVision: resized to fit anyres_max_N tiles
                oh, ow = int(h // ratio), int(w // ratio)
                (rt, rw), (ct, cw) = _bilinear(h, oh), _bilinear(w, ow)
                for i in range(oh):
                    for j in range(ow):
                        taps = [index[rt[i, a], ct[j, b]] for a in range(2) for b in range(2)]
                        weights = [rw[i, a] * cw[j, b] for a in range(2) for b in range(2)]
                        rows.append((taps, weights, 0.0))
                    rows.append(([0, 0, 0, 0], [0.0] * 4, 1.0))
            else:
                for i in range(h):
                    rows.extend(([int(index[i, j]), 0, 0, 0], [1.0, 0, 0, 0], 0.0) for j in range(w))
                    rows.append(([0, 0, 0, 0], [0.0] * 4, 1.0))
        idx = np.array([r[0] for r in rows], np.int32)
        weights = np.array([r[1] for r in rows], np.float32)
        newline = np.array([r[2] for r in rows], np.float32)
        return idx, weights, newline

    def items(self, processed: dict, input_ids: Sequence[int]) -> list[EncoderItem]:
        pixels = np.asarray(processed["pixel_values"], np.float32)
        if self.vision.kind == "llava":
            pixels = pixels[:, None]
            sizes = [None] * len(pixels)
        else:
            sizes = [tuple(int(x) for x in hw) for hw in np.asarray(processed["image_sizes"]).reshape(-1, 2)]
        # OneVision tiles an image only where its sample holds one image (transformers' need_patching, from the
        # processor's batch_num_images: a chat's images are one sample, a flat list of images one sample each)
        counts = processed.get("batch_num_images")
        counts = [1] * len(pixels) if counts is None else [int(n) for n in np.asarray(counts).reshape(-1)]
        patched = [n == 1 for n in counts for _ in range(n)]
        items = []
        for tiles_all, size, patch in zip(pixels, sizes, patched):
            grid = None
            if size is not None and (patch or self.vision.kind != "onevision"):
                grid = self._tiles_of(*size)
            count = 1 if grid is None else 1 + grid[0] * grid[1]
            idx, weights, newline = self._gather(grid, size)
            arrays = {"pixel_values": tiles_all[:count], "idx": idx, "w": weights, "newline": newline}
            items.append(EncoderItem(arrays, count * self.per_tile, len(idx), meta={"tiles": count}))
        return items

    def max_image_patches(self) -> int:
        tiles = 1 + max((h // self.size) * (w // self.size) for h, w in self.vision.pinpoints) if self.vision.pinpoints else 1
        return tiles * self.per_tile

    def buckets(self, max_patches: int) -> list[int]:
        tiles = max(1, max_patches // self.per_tile)
        return [n * self.per_tile for n in ImageAdapter.buckets(self, tiles)]

    def rows_for(self, bucket: int) -> int:
        """Rows a bucket's tiles can yield at most: every feature row, and a newline per row of a tile grid."""
        tiles = bucket // self.per_tile
        return tiles * (self.hw + self.vision.side) + 1

    def batch(self, items: Sequence[EncoderItem], bucket: int) -> dict[str, np.ndarray]:
        tiles = bucket // self.per_tile
        rows = self.rows_for(bucket)
        out = {
            "pixel_values": np.zeros((tiles, self.channels, self.size, self.size), np.float32),
            "idx": np.zeros((rows, 4), np.int32), "w": np.zeros((rows, 4), np.float32), "newline": np.zeros(rows, np.float32),
        }  # fmt: skip
        at = r = 0
        for item in items:
            a = item.arrays
            n, m = item.meta["tiles"], item.num_rows
            out["pixel_values"][at : at + n] = a["pixel_values"]
            out["idx"][r : r + m] = a["idx"] + at * self.hw
            out["w"][r : r + m] = a["w"]
            out["newline"][r : r + m] = a["newline"]
            at += n
            r += m
        return out


LlavaForConditionalGeneration.IMAGES = LlavaImages

"""Pixtral's vision tower reading images, as transformers 5.24's PixtralVisionModel computes it, and the host side
every Pixtral-towered model shares (Mistral 3: models/vision/mistral3.py; Pixtral-12B: LLaVA with a Pixtral tower).

The tower: each image at its own resolution (the processor resizes it so both sides are multiples of patch x merge),
a bias-free patch convolution, an RMSNorm (`ln_pre`), then pre-norm layers (RMSNorm, attention without biases under
2-D RoPE over the patch's row and column, RMSNorm, a gated MLP). transformers concatenates a batch's images into one
sequence attending block-diagonally; so does the encoder here (common.segment_attention over the batch's segments).

The prompt: the processor expands each `[IMG]` to the image's token rows, each row of `[IMG]` tokens followed by
`[IMG_BREAK]`, the last one's break replaced by `[IMG_END]`. transformers puts the image's features at the `[IMG]`
tokens and embeds the breaks as text. Here an image's span runs from its first `[IMG]` to its last, breaks included
(ImageAdapter.placeholder_tokens): the encoder yields the span's rows in order, each break row the token's own
embedding, so the engine's spans stay contiguous and a break costs one cache row.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys
import types
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.layers import REFERENCE_ATTENTION, Linear, RMSNorm, activation, apply_rope, module_list
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.models.vision.common import (
    EncoderItem, ImageAdapter, MultimodalStep, VisionSpec, axial_rope, batch_attention, merge_embeddings,
    placeholder_ids, segment_call_patches,
)  # fmt: skip
from jaxpaged.models.vision.llava import LlavaForConditionalGeneration, LlavaProjector
from jaxpaged.models.vision.siglip import PatchEmbedding, patchify
from jaxpaged.models.weights import WeightSpec, linear_specs, norm_specs
from jaxpaged.pallas_kernels import AttentionBackend

EPS = 1e-5  # the tower's RMSNorms (transformers fixes it; the config has none)


@dataclasses.dataclass(frozen=True)
class PixtralVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    num_channels: int
    hidden_act: str
    rope_theta: float
    image_token_id: int
    feature_layer: int  # transformers' hidden_states index the projector reads (-1: the last layer's output)
    merge: int = 1  # Mistral 3's spatial_merge_size (Pixtral-12B: 1)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads  # (transformers derives it so, whatever the config says)

    @staticmethod
    def from_hf(hf_config, merge: int = 1) -> PixtralVisionConfig:
        v = hf_config.vision_config
        rope = dict(getattr(v, "rope_parameters", None) or {})
        layer = getattr(hf_config, "vision_feature_layer", -1)
        if not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer={layer}: several feature layers are not supported")
        return PixtralVisionConfig(
            hidden_size=int(v.hidden_size), intermediate_size=int(v.intermediate_size),
            num_layers=int(v.num_hidden_layers), num_heads=int(v.num_attention_heads), patch_size=int(v.patch_size),
            num_channels=int(getattr(v, "num_channels", 3)), hidden_act=str(v.hidden_act),
            rope_theta=float(rope.get("rope_theta", getattr(v, "rope_theta", 10000.0))),
            image_token_id=int(hf_config.image_token_id), feature_layer=int(layer), merge=merge,
        )  # fmt: skip


class PixtralAttention(nnx.Module):
    def __init__(self, cfg: PixtralVisionConfig, *, dtype):
        d = cfg.hidden_size
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (Linear(d, d, bias=False, dtype=dtype) for _ in range(4))
        self.num_heads = cfg.num_heads

    def __call__(self, x, rope, seg):
        n, d = x.shape
        split = lambda y: y.reshape(n, self.num_heads, d // self.num_heads)  # noqa: E731
        q, k = apply_rope(split(self.q_proj(x)), rope), apply_rope(split(self.k_proj(x)), rope)
        out = batch_attention(q, k, split(self.v_proj(x)), seg, (d // self.num_heads) ** -0.5)
        return self.o_proj(out.reshape(n, d))


class PixtralMLP(nnx.Module):
    def __init__(self, cfg: PixtralVisionConfig, *, dtype):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, f, bias=False, dtype=dtype)
        self.up_proj = Linear(d, f, bias=False, dtype=dtype)
        self.down_proj = Linear(f, d, bias=False, dtype=dtype)
        self.act = cfg.hidden_act

    def __call__(self, x):
        return self.down_proj(activation(self.act)(self.gate_proj(x)) * self.up_proj(x))


class PixtralLayer(nnx.Module):
    def __init__(self, cfg: PixtralVisionConfig, *, dtype):
        self.attention_norm = RMSNorm(cfg.hidden_size, eps=EPS, dtype=dtype)
        self.attention = PixtralAttention(cfg, dtype=dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, eps=EPS, dtype=dtype)
        self.feed_forward = PixtralMLP(cfg, dtype=dtype)

    def __call__(self, x, rope, seg):
        x = x + self.attention(self.attention_norm(x), rope, seg)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nnx.Module):
    def __init__(self, cfg: PixtralVisionConfig, *, dtype):
        self.layers = module_list([PixtralLayer(cfg, dtype=dtype) for _ in range(cfg.num_layers)])


class PixtralVisionModel(nnx.Module):
    """A batch of patches (PixtralImages.batch: [P, C * p * p], their (row, column) [P, 2], their image [P], -1 for
    padding) -> the hidden states [P, D] at the config's feature layer."""

    def __init__(self, cfg: PixtralVisionConfig, *, dtype):
        self.config = cfg
        self.patch_conv = PatchEmbedding(cfg.num_channels, cfg.hidden_size, cfg.patch_size, bias=False, dtype=dtype)
        self.ln_pre = RMSNorm(cfg.hidden_size, eps=EPS, dtype=dtype)
        self.transformer = PixtralTransformer(cfg, dtype=dtype)
        # transformers' axial frequencies: the head's inverse frequencies, even ones for rows, odd ones for columns
        inv = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim))
        self.inv_h, self.inv_w = tuple(float(f) for f in inv[0::2]), tuple(float(f) for f in inv[1::2])

    def __call__(self, patches, pos, seg):
        cfg = self.config
        x = self.ln_pre(self.patch_conv.embed_patches(patches))
        rope = axial_rope(pos, self.inv_h, self.inv_w)
        for layer in self.transformer.layers[: cfg.feature_layer % (cfg.num_layers + 1)]:
            x = layer(x, rope, seg)
        return x

    @staticmethod
    def weight_specs(cfg: PixtralVisionConfig, hf: str, ours: str) -> dict[str, WeightSpec]:
        specs = {f"{hf}.patch_conv.weight": WeightSpec(f"{ours}.patch_conv.weight")}
        specs |= norm_specs(f"{hf}.ln_pre", f"{ours}.ln_pre", bias=False)
        for i in range(cfg.num_layers):
            h, o = f"{hf}.transformer.layers.{i}", f"{ours}.transformer.layers.{i}"
            for norm in ("attention_norm", "ffn_norm"):
                specs |= norm_specs(f"{h}.{norm}", f"{o}.{norm}", bias=False)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                specs |= linear_specs(f"{h}.attention.{proj}", f"{o}.attention.{proj}", bias=False)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                specs |= linear_specs(f"{h}.feed_forward.{proj}", f"{o}.feed_forward.{proj}", bias=False)
        return specs


class PixtralEncoder:
    """What a port with a Pixtral `vision_tower` and `project(features [P, D], idx [rows, merge^2]) -> [rows, text D]`
    adds to its language model (a mixin before it): the encoder and the forward merging its rows."""

    @property
    def vision_spec(self) -> VisionSpec:
        return VisionSpec(self.config.option("vision").image_token_id, self.config.hidden_size)

    def encode(self, batch: dict) -> jax.Array:
        """A batch (PixtralImages.batch) -> [rows, 1, D]: each image's span in order, a break row the break token's
        embedding."""
        features = self.vision_tower(batch["patches"], batch["pos"], batch["seg"])
        rows = self.project(features, batch["idx"])
        token = batch["token"]
        text = self.embed_tokens(jnp.maximum(token, 0)).astype(rows.dtype)
        return jnp.where((token >= 0)[:, None], text, rows)[:, None, :]

    def forward(self, input_ids, positions, kv_cache, attn_metadata, mm: MultimodalStep | None = None):
        x = merge_embeddings(self.embed(placeholder_ids(input_ids, mm), positions), mm)
        x, new_kv = self.run_layers(x, positions, kv_cache, attn_metadata, self.layers)
        return self.final(x), new_kv


# -- the host side ----------------------------------------------------------------------------------


def pixtral_processor_class(cls=None):
    """transformers' PixtralProcessor (Mistral 3's and Pixtral-12B's), whatever class the folder's model type maps to.

    transformers 5.24 builds it only with torchvision: `transformers.PixtralProcessor` is a placeholder without it,
    and its module imports `get_resize_output_image_size` from the torchvision image processor's module (to count
    tokens in `_get_num_multimodal_tokens`, which images never call here). Without torchvision the module is imported
    with that one name taken from the Pillow image processor's module, which holds the same function; the class, its
    placeholder expansion and the chat template are transformers' own."""
    try:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
    except ImportError:
        from transformers.models.pixtral import image_processing_pil_pixtral as pil

        name = "transformers.models.pixtral.image_processing_pixtral"
        stand_in = types.ModuleType(name)
        stand_in.get_resize_output_image_size = pil.get_resize_output_image_size
        saved = sys.modules.get(name)
        sys.modules[name] = stand_in
        try:
            module = importlib.import_module("transformers.models.pixtral.processing_pixtral")
            PixtralProcessor = module.PixtralProcessor
        finally:
            if saved is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = saved
    return PixtralProcessor


class PixtralImages(ImageAdapter):
    """Images of any size: each one's patches, their grid positions, and the gather that makes its span's rows
    (merge x merge patches per token, a break row after each token row but the last); buckets count patches in
    multiples of merge^2."""

    processor_class = staticmethod(pixtral_processor_class)

    def __init__(self, hf_config, spec: VisionSpec):
        super().__init__(hf_config, spec)
        v = hf_config.vision_config
        self.patch, self.channels = int(v.patch_size), int(getattr(v, "num_channels", 3))
        self.merge = int(getattr(hf_config, "spatial_merge_size", 1) or 1)
        self.unit = self.merge * self.merge
        self.features = self.channels * self.patch * self.patch
        self.break_id = -1
        self.longest = int(getattr(v, "image_size", 1024))

    SETTINGS = ImageAdapter.SETTINGS + ("size",)  # {"longest_edge": N}: images resized to fit it

    def configure(self, processor, settings: dict | None = None) -> None:
        super().configure(processor, settings)
        self.break_id = int(processor.image_break_token_id)
        merge = int(getattr(processor, "spatial_merge_size", 1) or 1)
        if int(processor.patch_size) != self.patch or merge != self.merge:
            raise ValueError(f"the processor's patch_size {processor.patch_size} and spatial_merge_size {merge} "
                             f"differ from the model's ({self.patch}, {self.merge})")  # fmt: skip
        size = self.settings.get("size") or getattr(processor.image_processor, "size", None) or {}
        get = size.get if isinstance(size, dict) else lambda name: getattr(size, name, None)
        self.longest = int(get("longest_edge") or get("height") or self.longest)

    def placeholder_tokens(self) -> tuple[int, ...]:
        return (self.spec.image_token_id, self.break_id)

    def items(self, processed: dict, input_ids: Sequence[int]) -> list[EncoderItem]:
        pixels = np.asarray(processed["pixel_values"], np.float32)
        sizes = np.asarray(processed["image_sizes"]).reshape(-1, 2)
        p, m = self.patch, self.merge
        items = []
        for image, (height, width) in zip(pixels, sizes.tolist()):
            gh, gw = height // p, width // p  # the patch grid (the conv's output, cropped to the image)
            th, tw = gh // m, gw // m  # token rows and columns
            patches = patchify(image[None, :, : gh * p, : gw * p], p)[0]
            rr, cc = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
            pos = np.stack([rr.reshape(-1), cc.reshape(-1)], -1)
            # token (r, c) concatenates patches (r m + i, c m + j), i and j in range(m), as transformers' unfold
            r, c, i, j = np.meshgrid(np.arange(th), np.arange(tw), np.arange(m), np.arange(m), indexing="ij")
            idx = ((r * m + i) * gw + c * m + j).reshape(th, tw, m * m)
            idx = np.concatenate([idx, np.zeros((th, 1, m * m), idx.dtype)], 1).reshape(-1, m * m)[:-1]
            token = np.concatenate([np.full((th, tw), -1), np.full((th, 1), self.break_id)], 1).reshape(-1)[:-1]
            arrays = {"patches": patches.astype(np.float32), "pos": pos.astype(np.int32), "idx": idx.astype(np.int32),
                      "token": token.astype(np.int32)}  # fmt: skip
            items.append(EncoderItem(arrays, gh * gw, len(token)))
        return items

    def max_image_patches(self) -> int:
        """A square image at the processor's longest edge: its side rounded up to whole tokens."""
        side = math.ceil(self.longest / (self.patch * self.merge)) * self.merge
        return side * side

    def call_patches(self, items, largest_bucket: int) -> int:
        return segment_call_patches(self, items, largest_bucket)

    def buckets(self, max_patches: int) -> list[int]:
        return [n * self.unit for n in ImageAdapter.buckets(self, -(-max_patches // self.unit))]

    def rows_for(self, bucket: int) -> int:
        """Every token of the bucket's patches, and as many break rows at most."""
        return 2 * (bucket // self.unit)

    def batch(self, items: Sequence[EncoderItem], bucket: int) -> dict[str, np.ndarray]:
        rows = self.rows_for(bucket)
        out = {
            "patches": np.zeros((bucket, self.features), np.float32), "pos": np.zeros((bucket, 2), np.int32),
            "seg": np.full(bucket, -1, np.int32), "idx": np.zeros((rows, self.unit), np.int32),
            "token": np.full(rows, -1, np.int32),
        }  # fmt: skip
        at = r = 0
        for i, item in enumerate(items):
            a = item.arrays
            n, k = item.num_patches, item.num_rows
            out["patches"][at : at + n] = a["patches"]
            out["pos"][at : at + n] = a["pos"]
            out["seg"][at : at + n] = i
            out["idx"][r : r + k] = a["idx"] + at
            out["token"][r : r + k] = a["token"]
            at += n
            r += k
        return out


class PixtralLlavaForConditionalGeneration(PixtralEncoder, LlavaForConditionalGeneration):
    """Pixtral-12B as transformers loads it (`LlavaForConditionalGeneration` with a `pixtral` vision_config): the
    Pixtral tower read at `vision_feature_layer` with every patch (strategy "full"), LLaVA's projector, no merge, a
    Mistral language model (LlavaForConditionalGeneration.port_for picks this class)."""

    SKIPPED_TENSORS = (ROTARY_CACHE,)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        LlamaForCausalLM.__init__(self, cfg, dtype=dtype, attention=attention)
        vision: PixtralVisionConfig = cfg.option("vision")
        bias, act = cfg.option("projector")
        self.vision_tower = PixtralVisionModel(vision, dtype=dtype)
        self.multi_modal_projector = LlavaProjector(vision.hidden_size, cfg.hidden_size, bias=bias, act=act,
                                                    dtype=dtype)  # fmt: skip

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        strategy = getattr(hf_config, "vision_feature_select_strategy", "full")
        if strategy != "full":
            raise ValueError(f"vision_feature_select_strategy={strategy!r} with a Pixtral tower: only 'full' (every "
                             "patch) is supported, as Pixtral-12B's config sets it")  # fmt: skip
        cfg = LlamaForCausalLM.config_from_hf(hf_config, "LlamaForCausalLM")
        projector = (bool(getattr(hf_config, "multimodal_projector_bias", True)), str(hf_config.projector_hidden_act))
        options = dict(cfg.options, vision=PixtralVisionConfig.from_hf(hf_config), projector=projector)
        return dataclasses.replace(cfg, architecture=architecture, options=tuple(sorted(options.items())))

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        bias, _ = cfg.option("projector")
        specs = LlamaForCausalLM.weight_specs(cfg)
        specs |= PixtralVisionModel.weight_specs(cfg.option("vision"), "vision_tower", "vision_tower")
        for name in ("linear_1", "linear_2"):
            specs |= linear_specs(f"multi_modal_projector.{name}", f"multi_modal_projector.{name}", bias=bias)
        return specs

    def project(self, features, idx):
        return self.multi_modal_projector(features[idx[:, 0]])


PixtralLlavaForConditionalGeneration.IMAGES = PixtralImages

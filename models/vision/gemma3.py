"""Gemma 3 reading images, as transformers 5.24's Gemma3ForConditionalGeneration computes it: SigLIP's vision
transformer over each image (resized by the processor to the tower's size), the multimodal projector (average
pooling of the patch grid down to mm_tokens_per_image, Gemma's RMSNorm, a projection to the text width), and the
language model of models/gemma.py with the image's soft tokens in place of their embeddings (not scaled by
sqrt(hidden_size), as transformers merges them after embedding). In prefill an image's tokens attend to each other
both ways (AttentionMetadata.key_ends; sliding layers keep their window's lower bound: transformers' AND(window,
OR(causal, block))); generated tokens are causal.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jaxpaged.models import gemma
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.gemma import GemmaRMSNorm
from jaxpaged.models.layers import REFERENCE_ATTENTION, _param
from jaxpaged.models.vision.common import (
    MultimodalStep, SameSizeImages, VisionSpec, merge_embeddings, placeholder_ids,
)  # fmt: skip
from jaxpaged.models.vision.siglip import VisionTransformer, ViTConfig
from jaxpaged.models.weights import WeightSpec
from jaxpaged.pallas_kernels import AttentionBackend

SIGLIP_HEAD = (
    r"^vision_tower\.head\.",
    "SigLIP's attention-pooling head: Gemma 3 projects the last hidden states, never the pooled output",
)


@dataclasses.dataclass(frozen=True)
class Gemma3VisionConfig:
    tower: ViTConfig
    mm_tokens_per_image: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int

    @property
    def pool(self) -> int:
        """The average pool's kernel (and stride) over the patch grid."""
        side = self.tower.image_size // self.tower.patch_size
        return side // int(round(self.mm_tokens_per_image**0.5))


class Gemma3Projector(nnx.Module):
    def __init__(self, cfg: Gemma3VisionConfig, text_hidden: int, *, dtype):
        d = cfg.tower.hidden_size
        self.mm_input_projection_weight = _param((d, text_hidden), dtype)
        self.mm_soft_emb_norm = GemmaRMSNorm(d, eps=cfg.tower.layer_norm_eps, dtype=dtype)
        self.side = cfg.tower.image_size // cfg.tower.patch_size
        self.pool = cfg.pool

    def __call__(self, x):
        """[B, N, D] patch features -> [B, tokens, text hidden]."""
        b, _, d = x.shape
        k, side = self.pool, self.side
        grid = x.reshape(b, side // k, k, side // k, k, d)
        pooled = jnp.mean(grid.astype(jnp.float32), axis=(2, 4)).astype(x.dtype).reshape(b, -1, d)
        normed = self.mm_soft_emb_norm(pooled)
        prec = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
        w = self.mm_input_projection_weight[...]
        return jnp.einsum("btd,de->bte", normed, w, precision=prec, preferred_element_type=jnp.float32).astype(x.dtype)


class Gemma3ForConditionalGeneration(gemma.Gemma3ForConditionalGeneration):
    """The language model of models/gemma.py with SigLIP and the projector: images in prompts."""

    CHECKPOINT_RENAMES = gemma.Gemma3ForConditionalGeneration.CHECKPOINT_RENAMES + (
        (r"^(model\.)?vision_tower\.vision_model\.", "vision_tower."),  # the 4.x spelling, as published
        (r"^model\.vision_tower\.", "vision_tower."),
        (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
    )  # fmt: skip
    SKIPPED_TENSORS = (ROTARY_CACHE, SIGLIP_HEAD)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        super().__init__(cfg, dtype=dtype, attention=attention)
        vision: Gemma3VisionConfig = cfg.option("vision")
        self.vision_tower = VisionTransformer(vision.tower, dtype=dtype)
        self.multi_modal_projector = Gemma3Projector(vision, cfg.hidden_size, dtype=dtype)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        cfg = gemma.GemmaForCausalLM.config_from_hf(hf_config, architecture)
        vision = Gemma3VisionConfig(
            tower=ViTConfig.from_hf(hf_config.vision_config), mm_tokens_per_image=int(hf_config.mm_tokens_per_image),
            image_token_id=int(hf_config.image_token_id), boi_token_id=int(hf_config.boi_token_id),
            eoi_token_id=int(hf_config.eoi_token_id),
        )  # fmt: skip
        side = vision.tower.image_size // vision.tower.patch_size
        tokens_side = int(round(vision.mm_tokens_per_image**0.5))
        if tokens_side**2 != vision.mm_tokens_per_image or side % tokens_side:
            raise ValueError(f"mm_tokens_per_image={vision.mm_tokens_per_image} must be a square whose side divides the "
                             f"patch grid's ({side})")  # fmt: skip
        return dataclasses.replace(cfg, options=tuple(sorted(dict(cfg.options, vision=vision).items())))

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        vision: Gemma3VisionConfig = cfg.option("vision")
        specs = gemma.GemmaForCausalLM.weight_specs(cfg)
        specs |= VisionTransformer.weight_specs(vision.tower, "vision_tower", "vision_tower")
        for name in ("mm_input_projection_weight", "mm_soft_emb_norm.weight"):
            ours = name.replace("mm_soft_emb_norm.weight", "mm_soft_emb_norm.scale")
            specs[f"multi_modal_projector.{name}"] = WeightSpec(f"multi_modal_projector.{ours}")
        return specs

    # -- images ---------------------------------------------------------------------------------

    @property
    def vision_spec(self) -> VisionSpec:
        vision = self.config.option("vision")
        return VisionSpec(vision.image_token_id, self.config.hidden_size, bidirectional=True)

    def encode(self, batch: dict) -> jax.Array:
        """{"pixel_values": [B, C, S, S]} -> [B * tokens, 1, D]: each image's soft tokens, image after image."""
        features = self.multi_modal_projector(self.vision_tower(batch["pixel_values"]))
        return features.reshape(-1, 1, features.shape[-1])

    def forward(self, input_ids, positions, kv_cache, attn_metadata, mm: MultimodalStep | None = None):
        x = merge_embeddings(self.embed(placeholder_ids(input_ids, mm), positions), mm)
        x, new_kv = self.run_layers(x, positions, kv_cache, attn_metadata, self.layers)
        return self.final(x), new_kv


class Gemma3Images(SameSizeImages):
    """Every image is resized to the tower's size: one patch count, so the buckets count images."""

    def __init__(self, hf_config, spec: VisionSpec):
        super().__init__(hf_config, spec)
        vision = hf_config.vision_config
        self.image_size, patch = int(vision.image_size), int(vision.patch_size)
        self.channels = int(getattr(vision, "num_channels", 3))
        self.tokens = int(hf_config.mm_tokens_per_image)
        self.patches = (self.image_size // patch) ** 2


Gemma3ForConditionalGeneration.IMAGES = Gemma3Images

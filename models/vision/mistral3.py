"""Mistral 3 reading images (Mistral Small 3.1/3.2, Magistral, Devstral, Ministral 3), as transformers 5.24's
Mistral3ForConditionalGeneration computes it: the Pixtral tower (models/vision/pixtral.py) read at
`vision_feature_layer`, then the projector: an RMSNorm (the text model's eps), the patch merger (each token's
spatial_merge_size x spatial_merge_size patches concatenated feature-major, as torch's unfold lays them out, then
`merging_layer`), and LLaVA's linear_1 -> activation -> linear_2; the language model of models/mistral3.py.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx
from jaxpaged.models import mistral3
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.layers import REFERENCE_ATTENTION, Linear, RMSNorm
from jaxpaged.models.vision.llava import LlavaProjector
from jaxpaged.models.vision.pixtral import PixtralEncoder, PixtralImages, PixtralVisionConfig, PixtralVisionModel
from jaxpaged.models.weights import WeightSpec, linear_specs
from jaxpaged.pallas_kernels import AttentionBackend


class Mistral3PatchMerger(nnx.Module):
    def __init__(self, features: int, merge: int, *, dtype):
        self.merging_layer = Linear(features * merge * merge, features, bias=False, dtype=dtype)

    def __call__(self, x, idx):
        """x [P, D] patch features, idx [rows, merge^2] each token's patches -> [rows, D]."""
        taps = x[idx]  # [rows, merge^2, D]
        return self.merging_layer(jnp.swapaxes(taps, 1, 2).reshape(idx.shape[0], -1))  # (D, i, j) as unfold's


class Mistral3Projector(LlavaProjector):
    def __init__(self, vision: PixtralVisionConfig, text_hidden: int, *, bias: bool, act: str, eps: float, dtype):
        super().__init__(vision.hidden_size, text_hidden, bias=bias, act=act, dtype=dtype)
        self.norm = RMSNorm(vision.hidden_size, eps=eps, dtype=dtype)
        self.patch_merger = Mistral3PatchMerger(vision.hidden_size, vision.merge, dtype=dtype)

    def __call__(self, features, idx):
        return super().__call__(self.patch_merger(self.norm(features), idx))


class Mistral3ForConditionalGeneration(PixtralEncoder, mistral3.Mistral3ForConditionalGeneration):
    """Mistral 3's language model with the Pixtral tower and its projector: images in prompts."""

    CHECKPOINT_RENAMES = mistral3.Mistral3ForConditionalGeneration.CHECKPOINT_RENAMES + (
        (r"^model\.vision_tower\.", "vision_tower."),
        (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
    )  # fmt: skip
    SKIPPED_TENSORS = (ROTARY_CACHE,)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        super().__init__(cfg, dtype=dtype, attention=attention)
        vision: PixtralVisionConfig = cfg.option("vision")
        bias, act = cfg.option("projector")
        self.vision_tower = PixtralVisionModel(vision, dtype=dtype)
        self.multi_modal_projector = Mistral3Projector(vision, cfg.hidden_size, bias=bias, act=act,
                                                       eps=cfg.rms_norm_eps, dtype=dtype)  # fmt: skip

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        cfg = mistral3.Mistral3ForConditionalGeneration.config_from_hf(hf_config, architecture)
        vision = PixtralVisionConfig.from_hf(hf_config, merge=int(hf_config.spatial_merge_size))
        projector = (bool(getattr(hf_config, "multimodal_projector_bias", False)), str(hf_config.projector_hidden_act))
        options = dict(cfg.options, vision=vision, projector=projector)
        return dataclasses.replace(cfg, options=tuple(sorted(options.items())))

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        bias, _ = cfg.option("projector")
        specs = mistral3.Mistral3ForConditionalGeneration.weight_specs(cfg)
        specs |= PixtralVisionModel.weight_specs(cfg.option("vision"), "vision_tower", "vision_tower")
        hf = "multi_modal_projector"
        specs[f"{hf}.norm.weight"] = WeightSpec(f"{hf}.norm.scale")
        specs |= linear_specs(f"{hf}.patch_merger.merging_layer", f"{hf}.patch_merger.merging_layer", bias=False)
        for name in ("linear_1", "linear_2"):
            specs |= linear_specs(f"{hf}.{name}", f"{hf}.{name}", bias=bias)
        return specs

    def project(self, features, idx):
        return self.multi_modal_projector(features, idx)


Mistral3ForConditionalGeneration.IMAGES = PixtralImages

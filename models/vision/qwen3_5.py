"""Qwen3.5 reading images (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`), as transformers
5.24 computes it: Qwen3-VL's vision tower without DeepStack (models/vision/qwen_vl.py: a learned position grid
resampled to each image, every block attending across the image, the 2x2 patch merger) under the hybrid language
model of Qwen3-Next/Qwen3.5 (models/qwen3_next.py: Gated DeltaNet layers with a state per sequence beside gated
attention layers), whose attention layers take interleaved M-RoPE (models/vision/mrope.py) over their partial rotary
width. The host side (processor outputs -> encoder items, 3-D positions) is Qwen-VL's (QwenImages).

The image's embeddings replace its placeholder tokens' before the first layer; the linear layers then run over them
like any token, so a prompt cut anywhere (chunked prefill through an image's span) carries their states on.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.config import ModelConfig, text_config
from jaxpaged.models.layers import REFERENCE_ATTENTION
from jaxpaged.models.qwen3_next import MTP, Qwen3NextForCausalLM
from jaxpaged.models.vision.common import MultimodalStep, VisionSpec, merge_embeddings, placeholder_ids
from jaxpaged.models.vision.mrope import mrope_axes, mrope_rope, mrope_sections
from jaxpaged.models.vision.qwen_vl import QwenImages, QwenVisionConfig, Qwen3VisionTransformer, qwen3_vision_specs
from jaxpaged.models.weights import WeightSpec
from jaxpaged.pallas_kernels import AttentionBackend

DEFAULT_SECTIONS = (11, 11, 10)  # transformers' Qwen3_5TextRotaryEmbedding where rope_parameters name none


class Qwen3_5ForConditionalGeneration(Qwen3NextForCausalLM):
    """The hybrid language model (`model.language_model.*`) and the vision tower (`model.visual.*`)."""

    CHECKPOINT_RENAMES = ((r"^model\.language_model\.", "model."), (r"^model\.visual\.", "visual."))
    SKIPPED_TENSORS = (ROTARY_CACHE, MTP)
    IMAGES = QwenImages

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        super().__init__(cfg, dtype=dtype, attention=attention)
        self.visual = Qwen3VisionTransformer(cfg.option("vision"), dtype=dtype)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        cfg = Qwen3NextForCausalLM.config_from_hf(hf_config, architecture)
        sections, _ = mrope_sections(text_config(hf_config), default=DEFAULT_SECTIONS)
        rotary = cfg.rotary_dim or cfg.head_dim
        axes = tuple(int(a) for a in mrope_axes(sections, True, n=rotary // 2))
        options = dict(cfg.options, vision=QwenVisionConfig.from_hf(hf_config), mrope_axes=axes)
        return dataclasses.replace(cfg, options=tuple(sorted(options.items())))

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        return Qwen3NextForCausalLM.weight_specs(cfg) | qwen3_vision_specs(cfg.option("vision"))

    @property
    def vision_spec(self) -> VisionSpec:
        return VisionSpec(self.config.option("vision").image_token_id, self.config.hidden_size, mrope=True)

    def encode(self, batch: dict) -> jax.Array:
        """A batch (QwenImages.batch) -> [rows, 1, D]: the merger's output, each image's merge units in order."""
        return self.visual(batch)[batch["out"]]

    def forward(self, input_ids, positions, kv_cache, attn_metadata, mm: MultimodalStep | None = None):
        x = merge_embeddings(self.embed(placeholder_ids(input_ids, mm), positions), mm)
        rope = mrope_rope(self, positions, mm)
        x, update = self.run_layers(x, positions, kv_cache, attn_metadata, self.layers, rope=rope)
        return self.final(x), update

"""Qwen2.5-VL reading images, as transformers 5.24's Qwen2_5_VLForConditionalGeneration computes it.

The vision transformer: a Conv3d patch embedding (each image's patches as the processor flattens them, merge units
of 2x2 patches contiguous), 2-D rotary positions (h, w), RMSNorm pre-norm blocks attending within windows of
`window_size` pixels except the `fullatt_block_indexes` blocks, which attend across the whole image, and the patch
merger (RMSNorm, 2x2 patches concatenated, a GELU MLP) giving one embedding per merge unit. The language model is
Qwen2 (models/llama.py) with M-RoPE (models/vision/mrope.py: 3-D positions for image tokens). Qwen3-VL's tower (a
learned position grid, DeepStack) also reads Qwen3.5's images (models/vision/qwen3_5.py).

Static shapes for the encoder (models/vision/common.py: ImageAdapter): the host lays each image out in transformers'
window order with every window padded to its full size (ws^2 merge units, ws = window_size / merge / patch), so a
batch is a multiple of one window's patches: windowed blocks attend within fixed blocks, full blocks across the
image (a segment mask, queries taken in chunks so no [P, P] matrix is made), padding masked out; the output rows go
back to the image's merge-unit order through an index the host computed (transformers' argsort of window_index).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.config import ModelConfig, model_config_from_hf, text_config
from jaxpaged.models.layers import (
    REFERENCE_ATTENTION, Embedding, LayerNorm, Linear, RMSNorm, _param, activation, module_list,
)  # fmt: skip
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.models.vision.common import (
    EncoderItem, ImageAdapter, MultimodalStep, VisionSpec, axial_rope, batch_attention, images_only, in_prompt_order,
    merge_embeddings, placeholder_ids, segment_attention, segment_call_patches,
)  # fmt: skip
from jaxpaged.models.vision.mrope import mrope_axes, mrope_rope, mrope_sections, rope_index
from jaxpaged.models.weights import WeightSpec, linear_specs
from jaxpaged.pallas_kernels import AttentionBackend, stack_new_kv

@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    merge: int  # spatial_merge_size
    temporal_patch_size: int
    in_channels: int
    out_hidden_size: int
    hidden_act: str
    rope_theta: float
    window_size: int  # pixels; 0: no windows (every block attends across the image)
    fullatt_blocks: tuple[int, ...]
    image_token_id: int
    kind: str = "qwen2_5"  # "qwen3": LayerNorm blocks, a learned position grid, DeepStack mergers, no windows
    num_position_embeddings: int = 0  # Qwen3-VL: the learned (square) position grid, resampled to each image
    deepstack: tuple[int, ...] = ()  # Qwen3-VL: the blocks whose output a DeepStack merger reads

    @property
    def window_units(self) -> int:
        """Merge units per window side (transformers' vit_merger_window_size); 0: no windows."""
        return self.window_size // self.merge // self.patch_size if self.window_size else 0

    @property
    def window_patches(self) -> int:
        """Patches in one padded window: the step every layout is a multiple of."""
        return max(1, self.window_units) ** 2 * self.merge**2

    @staticmethod
    def from_hf(hf_config) -> QwenVisionConfig:
        v = hf_config.vision_config
        rope = dict(getattr(v, "rope_parameters", None) or {})
        return QwenVisionConfig(
            depth=int(v.depth), hidden_size=int(v.hidden_size), intermediate_size=int(v.intermediate_size),
            num_heads=int(v.num_heads), patch_size=int(v.patch_size), merge=int(v.spatial_merge_size),
            temporal_patch_size=int(v.temporal_patch_size), in_channels=int(getattr(v, "in_channels", 3)),
            out_hidden_size=int(v.out_hidden_size), hidden_act=str(v.hidden_act),
            rope_theta=float(rope.get("rope_theta", 10000.0)), window_size=int(getattr(v, "window_size", 0) or 0),
            fullatt_blocks=tuple(int(i) for i in getattr(v, "fullatt_block_indexes", ()) or ()),
            image_token_id=int(hf_config.image_token_id),
            # the learned position grid marks Qwen3-VL's tower, which Qwen3.5's is less DeepStack
            kind="qwen3" if getattr(v, "num_position_embeddings", None) else "qwen2_5",
            num_position_embeddings=int(getattr(v, "num_position_embeddings", 0) or 0),
            deepstack=tuple(int(i) for i in getattr(v, "deepstack_visual_indexes", ()) or ()),
        )  # fmt: skip


def _precision(x):
    return jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class _QKV(nnx.Module):
    def __init__(self, d: int, *, dtype):
        self.qkv = Linear(d, 3 * d, bias=True, dtype=dtype)
        self.proj = Linear(d, d, bias=True, dtype=dtype)


class _GatedMLP(nnx.Module):
    def __init__(self, d: int, inner: int, *, dtype):
        self.gate_proj = Linear(d, inner, bias=True, dtype=dtype)
        self.up_proj = Linear(d, inner, bias=True, dtype=dtype)
        self.down_proj = Linear(inner, d, bias=True, dtype=dtype)


class _NoParams(nnx.Module):
    """A checkpoint's parameterless module (the merger's GELU at mlp.1), so indices match the checkpoint's."""


class QwenVisionBlock(nnx.Module):
    def __init__(self, cfg: QwenVisionConfig, *, dtype):
        d = cfg.hidden_size
        self.norm1 = RMSNorm(d, eps=1e-6, dtype=dtype)
        self.norm2 = RMSNorm(d, eps=1e-6, dtype=dtype)
        self.attn = _QKV(d, dtype=dtype)
        self.mlp = _GatedMLP(d, cfg.intermediate_size, dtype=dtype)
        self.num_heads, self.act = cfg.num_heads, cfg.hidden_act

    def attention(self, x, cos, sin, seg, block: int):
        """block > 0: windows of `block` consecutive rows; 0: across each image (seg)."""
        n, d = x.shape
        h = self.num_heads
        qkv = self.attn.qkv(x).reshape(n, 3, h, d // h)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        c, s = cos[:, None, :], sin[:, None, :]
        q = (q.astype(jnp.float32) * c + rotate_half(q.astype(jnp.float32)) * s).astype(x.dtype)
        k = (k.astype(jnp.float32) * c + rotate_half(k.astype(jnp.float32)) * s).astype(x.dtype)
        scale = (d // h) ** -0.5
        if block:
            w = n // block
            windows = jax.vmap(segment_attention, in_axes=(0, 0, 0, 0, 0, None))
            seg_w = seg.reshape(w, block)
            out = windows(q.reshape(w, block, h, -1), k.reshape(w, block, h, -1), v.reshape(w, block, h, -1), seg_w, seg_w, scale)
            out = out.reshape(n, h, -1)
        else:
            out = batch_attention(q, k, v, seg, scale)
        return self.attn.proj(out.reshape(n, d))

    def __call__(self, x, cos, sin, seg, block: int):
        x = x + self.attention(self.norm1(x), cos, sin, seg, block)
        y = self.norm2(x)
        return x + self.mlp.down_proj(activation(self.act)(self.mlp.gate_proj(y)) * self.mlp.up_proj(y))


class QwenPatchMerger(nnx.Module):
    def __init__(self, cfg: QwenVisionConfig, *, dtype):
        wide = cfg.hidden_size * cfg.merge**2
        self.ln_q = RMSNorm(cfg.hidden_size, eps=1e-6, dtype=dtype)
        self.mlp = module_list([Linear(wide, wide, bias=True, dtype=dtype), _NoParams(),
                                Linear(wide, cfg.out_hidden_size, bias=True, dtype=dtype)])  # fmt: skip
        self.wide = wide

    def __call__(self, x):
        y = self.ln_q(x).reshape(-1, self.wide)
        return self.mlp[2](jax.nn.gelu(self.mlp[0](y), approximate=False))


class _Conv(nnx.Module):
    def __init__(self, shape, *, bias: bool, dtype):
        self.weight = _param(shape, dtype)  # as stored: [out, C, T, p, p]
        self.bias = _param(shape[:1], dtype) if bias else None


class _PatchEmbed(nnx.Module):
    """A Conv3d whose kernel equals its stride, as a matmul over the processor's flattened patches (C, T, p, p)."""

    def __init__(self, shape, *, bias: bool, dtype):
        self.proj = _Conv(shape, bias=bias, dtype=dtype)

    def __call__(self, patches):
        w = self.proj.weight[...]
        patches = patches.astype(w.dtype)
        y = jnp.einsum("pk,ok->po", patches, w.reshape(w.shape[0], -1), precision=_precision(patches),
                       preferred_element_type=jnp.float32).astype(w.dtype)  # fmt: skip
        return y if self.proj.bias is None else y + self.proj.bias[...]


class QwenVisionTransformer(nnx.Module):
    """Qwen2.5-VL's vision tower over a batch laid out by QwenImages.batch."""

    def __init__(self, cfg: QwenVisionConfig, *, dtype):
        self.config = cfg
        shape = (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed = _PatchEmbed(shape, bias=False, dtype=dtype)
        self.blocks = module_list([QwenVisionBlock(cfg, dtype=dtype) for _ in range(cfg.depth)])
        self.merger = QwenPatchMerger(cfg, dtype=dtype)
        head_dim = cfg.hidden_size // cfg.num_heads
        spatial = head_dim // 2
        self.inv_freq = tuple(float(f) for f in 1.0 / (cfg.rope_theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial)))

    def rotary(self, pos):
        """pos [P, 2] (h, w) -> (cos, sin) [P, head_dim]: the same frequencies for h and w."""
        return axial_rope(pos, self.inv_freq, self.inv_freq)

    def __call__(self, batch: dict) -> jax.Array:
        """-> the merger's output [P / merge^2, out_hidden] in the batch's layout."""
        cfg = self.config
        x = self.patch_embed(batch["patches"])
        cos, sin = self.rotary(batch["pos"])
        seg = batch["seg"]
        window = cfg.window_patches if cfg.window_units else 0
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, seg, 0 if i in cfg.fullatt_blocks or not window else window)
        return self.merger(x)


class _FC2(nnx.Module):
    """Qwen3-VL's MLPs: linear_fc1 -> activation -> linear_fc2."""

    def __init__(self, d_in: int, inner: int, d_out: int, act: str, *, dtype):
        self.linear_fc1 = Linear(d_in, inner, bias=True, dtype=dtype)
        self.linear_fc2 = Linear(inner, d_out, bias=True, dtype=dtype)
        self.act = act

    def __call__(self, x):
        return self.linear_fc2(activation(self.act)(self.linear_fc1(x)))


class Qwen3VisionBlock(QwenVisionBlock):
    """Qwen2.5-VL's block with LayerNorms and a plain GELU MLP."""

    def __init__(self, cfg: QwenVisionConfig, *, dtype):
        d = cfg.hidden_size
        self.norm1 = LayerNorm(d, eps=1e-6, dtype=dtype)
        self.norm2 = LayerNorm(d, eps=1e-6, dtype=dtype)
        self.attn = _QKV(d, dtype=dtype)
        self.mlp = _FC2(d, cfg.intermediate_size, d, cfg.hidden_act, dtype=dtype)
        self.num_heads, self.act = cfg.num_heads, cfg.hidden_act

    def __call__(self, x, cos, sin, seg, block: int):
        x = x + self.attention(self.norm1(x), cos, sin, seg, block)
        return x + self.mlp(self.norm2(x))


class Qwen3Merger(nnx.Module):
    """The patch merger (LayerNorm before the 2x2 concatenation) or, post_shuffle, a DeepStack merger (after it)."""

    def __init__(self, cfg: QwenVisionConfig, *, post_shuffle: bool, dtype):
        wide = cfg.hidden_size * cfg.merge**2
        self.norm = LayerNorm(wide if post_shuffle else cfg.hidden_size, eps=1e-6, dtype=dtype)
        self.mlp = _FC2(wide, wide, cfg.out_hidden_size, "gelu", dtype=dtype)
        self.wide, self.post_shuffle = wide, post_shuffle

    def __call__(self, x):
        y = self.norm(x.reshape(-1, self.wide)) if self.post_shuffle else self.norm(x).reshape(-1, self.wide)
        return self.mlp(y)


class Qwen3VisionTransformer(QwenVisionTransformer):
    """Qwen3-VL's vision tower: every block attends across the image; a learned position grid resampled
    (bilinearly, by weights the host computes) to each image's; DeepStack mergers on some blocks' outputs."""

    def __init__(self, cfg: QwenVisionConfig, *, dtype):
        self.config = cfg
        shape = (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed = _PatchEmbed(shape, bias=True, dtype=dtype)
        self.pos_embed = Embedding(cfg.num_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.blocks = module_list([Qwen3VisionBlock(cfg, dtype=dtype) for _ in range(cfg.depth)])
        self.merger = Qwen3Merger(cfg, post_shuffle=False, dtype=dtype)
        self.deepstack_merger_list = module_list([Qwen3Merger(cfg, post_shuffle=True, dtype=dtype) for _ in cfg.deepstack])
        head_dim = cfg.hidden_size // cfg.num_heads
        spatial = head_dim // 2
        self.inv_freq = tuple(float(f) for f in 1.0 / (cfg.rope_theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial)))

    def __call__(self, batch: dict) -> jax.Array:
        """-> [P / merge^2, 1 + DeepStack levels, out_hidden]: the merger's output, then each DeepStack merger's."""
        cfg = self.config
        x = self.patch_embed(batch["patches"])
        table = self.pos_embed.embedding[...]
        pos = jnp.sum(table[batch["interp_idx"]].astype(jnp.float32) * batch["interp_w"][..., None], axis=1)
        x = x + pos.astype(x.dtype)
        cos, sin = self.rotary(batch["pos"])
        seg = batch["seg"]
        levels = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, seg, 0)
            if i in cfg.deepstack:
                levels.append(self.deepstack_merger_list[cfg.deepstack.index(i)](x))
        return jnp.stack([self.merger(x), *levels], axis=1)


def bilinear_taps(rows: np.ndarray, cols: np.ndarray, height: int, width: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """([N, 4] indices into a side x side table, [N, 4] weights): bilinear resampling with align_corners, as
    transformers' get_vision_interpolation_indices_and_weights, for patches at (rows, cols) of a height x width grid."""

    def axis(index, size):
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(src)
        taps = floor.astype(np.int64)[:, None] + np.arange(2)
        weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0, None)
        return np.clip(taps, 0, side - 1), weights.astype(np.float32)

    h_taps, h_w = axis(rows, height)
    w_taps, w_w = axis(cols, width)
    idx = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    return idx.astype(np.int32), (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """Qwen2 with M-RoPE, and the vision tower (`visual`)."""

    CHECKPOINT_RENAMES = (
        (r"^model\.language_model\.", "model."),  # transformers 5's own spelling, beside the published one
        (r"^model\.visual\.", "visual."),
    )  # fmt: skip
    SKIPPED_TENSORS = (ROTARY_CACHE,)
    INTERLEAVED = False

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        super().__init__(cfg, dtype=dtype, attention=attention)
        self.visual = QwenVisionTransformer(cfg.option("vision"), dtype=dtype)

    @classmethod
    def config_from_hf(cls, hf_config, architecture: str) -> ModelConfig:
        text = text_config(hf_config)
        sections, rope = mrope_sections(text)
        cfg = model_config_from_hf(hf_config, architecture, attention_bias=True, attention_out_bias=False, rope=rope)
        axes = tuple(int(a) for a in mrope_axes(sections, cls.INTERLEAVED))
        options = dict(cfg.options, vision=QwenVisionConfig.from_hf(hf_config), mrope_axes=axes)
        return dataclasses.replace(cfg, options=tuple(sorted(options.items())))

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        specs = LlamaForCausalLM.weight_specs(cfg)
        v: QwenVisionConfig = cfg.option("vision")
        specs["visual.patch_embed.proj.weight"] = WeightSpec("visual.patch_embed.proj.weight")
        for i in range(v.depth):
            hf = f"visual.blocks.{i}"
            specs[f"{hf}.norm1.weight"] = WeightSpec(f"{hf}.norm1.scale")
            specs[f"{hf}.norm2.weight"] = WeightSpec(f"{hf}.norm2.scale")
            for proj in ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                specs |= linear_specs(f"{hf}.{proj}", f"{hf}.{proj}", bias=True)
        specs["visual.merger.ln_q.weight"] = WeightSpec("visual.merger.ln_q.scale")
        for j in (0, 2):
            specs |= linear_specs(f"visual.merger.mlp.{j}", f"visual.merger.mlp.{j}", bias=True)
        return specs

    # -- images ---------------------------------------------------------------------------------

    @property
    def vision_spec(self) -> VisionSpec:
        return VisionSpec(self.config.option("vision").image_token_id, self.config.hidden_size, mrope=True)

    def encode(self, batch: dict) -> jax.Array:
        """A batch (QwenImages.batch) -> [rows, 1, D]: each image's merge units in its own order, image after image."""
        merged = self.visual(batch)
        return merged[batch["out"]][:, None, :]

    def rope(self, positions, mm: MultimodalStep | None):
        return mrope_rope(self, positions, mm)

    def forward(self, input_ids, positions, kv_cache, attn_metadata, mm: MultimodalStep | None = None):
        x = merge_embeddings(self.embed(placeholder_ids(input_ids, mm), positions), mm)
        rope = self.rope(positions, mm)
        new_kv = []
        for layer in self.layers:
            x, layer_kv = layer(x, rope, kv_cache, attn_metadata)
            new_kv.append(layer_kv)
        return self.final(x), stack_new_kv(new_kv)


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen3 (q/k norm) with interleaved M-RoPE, and DeepStack: the vision tower's features from some blocks are added
    to the hidden states of the first decoder layers at the image's tokens (the encoder cache's levels 1, 2, ...)."""

    INTERLEAVED = True

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        LlamaForCausalLM.__init__(self, cfg, dtype=dtype, attention=attention)
        self.visual = Qwen3VisionTransformer(cfg.option("vision"), dtype=dtype)

    @classmethod
    def config_from_hf(cls, hf_config, architecture: str) -> ModelConfig:
        text = text_config(hf_config)
        sections, rope = mrope_sections(text)
        cfg = model_config_from_hf(hf_config, architecture, qk_norm=True, rope=rope)
        options = dict(cfg.options, vision=QwenVisionConfig.from_hf(hf_config), mrope_axes=tuple(int(a) for a in mrope_axes(sections, True)))
        return dataclasses.replace(cfg, options=tuple(sorted(options.items())))

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        return LlamaForCausalLM.weight_specs(cfg) | qwen3_vision_specs(cfg.option("vision"))

    @property
    def vision_spec(self) -> VisionSpec:
        vision = self.config.option("vision")
        return VisionSpec(vision.image_token_id, self.config.hidden_size, levels=1 + len(vision.deepstack), mrope=True)

    def encode(self, batch: dict) -> jax.Array:
        return self.visual(batch)[batch["out"]]

    def forward(self, input_ids, positions, kv_cache, attn_metadata, mm: MultimodalStep | None = None):
        x = merge_embeddings(self.embed(placeholder_ids(input_ids, mm), positions), mm)
        rope = self.rope(positions, mm)
        levels = 0 if mm is None else mm.cache.shape[1] - 1
        new_kv = []
        for i, layer in enumerate(self.layers):
            x, layer_kv = layer(x, rope, kv_cache, attn_metadata)
            new_kv.append(layer_kv)
            if i < levels:  # DeepStack: the image tokens' features of level i + 1
                rows = mm.rows
                x = x + jnp.where((rows >= 0)[:, None], mm.cache[jnp.maximum(rows, 0), i + 1].astype(x.dtype), 0)
        return self.final(x), stack_new_kv(new_kv)


def qwen3_vision_specs(v: QwenVisionConfig) -> dict[str, WeightSpec]:
    """Qwen3-VL's tower (Qwen3.5's: no DeepStack mergers), as its checkpoints name it after the `visual.` rename."""
    specs = {"visual.patch_embed.proj.weight": WeightSpec("visual.patch_embed.proj.weight")}
    specs["visual.patch_embed.proj.bias"] = WeightSpec("visual.patch_embed.proj.bias")
    specs["visual.pos_embed.weight"] = WeightSpec("visual.pos_embed.embedding")
    for i in range(v.depth):
        hf = f"visual.blocks.{i}"
        for norm in ("norm1", "norm2"):
            specs[f"{hf}.{norm}.weight"] = WeightSpec(f"{hf}.{norm}.scale")
            specs[f"{hf}.{norm}.bias"] = WeightSpec(f"{hf}.{norm}.bias")
        for proj in ("attn.qkv", "attn.proj"):
            specs |= linear_specs(f"{hf}.{proj}", f"{hf}.{proj}", bias=True)
        for fc in ("linear_fc1", "linear_fc2"):
            specs |= linear_specs(f"{hf}.mlp.{fc}", f"{hf}.mlp.{fc}", bias=True)
    mergers = ["visual.merger"] + [f"visual.deepstack_merger_list.{j}" for j in range(len(v.deepstack))]
    for hf in mergers:
        specs[f"{hf}.norm.weight"] = WeightSpec(f"{hf}.norm.scale")
        specs[f"{hf}.norm.bias"] = WeightSpec(f"{hf}.norm.bias")
        for fc in ("linear_fc1", "linear_fc2"):
            specs |= linear_specs(f"{hf}.{fc}", f"{hf}.mlp.{fc}", bias=True)
    return specs


# -- the host side ----------------------------------------------------------------------------------


def window_layout(grid_h: int, grid_w: int, merge: int, units: int) -> tuple[np.ndarray, np.ndarray]:
    """An image of grid_h x grid_w patches in transformers' window order, each window padded to units^2 merge units:
    -> (slot -> the merge unit it holds, -1 for padding, [slots / merge^2]; merge unit -> its slot [units count])."""
    h, w = grid_h // merge, grid_w // merge
    if not units:  # no windows: merge units in order
        order = np.arange(h * w, dtype=np.int64)
        return order, order.copy()
    index = np.arange(h * w).reshape(h, w)
    ph, pw = -h % units, -w % units
    padded = np.pad(index, ((0, ph), (0, pw)), constant_values=-1)
    wh, ww = padded.shape[0] // units, padded.shape[1] // units
    windows = padded.reshape(wh, units, ww, units).transpose(0, 2, 1, 3).reshape(wh * ww, units * units)
    slots = []
    for window in windows:  # valid units first, in transformers' order; windows with none dropped, as it drops them
        valid = window[window >= 0]
        if len(valid):
            slots.append(np.concatenate([valid, np.full(units * units - len(valid), -1)]))
    unit_of_slot = np.concatenate(slots)
    slot_of_unit = np.empty(h * w, np.int64)
    slot_of_unit[unit_of_slot[unit_of_slot >= 0]] = np.flatnonzero(unit_of_slot >= 0)
    return unit_of_slot, slot_of_unit


def image_slots(grid_h: int, grid_w: int, merge: int, units: int) -> int:
    """Patches an image takes in the padded layout."""
    return len(window_layout(grid_h, grid_w, merge, units)[0]) * merge * merge


class QwenImages(ImageAdapter):
    """Images of any size up to the largest batch: each one's patches in the padded window layout."""

    def __init__(self, hf_config, spec: VisionSpec):
        super().__init__(hf_config, spec)
        self.vision = QwenVisionConfig.from_hf(hf_config)
        self.merge, self.units = self.vision.merge, self.vision.window_units
        self.step = self.vision.window_patches
        self.features = self.vision.in_channels * self.vision.temporal_patch_size * self.vision.patch_size**2

    def call_patches(self, items, largest_bucket: int) -> int:
        """Full-attention blocks attend across a segment mask (segment_call_patches)."""
        return segment_call_patches(self, items, largest_bucket)

    SETTINGS = ImageAdapter.SETTINGS + ("max_pixels", "min_pixels", "size")  # images resized within the pixel bounds

    def _max_pixels(self) -> int:
        if self.settings.get("max_pixels"):
            return int(self.settings["max_pixels"])
        size = self.settings.get("size") or (self.processor.image_processor.size if self.processor is not None
                                             else {"longest_edge": 28 * 28 * 1280})  # fmt: skip
        get = size.get if isinstance(size, dict) else lambda name: getattr(size, name, None)
        return int(get("longest_edge") or get("max_pixels"))

    def _largest(self, max_pixels: int) -> int:
        """The most patches an image of at most max_pixels takes in the layout, over the grids smart_resize makes."""
        factor = self.vision.patch_size * self.merge
        units = max_pixels // (factor * factor)
        worst = 0
        for h in range(1, units + 1):  # merge units per side: any h x w with h * w <= units and ratio <= 200
            w = min(units // h, 200 * h)
            if w < 1 or h > 200 * w:
                continue
            worst = max(worst, image_slots(h * self.merge, w * self.merge, self.merge, self.units))
        return worst

    def max_image_patches(self) -> int:
        return self._largest(self._max_pixels())

    @property
    def video_token_id(self) -> int | None:
        """Qwen3-VL's and Qwen3.5's video placeholder (their videos: a span per frame group, between timestamps)."""
        token = getattr(self.hf_config, "video_token_id", None)
        return int(token) if self.vision.kind == "qwen3" and token is not None else None

    def items(self, processed: dict, input_ids: Sequence[int]) -> list[EncoderItem]:
        """Each image, and each video's frame groups (the processor puts each in a span of its own between the
        group's timestamp text; transformers' tower attends within a group, and M-RoPE positions each as an image,
        get_rope_index splitting the video's grid per group), in prompt order."""
        items = []
        if "pixel_values" in processed:
            grids = np.asarray(processed["image_grid_thw"]).reshape(-1, 3)
            if (grids[:, 0] != 1).any():
                raise ValueError("images only: a grid with more than one temporal patch is a video")
            items += self._items(np.asarray(processed["pixel_values"], np.float32), grids)
        if "pixel_values_videos" not in processed:  # (only where reads_videos: processing.py refuses them otherwise)
            return items
        grids = np.asarray(processed["video_grid_thw"]).reshape(-1, 3)
        groups = np.repeat(grids, grids[:, 0], axis=0)
        groups[:, 0] = 1
        videos = self._items(np.asarray(processed["pixel_values_videos"], np.float32), groups)
        return in_prompt_order(input_ids, items, self.spec.image_token_id, videos, self.video_token_id)

    def _items(self, pixels: np.ndarray, grids: np.ndarray) -> list[EncoderItem]:
        items, at, m = [], 0, self.merge
        for t, h, w in grids.tolist():
            n = h * w
            patches = pixels[at : at + n]
            at += n
            unit_of_slot, slot_of_unit = window_layout(h, w, m, self.units)
            rows = np.repeat(np.maximum(unit_of_slot, 0) * m * m, m * m) + np.tile(np.arange(m * m), len(unit_of_slot))
            valid = np.repeat(unit_of_slot >= 0, m * m)
            # each patch's (h, w) in the grid, block-major as transformers' get_vision_position_ids
            hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
            block = (h // m, m, w // m, m)
            pos = np.stack([hh.reshape(block).transpose(0, 2, 1, 3).reshape(-1), ww.reshape(block).transpose(0, 2, 1, 3).reshape(-1)], -1)
            arrays = {
                "patches": np.where(valid[:, None], patches[rows], 0).astype(np.float32),
                "pos": np.where(valid[:, None], pos[rows], 0).astype(np.int32),
                "valid": valid.astype(np.int32),
                "out": slot_of_unit.astype(np.int32),
            }
            if self.vision.kind == "qwen3":  # the learned position grid resampled to this one
                side = int(round(self.vision.num_position_embeddings**0.5))
                idx, weights = bilinear_taps(arrays["pos"][:, 0], arrays["pos"][:, 1], h, w, side)
                arrays["interp_idx"], arrays["interp_w"] = idx, np.where(valid[:, None], weights, 0).astype(np.float32)
            items.append(EncoderItem(arrays, len(valid), (h // m) * (w // m), meta={"grid": (t, h, w)}))
        return items

    def mrope_positions(self, input_ids, items):
        return rope_index(input_ids, self.placeholder_tokens(), [item.meta["grid"] for item in items], self.merge)

    def buckets(self, max_patches: int) -> list[int]:
        steps = -(-max_patches // self.step)
        return [n * self.step for n in ImageAdapter.buckets(self, steps)]

    def rows_for(self, bucket: int) -> int:
        return bucket // (self.merge * self.merge)

    def batch(self, items: Sequence[EncoderItem], bucket: int) -> dict[str, np.ndarray]:
        out = {
            "patches": np.zeros((bucket, self.features), np.float32),
            "pos": np.zeros((bucket, 2), np.int32),
            "seg": np.full(bucket, -1, np.int32),
            "out": np.zeros(self.rows_for(bucket), np.int32),
        }
        if self.vision.kind == "qwen3":
            out["interp_idx"] = np.zeros((bucket, 4), np.int32)
            out["interp_w"] = np.zeros((bucket, 4), np.float32)
        at = rows = 0
        for i, item in enumerate(items):
            a = item.arrays
            n = len(a["valid"])
            out["patches"][at : at + n] = a["patches"]
            out["pos"][at : at + n] = a["pos"]
            out["seg"][at : at + n] = np.where(a["valid"] > 0, i, -1)
            for name in ("interp_idx", "interp_w"):
                if name in out:
                    out[name][at : at + n] = a[name]
            out["out"][rows : rows + item.num_rows] = a["out"] + at // (self.merge * self.merge)
            at += n
            rows += item.num_rows
        return out


Qwen2_5_VLForConditionalGeneration.IMAGES = QwenImages
Qwen3VLForConditionalGeneration.IMAGES = QwenImages

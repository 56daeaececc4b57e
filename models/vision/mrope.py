"""M-RoPE, as the Qwen-VL families and Qwen3.5 position their tokens (transformers' get_rope_index and text rotary
embeddings): each token has a (t, h, w) position; the rotary frequencies are split among the three axes, in
contiguous `mrope_section` parts (Qwen2.5-VL) or interleaved (Qwen3-VL, Qwen3.5). Text tokens carry the same position
on all three (so a text-only prompt is plain RoPE), an image's tokens their grid's, and text after an image resumes at
the image's start + max(h, w) / merge, so a generated token at sequence position p has position p + rope_delta
(negative) on all axes (MultimodalInputs.mrope_delta).
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxpaged.models.config import RopeConfig, rope_from_hf
from jaxpaged.models.layers import rope_inv_freq
from jaxpaged.models.vision.common import MultimodalStep


def mrope_axes(sections: Sequence[int], interleaved: bool, n: int | None = None) -> np.ndarray:
    """[n] (default sum(sections)) which position axis (0 t, 1 h, 2 w) each rotary frequency takes: Qwen2.5-VL's
    contiguous sections (t's first, then h's, then w's), or Qwen3-VL's and Qwen3.5's interleaving (h at 1, 4, 7, ...
    and w at 2, 5, 8, ... up to three times their sections, t elsewhere)."""
    n = int(sum(sections)) if n is None else n
    if not interleaved:
        return np.concatenate([np.full(s, i % 3, np.int32) for i, s in enumerate(sections)])
    axes = np.zeros(n, np.int32)
    for axis in (1, 2):  # (a slice, as transformers': past the last frequency it stops)
        axes[axis : sections[axis] * 3 : 3] = axis
    return axes


def mrope_table(rope: RopeConfig, axes: tuple[int, ...], positions: jax.Array, rotary_dim: int):
    """(cos, sin) [T, rotary_dim] for M-RoPE positions [3, T]: each frequency at its axis's position."""
    inv_freq = jnp.asarray(rope_inv_freq(rope, rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [3, T, rotary_dim / 2]
    axes = jnp.asarray(axes)
    picked = jnp.where(axes == 0, freqs[0], jnp.where(axes == 1, freqs[1], freqs[2]))
    emb = jnp.concatenate([picked, picked], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def mrope_sections(text, default: Sequence[int] | None = None) -> tuple[tuple[int, ...], RopeConfig]:
    """(mrope_section, the RoPE config less it) from transformers 5's rope_parameters or a published checkpoint's
    rope_scaling {"type": "mrope", "mrope_section": ...}; `default` where neither says (Qwen3.5's text model)."""
    params = dict(getattr(text, "rope_parameters", None) or {})
    scaling = dict(getattr(text, "rope_scaling", None) or {})
    sections = params.get("mrope_section") or scaling.get("mrope_section") or default
    if not sections:
        raise ValueError("an M-RoPE model's config needs rope_parameters.mrope_section")
    clean = {k: v for k, v in params.items() if k not in ("mrope_section", "mrope_interleaved")}
    if clean.get("rope_type", clean.get("type")) == "mrope":
        clean["rope_type"] = "default"
    theta = clean.get("rope_theta", getattr(text, "rope_theta", 10000.0))
    rope = rope_from_hf(types.SimpleNamespace(rope_parameters={**clean, "rope_theta": theta, "rope_type": clean.get("rope_type", "default")},
                                              max_position_embeddings=text.max_position_embeddings))  # fmt: skip
    return tuple(int(s) for s in sections), rope


def rope_index(input_ids: Sequence[int], image_token_id, grids: Sequence[tuple[int, int, int]], merge: int):
    """transformers' get_rope_index for a prompt of text and images (image_token_id: the placeholder, or several:
    Qwen3-VL's video frame groups are positioned as images): ([3, L] positions, rope_delta)."""
    ids = np.asarray(input_ids)
    is_image = np.isin(ids, image_token_id)
    out = np.zeros((3, len(ids)), np.int64)
    pos, i, g = 0, 0, 0
    while i < len(ids):
        if not is_image[i]:
            j = i
            while j < len(ids) and not is_image[j]:
                j += 1
            out[:, i:j] = pos + np.arange(j - i)
            pos += j - i
            i = j
            continue
        t, h, w = grids[g]
        lt, lh, lw = t, h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(lt), np.arange(lh) + pos, np.arange(lw) + pos, indexing="ij")
        n = lt * lh * lw
        out[0, i : i + n] = (tt + pos).reshape(-1)
        out[1, i : i + n] = hh.reshape(-1)
        out[2, i : i + n] = ww.reshape(-1)
        pos += max(h, w) // merge
        i += n
        g += 1
    delta = int(out.max()) + 1 - len(ids) if len(ids) else 0
    return out.astype(np.int32), delta


def mrope_rope(model, positions: jax.Array, mm: MultimodalStep | None):
    """A port's (cos, sin) for the step: its tokens' M-RoPE positions (text only: `positions` on every axis), over
    its config's `mrope_axes` and rotary width (partial rotary: Qwen3.5)."""
    cfg = model.config
    mrope = mm.mrope_positions if mm is not None and mm.mrope_positions is not None else None
    if mrope is None:
        mrope = jnp.broadcast_to(positions, (3,) + positions.shape)
    dim = cfg.rotary_dim or cfg.head_dim
    return model.shared(lambda: mrope_table(cfg.rope, cfg.option("mrope_axes"), mrope, dim), positions)

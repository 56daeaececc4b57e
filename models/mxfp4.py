"""MXFP4 checkpoints (config.json `quantization_config: {quant_method: mxfp4}`; the released GPT-OSS models): each
expert weight `X` is stored as `X_blocks` uint8 [..., rows, G, 16] (two 4-bit e2m1 codes a byte, low nibble first,
32 values a block) and `X_scales` uint8 [..., rows, G] (a power of two per block, biased by 127). They are
dequantized once here, on the host, as transformers.integrations.mxfp4.convert_moe_packed_tensors computes them
(rows become the last axis: [..., G * 32, rows], the layout GptOssExperts holds), and loaded in the engine's dtype;
nothing runs in 4 bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)  # e2m1's 16 codes


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., rows, G, 16], scales uint8 [..., rows, G] -> float32 [..., G * 32, rows], one leading
    index (an expert) at a time so the host holds one expert's temporaries."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match ([..., G, 16] and [..., G])")
    *lead, rows, groups, _ = blocks.shape
    flat_blocks = blocks.reshape(-1, rows, groups, 16)
    flat_scales = scales.reshape(-1, rows, groups).astype(np.int32) - 127
    out = np.empty((flat_blocks.shape[0], groups * 32, rows), np.float32)
    for e in range(flat_blocks.shape[0]):
        codes = np.stack([flat_blocks[e] & 0x0F, flat_blocks[e] >> 4], axis=-1).reshape(rows, groups, 32)
        values = np.ldexp(FP4_VALUES[codes], flat_scales[e][..., None]).astype(np.float32)
        out[e] = values.reshape(rows, groups * 32).T
    return out.reshape(*lead, groups * 32, rows)


class Mxfp4:
    """The checkpoint reader: each `X_blocks` with its `X_scales` becomes `X` (float32); other tensors pass through.
    A `_blocks` tensor without its `_scales` passes through too, so the loader names it."""

    name = "mxfp4"

    def __init__(self, qcfg: dict, source: str):
        self.source = source

    def tensors(self, names: Iterable[str], read: Callable[[str], tuple[np.ndarray, str]],
                skip: Callable[[str, str], None]) -> Iterator[tuple[str, Any, str]]:  # fmt: skip
        names = list(names)
        present = set(names)
        for name in names:
            prefix = name.removesuffix("_blocks").removesuffix("_scales")
            paired = prefix != name and {prefix + "_blocks", prefix + "_scales"} <= present
            if not paired:
                yield (name, *read(name))
            elif name.endswith("_blocks"):
                blocks, source = read(name)
                try:
                    value = dequantize_mxfp4(blocks, read(prefix + "_scales")[0])
                except ValueError as exc:
                    raise ValueError(f"mxfp4 tensors of {prefix} in {source}: {exc}") from exc
                yield prefix, value, source

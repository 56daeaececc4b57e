"""MXFP4 checkpoints (config.json `quantization_config: {quant_method: mxfp4}`; the released GPT-OSS models): each
expert weight `X` is stored as `X_blocks` uint8 [..., rows, G, 16] (two 4-bit e2m1 codes a byte, low nibble first,
32 values a block) and `X_scales` uint8 [..., rows, G] (a power of two per block, biased by 127).

Two ways to load them, chosen by the engine before loading (load_model's `moe_kernel`: the platform's expert loop
says whether it reads MXFP4, `Platform.keeps_mxfp4`):

- kept 4-bit (`Mxfp4(keep=True)`, when the expert loop is the grouped-GEMM kernel, moe_kernel="triton": compiled on a
  GPU, interpreted on a CPU): the blocks and scales are re-laid-out once on the host (`pack_mxfp4`, numpy) into the
  kernel's layout (pallas_kernels/moe_gemm.py's docstring: codes [..., Kp / 2, rows], scales [..., Kp / 32, rows])
  and loaded as uint8, 4.25 bits a value; the kernel decodes them in its inner loop. GPT-OSS-120B's experts are then
  ~61 GB instead of ~234 GB in bfloat16 (one 80 GB H100 instead of four). Not yet run on a GPU: the kernel is tested
  interpreted on the CPU and lowered for cuda; the next GPU session measures it.
- dequantized once (everywhere else): on the host, as transformers.integrations.mxfp4.convert_moe_packed_tensors
  computes them (rows become the last axis: [..., G * 32, rows], the layout GptOssExperts holds), and loaded in the
  engine's dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

BLOCK_K = 64  # the kernel's packed inner block (pallas_kernels/moe_gemm.py MXFP4_BLOCK_K)
GROUP = 32  # values per scale
NO_SCALE = 127  # 2^0: the scale of the zero codes that pad K to a whole block

FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)  # e2m1's 16 codes


def _checked(blocks, scales) -> tuple[np.ndarray, np.ndarray]:
    """A checkpoint's blocks and scales as uint8, their shapes checked against each other."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match ([..., G, 16] and [..., G])")
    return blocks, scales


def _nibbles(blocks: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 16, 2] codes in value order (the low nibble first)."""
    return np.stack([blocks & 0x0F, blocks >> 4], axis=-1)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., rows, G, 16], scales uint8 [..., rows, G] -> float32 [..., G * 32, rows], one leading
    index (an expert) at a time so the host holds one expert's temporaries."""
    blocks, scales = _checked(blocks, scales)
    *lead, rows, groups, _ = blocks.shape
    flat_blocks = blocks.reshape(-1, rows, groups, 16)
    flat_scales = scales.reshape(-1, rows, groups).astype(np.int32) - 127
    out = np.empty((flat_blocks.shape[0], groups * 32, rows), np.float32)
    for e in range(flat_blocks.shape[0]):
        codes = _nibbles(flat_blocks[e]).reshape(rows, groups, 32)
        values = np.ldexp(FP4_VALUES[codes], flat_scales[e][..., None]).astype(np.float32)
        out[e] = values.reshape(rows, groups * 32).T
    return out.reshape(*lead, groups * 32, rows)


def pack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The checkpoint's blocks uint8 [..., rows, G, 16] and scales uint8 [..., rows, G] -> the grouped GEMM's layout:
    codes uint8 [..., Kp / 2, rows] (K = G * 32 inner values rounded up to Kp, a multiple of 64, with zero codes;
    byte row 32 * b + r holds inner row 64 * b + r in its low nibble and 64 * b + 32 + r in its high one) and scales
    uint8 [..., Kp / 32, rows] (row g: inner rows 32 * g..; the padding's 127). Values and scales are unchanged:
    decoding these equals dequantize_mxfp4. One leading index (an expert) at a time."""
    blocks, scales = _checked(blocks, scales)
    *lead, rows, groups, _ = blocks.shape
    k = groups * GROUP
    padded = -(-k // BLOCK_K) * BLOCK_K
    flat_blocks, flat_scales = blocks.reshape(-1, rows, groups, 16), scales.reshape(-1, rows, groups)
    codes = np.empty((flat_blocks.shape[0], padded // 2, rows), np.uint8)
    out_scales = np.full((flat_blocks.shape[0], padded // GROUP, rows), NO_SCALE, np.uint8)
    for e in range(flat_blocks.shape[0]):
        nibbles = np.zeros((rows, padded), np.uint8)  # [rows, inner] in order
        nibbles[:, :k] = _nibbles(flat_blocks[e]).reshape(rows, k)
        halves = nibbles.reshape(rows, padded // BLOCK_K, 2, BLOCK_K // 2)
        codes[e] = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, padded // 2).T
        out_scales[e, :groups] = flat_scales[e].T
    return codes.reshape(*lead, padded // 2, rows), out_scales.reshape(*lead, padded // GROUP, rows)


@dataclasses.dataclass(frozen=True)
class PackedMxfp4:
    """An MXFP4 expert weight kept 4-bit, in the kernel's layout (pack_mxfp4): codes [E, Kp / 2, N] and scales
    [E, Kp / 32, N], for K inner values. The loader hands it to the stacked experts (models/weights.py calls
    install_experts for the spec's parameters); a fused spec's split (GPT-OSS's gate_up interleave) splits the last
    axis, the output columns, of both."""

    codes: np.ndarray
    scales: np.ndarray
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def install_experts(self, owners, split, name: str, source: str) -> None:
        """owners: the spec's parameters' modules (models/moe.py ExpertLinear), one per path."""
        codes = split(self.codes) if split is not None else (self.codes,)
        scales = split(self.scales) if split is not None else (self.scales,)
        if len(owners) != len(codes):
            raise ValueError(f"tensor {name} in {source} splits into {len(codes)} parts for {len(owners)} parameters")
        for owner, c, s in zip(owners, codes, scales):
            if not hasattr(owner, "load_mxfp4"):
                raise ValueError(f"tensor {name} in {source} is MXFP4, but its parameter ({type(owner).__name__}) takes floats only")
            try:
                owner.load_mxfp4(c, s, self.in_features)
            except ValueError as exc:
                raise ValueError(f"tensor {name} in {source}: {exc}") from exc


class Mxfp4:
    """The checkpoint reader: each `X_blocks` with its `X_scales` becomes `X`: float32 (dequantize_mxfp4), or with
    keep a PackedMxfp4 (pack_mxfp4); other tensors pass through. A `_blocks` tensor without its `_scales` passes
    through too, so the loader names it."""

    name = "mxfp4"

    def __init__(self, qcfg: dict, source: str, keep: bool = False):
        self.source = source
        self.keep = keep

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
                    scales = read(prefix + "_scales")[0]
                    if self.keep:
                        value = PackedMxfp4(*pack_mxfp4(blocks, scales), in_features=blocks.shape[-2] * GROUP)
                    else:
                        value = dequantize_mxfp4(blocks, scales)
                except ValueError as exc:
                    raise ValueError(f"mxfp4 tensors of {prefix} in {source}: {exc}") from exc
                yield prefix, value, source

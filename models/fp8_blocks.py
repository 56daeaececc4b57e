"""Block-wise FP8 checkpoints (config.json `quantization_config: {quant_method: fp8, weight_block_size: [bn, bk]}`):
what DeepSeek-V3, R1 and V3.1, Kimi K2 and others ship, as transformers' finegrained_fp8 integration and vLLM read
them. A quantized Linear `X` is `X.weight` (float8_e4m3fn [out, in]) and `X.weight_scale_inv` (float32
[ceil(out / bn), ceil(in / bk)]); the weight is weight[i, j] * scale_inv[i // bn, j // bk], edge blocks partial.
Fused expert tensors (`experts.gate_up_proj` [E, out, in], as transformers saves them) carry
`experts.gate_up_proj_scale_inv` [E, ceil(out / bn), ceil(in / bk)], read the same way (row r by scale row r // bn,
as transformers' FP8Experts kernels index it). Without `weight_block_size` the scale is one per tensor. `scale_fmt: ue8m0` (V3.1) stores powers of
two: as float32 they multiply as they are; as uint8 bytes b they are 2 ** (b - 127).

Each weight is dequantized once here, on the host, in float32 (an fp8 value times its float32 scale: one rounding,
the product IEEE float32 gives), then cast to the engine's dtype; nothing runs in fp8. The fp8 codes are decoded
two at a time through a 65536-entry table (about 460M weights a second on one busy CPU core, 4x ml_dtypes' cast). A per-channel requantization
(`quantization="fp8"` or `"int8"`) may follow in the loader, as for a float checkpoint.

The block size comes from the config, as vLLM and transformers' FP8Linear kernels use it. transformers 5.24's
load-time `Fp8Dequantize` (what it runs on a CPU) derives it from the scale grid instead (rows // grid rows), so it
agrees only where every dimension is a multiple of its block: a 48-row weight in 32-row blocks (grid 2) it reads as
two blocks of 24, and DeepSeek-V3's kv_a_proj_with_mqa (576 rows, grid 5) is its ValueError.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import ml_dtypes
import numpy as np

logger = logging.getLogger("jaxpaged.loader")

SCALE = "_scale_inv"  # `X.weight` + SCALE, or a fused expert tensor `X` + SCALE
ACTIVATION_SCALE = "activation_scale"  # static schemes' per-tensor input scales (`X.activation_scale`)
ACTIVATIONS = "static fp8 activation scales: activations stay in the model dtype (or quantize_activations)"
FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _pair_table(dtype: np.dtype) -> np.ndarray:
    """[65536, 2] float32: the two fp8 values (low byte first) of every 16-bit word, so a lookup decodes two at a
    time (6x ml_dtypes' element-wise cast on a CPU core; the same values, NaNs included)."""
    one = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    return np.stack([np.tile(one, 256), np.repeat(one, 256)], axis=-1)


def fp8_to_float32(w: np.ndarray) -> np.ndarray:
    """An fp8 array as float32 (exact: every fp8 value is a float32)."""
    if sys.byteorder != "little" or w.shape[-1] % 2 or w.size == 0:
        return w.astype(np.float32)
    words = np.ascontiguousarray(w).view(np.uint16)
    return np.take(_pair_table(np.dtype(w.dtype)), words, axis=0).reshape(w.shape)


def scale_values(scale_inv: np.ndarray) -> np.ndarray:
    """The stored scales as float32: floats as they are, ue8m0 bytes (uint8) as 2 ** (b - 127)."""
    s = np.asarray(scale_inv)
    if s.dtype == np.uint8:
        return np.ldexp(np.float32(1.0), s.astype(np.int32) - 127).astype(np.float32)
    if s.dtype.kind != "f" and s.dtype not in (np.dtype(ml_dtypes.bfloat16),):
        raise ValueError(f"weight_scale_inv is {s.dtype}; expected float32 (or ue8m0 bytes)")
    return s.astype(np.float32)


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] | None,
                          dtype=np.float32) -> np.ndarray:  # fmt: skip
    """weight fp8 [..., rows, cols] with scale_inv [..., ceil(rows / bn), ceil(cols / bk)] (or one value when
    `block` is None) -> `dtype` [..., rows, cols]: the float32 product weight * scale_inv of each element's block,
    cast once to `dtype`. Row blocks are scaled in place one at a time, so the host holds the float32 weight and
    one block-row of scales."""
    w = np.asarray(weight)
    if w.dtype not in FP8_DTYPES:
        raise ValueError(f"weight is {w.dtype}; expected float8_e4m3fn (or float8_e5m2) beside a weight_scale_inv")
    s = scale_values(scale_inv)
    out = fp8_to_float32(w)
    if block is None or w.ndim < 2:
        if s.size != 1:
            raise ValueError(f"weight_scale_inv is {s.shape} without a weight_block_size: expected one value")
        out *= s.reshape(())
        return out.astype(dtype, copy=False)
    bn, bk = block
    rows, cols = w.shape[-2:]
    grid = (*w.shape[:-2], _cdiv(rows, bn), _cdiv(cols, bk))
    if s.shape != grid:
        raise ValueError(f"weight_scale_inv is {s.shape}, but a {w.shape} weight in [{bn}, {bk}] blocks needs {grid}")
    for i in range(grid[-2]):
        row_scales = np.repeat(s[..., i, :], bk, axis=-1)[..., :cols]  # [..., cols]
        out[..., i * bn : (i + 1) * bn, :] *= row_scales[..., None, :]
    return out.astype(dtype, copy=False)


def _refuse(what: str, source: str) -> ValueError:
    from jaxpaged.models.checkpoint_quant import SUPPORTED

    return ValueError(
        f"{source} holds an fp8 checkpoint with {what}, which jaxpaged cannot load; supported pre-quantized "
        f"checkpoints: {SUPPORTED}. Load its float original (quantization='int8' or 'fp8' quantizes at load) instead"
    )


class Fp8Blocks:
    """The checkpoint reader: each fp8 `W` with its `W_scale_inv` becomes `W` in `dtype` (dequantized); activation
    scales are skipped with their reason; other tensors pass through. A scale without its weight passes through
    (the loader names it); an fp8 tensor without its scale is a ValueError."""

    name = "fp8"
    dequantizes = True  # yields floats: quantization="int8"/"fp8" requantizes them per channel, as a float checkpoint

    def __init__(self, qcfg: dict, source: str, dtype=np.float32):
        block = qcfg.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or any(int(b) != b or b <= 0 for b in block):
                raise _refuse(f"weight_block_size {block!r} (two positive integers expected)", source)
            block = (int(block[0]), int(block[1]))
        self.block = block
        if qcfg.get("expert_dtype", "fp8") != "fp8":
            raise _refuse(f"expert_dtype {qcfg['expert_dtype']!r} (FP4-packed experts)", source)
        if qcfg.get("modules_to_convert"):
            raise _refuse(f"fp8 embeddings (modules_to_convert {qcfg['modules_to_convert']!r})", source)
        if qcfg.get("scale_fmt", "float") not in ("float", "ue8m0", None):
            raise _refuse(f"scale_fmt {qcfg['scale_fmt']!r}", source)
        if str(qcfg.get("activation_scheme", "dynamic")).lower() not in ("dynamic", "static"):
            raise _refuse(f"activation_scheme {qcfg['activation_scheme']!r}", source)
        self.dtype = np.dtype(dtype)
        self.source = source
        logger.info(
            "loading an fp8 checkpoint (%s): weights dequantized once to %s (%s activations not quantized)",
            f"[{block[0]}, {block[1]}] blocks" if block else "a scale per tensor", self.dtype.name,
            qcfg.get("activation_scheme", "dynamic"),
        )  # fmt: skip

    def tensors(self, names: Iterable[str], read: Callable[[str], tuple[np.ndarray, str]],
                skip: Callable[[str, str], None]) -> Iterator[tuple[str, Any, str]]:  # fmt: skip
        names = list(names)
        present = set(names)
        for name in names:
            if name.endswith(SCALE) and name.removesuffix(SCALE) in present:
                continue  # read with its weight
            if name.endswith(ACTIVATION_SCALE):
                skip(name, ACTIVATIONS)
                continue
            array, source = read(name)
            if name + SCALE in present:
                try:
                    array = dequantize_fp8_blocks(array, read(name + SCALE)[0], self.block, self.dtype)
                except ValueError as exc:
                    raise ValueError(f"fp8 tensors of {name} in {source}: {exc}") from exc
            elif np.dtype(array.dtype) in FP8_DTYPES:
                raise ValueError(f"tensor {name} in {source} is {array.dtype} without its {name}{SCALE}")
            yield name, array, source

"""Quantized weights: how a Linear or an Embedding holds them, and how a matmul reads them.

Two layouts cover every scheme jaxpaged serves:

- per-channel (`ChannelLinear`): kernel [in, out] int8 or float8_e4m3fn, scale [out] float32; w = kernel * scale.
  `quantization="int8"|"fp8"` writes it at load from a float checkpoint; compressed-tensors' channel schemes load
  into it as stored.
- per-group (`GroupLinear`, `GroupEmbedding`): groups of `group_size` consecutive inputs share a scale and an
  offset, w = q * scale + zero, with q int8 (8 bits) or 4-bit codes packed two to a byte along the input axis
  (row 2i in the low nibble, 2i + 1 in the high). GGUF's Q8_0, Q4_0, Q4_1 and Q4_K and GPTQ/AWQ's 4-bit groups all
  are this with their own scales and offsets.

The matmul dequantizes the weight into the activations' dtype inside the jitted step (XLA fuses the convert into
the dot where it can) and accumulates in float32, as DenseLinear does; per-channel scales multiply the product.
With `quantize_activations` a per-channel matmul also quantizes its input, one scale per token, to the kernel's
8-bit type, so the dot itself is 8-bit x 8-bit (int8 tensor cores / MXU, cuBLASLt's fp8 GEMM), as vLLM's W8A8
schemes run; both scales multiply the product.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def _precision(x):
    return jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None


# -- per-channel ------------------------------------------------------------------------------


def quantize_channels(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """A float kernel [in, out] -> (q [in, out] int8 or float8_e4m3fn, scale [out] float32), symmetric per output
    channel: scale = max|w[:, j]| / QMAX. On the host (numpy), one weight at a time as it loads."""
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=0)
    if kind == "int8":
        scale = np.maximum(amax / 127.0, np.finfo(np.float32).tiny).astype(np.float32)
        return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale
    if kind == "fp8":
        scale = np.maximum(amax / FP8_MAX, np.finfo(np.float32).tiny).astype(np.float32)
        return np.clip(w / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), scale
    raise ValueError(f"quantization must be 'int8' or 'fp8' (got {kind!r})")


def quantize_rows(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Activations [..., in] -> (q [..., in] int8 or float8_e4m3fn, scale [..., 1] float32), symmetric per token,
    in the jitted step (the dynamic scales of vLLM's W8A8 schemes)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    if jnp.dtype(dtype) == jnp.int8:
        scale = jnp.maximum(amax / 127.0, jnp.finfo(jnp.float32).tiny)
        return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale
    scale = jnp.maximum(amax / FP8_MAX, jnp.finfo(jnp.float32).tiny)
    return jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), scale


@dataclasses.dataclass(frozen=True)
class ChannelLinear:
    """kernel [in, out] (int8 or fp8) * scale [out]: the weight converted to x's dtype in the dot, or, with
    `activations`, x quantized per token to the kernel's type and the dot taken in 8 bits."""

    activations: bool = False
    fp8_operands: str = "bfloat16"  # an fp8 x fp8 dot: widened to bfloat16 first (exact), or "float8" as stored

    def apply(self, layer, x: jax.Array) -> jax.Array:
        kernel, scale = layer.kernel[...], layer.scale[...].astype(jnp.float32)
        if not self.activations:
            y = jnp.dot(x, kernel.astype(x.dtype), precision=_precision(x), preferred_element_type=jnp.float32)
            return y * scale
        q, row_scale = quantize_rows(x, kernel.dtype)
        if kernel.dtype == jnp.int8:  # exact in int32
            y = jnp.dot(q, kernel, preferred_element_type=jnp.int32).astype(jnp.float32)
        elif self.fp8_operands == "float8":  # XLA:GPU hands an f8 x f8 dot to cuBLASLt's fp8 GEMM
            y = jnp.dot(q, kernel, preferred_element_type=jnp.float32)
        else:  # bfloat16 holds every e4m3 value exactly: XLA:CPU's f8 dot is 2x slower than this one
            y = jnp.dot(q.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        return y * row_scale * scale


# -- per-group --------------------------------------------------------------------------------


def pack_int4(codes: np.ndarray, axis: int = 0) -> np.ndarray:
    """4-bit codes (0..15, any int dtype) -> uint8, two per byte along `axis` (even index low, odd high)."""
    codes = np.moveaxis(np.asarray(codes, np.uint8), axis, 0)
    packed = (codes[0::2] & 0xF) | ((codes[1::2] & 0xF) << 4)
    return np.moveaxis(packed.astype(np.uint8), 0, axis)


def unpack_int4(packed: jax.Array, axis: int = 0) -> jax.Array:
    """pack_int4's inverse, in the jitted step: uint8 [..., n, ...] -> codes [..., 2n, ...] (uint8, 0..15)."""
    lo, hi = packed & 0xF, packed >> 4
    both = jnp.stack([lo, hi], axis=axis + 1)
    shape = list(packed.shape)
    shape[axis] *= 2
    return both.reshape(shape)


def dequantize_groups(q: jax.Array, scale: jax.Array, zero: jax.Array | None, *, bits: int, axis: int, dtype) -> jax.Array:
    """q (int8, or packed uint8 when bits == 4) with scale/zero [..., n_groups, ...] along `axis` -> floats."""
    codes = unpack_int4(q, axis) if bits == 4 else q
    n = codes.shape[axis]
    groups = scale.shape[axis]
    shape = list(codes.shape)
    shape[axis : axis + 1] = [groups, n // groups]
    values = codes.astype(jnp.float32).reshape(shape) * jnp.expand_dims(scale.astype(jnp.float32), axis + 1)
    if zero is not None:
        values = values + jnp.expand_dims(zero.astype(jnp.float32), axis + 1)
    return values.reshape(codes.shape).astype(dtype)


@dataclasses.dataclass(frozen=True)
class GroupLinear:
    """kernel: int8 [in, out] (bits 8) or uint8 [in / 2, out] (bits 4); scale, zero: [in / group_size, out]
    (`zero` None when the scheme has no offset)."""

    bits: int
    group_size: int

    def weight(self, layer, dtype) -> jax.Array:
        zero = getattr(layer, "zero", None)
        return dequantize_groups(layer.kernel[...], layer.scale[...], None if zero is None else zero[...], bits=self.bits, axis=0, dtype=dtype)

    def apply(self, layer, x: jax.Array) -> jax.Array:
        return jnp.dot(x, self.weight(layer, x.dtype), precision=_precision(x), preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class GroupEmbedding:
    """An Embedding table [V, F] stored per group along F: embedding int8 [V, F] or uint8 [V, F / 2], scale and
    zero [V, F / group_size]. Lookups dequantize the rows they read; a tied head dequantizes the table."""

    bits: int
    group_size: int
    dtype: str = "float32"  # what rows come out as (the model's dtype)

    def _zero(self, layer):
        zero = getattr(layer, "zero", None)
        return None if zero is None else zero[...]

    def lookup(self, layer, ids: jax.Array) -> jax.Array:
        zero = self._zero(layer)
        rows = lambda a: jnp.take(a, ids, axis=0)  # noqa: E731
        return dequantize_groups(
            rows(layer.embedding[...]), rows(layer.scale[...]), None if zero is None else rows(zero),
            bits=self.bits, axis=1, dtype=jnp.dtype(self.dtype),
        )  # fmt: skip

    def attend(self, layer, x: jax.Array) -> jax.Array:
        table = dequantize_groups(layer.embedding[...], layer.scale[...], self._zero(layer), bits=self.bits, axis=1, dtype=x.dtype)
        return jnp.dot(x, table.T, precision=_precision(x), preferred_element_type=jnp.float32)


QUANTIZED_METHODS = (ChannelLinear, GroupLinear, GroupEmbedding)


def is_quantized(module) -> bool:
    return isinstance(getattr(module, "method", None), QUANTIZED_METHODS)


def quantize_activations(model, fp8_operands: str = "bfloat16") -> int:
    """Switch, in place, every per-channel 8-bit Linear to 8-bit x 8-bit dots (EngineConfig.quantize_activations);
    how many. Grouped (GGUF, GPTQ, AWQ) weights keep their dequantizing matmul. fp8_operands: ChannelLinear's,
    the platform's choice."""
    count = 0
    for _, module in nnx.iter_modules(model):
        if type(getattr(module, "method", None)) is ChannelLinear:
            module.method = ChannelLinear(activations=True, fp8_operands=fp8_operands)
            count += 1
    return count


# -- weights as checkpoints store them, on the host -------------------------------------------


@dataclasses.dataclass
class ChannelQuantized:
    """A torch-layout weight [out, in] quantized per output channel (compressed-tensors' channel/tensor schemes)."""

    values: np.ndarray  # [out, in] int8 or float8_e4m3fn
    scale: np.ndarray  # [out] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> np.ndarray:
        return self.values.astype(np.float32) * self.scale.astype(np.float32)[:, None]


@dataclasses.dataclass
class GroupQuantized:
    """A weight [rows, cols] with groups of group_size along cols (the input features of a torch-layout Linear,
    the features of an embedding table): w = codes * scale + zero."""

    codes: np.ndarray  # int8 [rows, cols] (bits 8) or uint8 [rows, cols / 2] (bits 4, pack_int4 along cols)
    scale: np.ndarray  # [rows, cols / group_size]
    zero: np.ndarray | None  # like scale, or None
    bits: int
    group_size: int
    scheme: str  # what the checkpoint called it (Q4_1, gptq...), for logs

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.codes.shape
        return (rows, cols * 2 if self.bits == 4 else cols)

    def transposed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(codes, scale, zero) with the grouped axis first: a Linear kernel's [in, out] layout."""
        t = lambda a: None if a is None else np.ascontiguousarray(a.T)  # noqa: E731
        return t(self.codes), t(self.scale), t(self.zero)

    def dequantize(self) -> np.ndarray:
        """Float32 [rows, cols], on the host (tests, and loading with quantization="none")."""
        codes = self.codes
        if self.bits == 4:
            codes = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(codes.shape[0], -1)
        rows, cols = codes.shape
        values = codes.astype(np.float32).reshape(rows, -1, self.group_size) * self.scale.astype(np.float32)[..., None]
        if self.zero is not None:
            values = values + self.zero.astype(np.float32)[..., None]
        return values.reshape(rows, cols)

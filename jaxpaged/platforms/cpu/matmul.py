"""Matmuls on CPU, float32 activations, against weights packed once (matmul.cc behind XLA FFI custom calls).

XLA:CPU repacks a weight on every dot of many rows and streams it several times for few; packed at load time
into 32-column panels, each step reads every weight once, in order. PackedLinear and PackedEmbedding put it
behind the models' layer methods (the CPU platform's prepare_model packs the weights). 8-bit weights quantized
per output channel (int8, fp8 e4m3fn: ChannelLinear) are packed the same way, 1 byte an element, and decoded
inside the kernel (PackedChannelLinear), where XLA:CPU would write the whole float weight out every step.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.platforms.cpu import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("matmul.cc")
TARGET = "jaxpaged_packed_matmul_cpu"
PANEL = 32  # columns per panel (matmul.cc's kPanel)
SCALED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))  # 8-bit weights the scaled kernel decodes


def scaled_target(target: str) -> str:
    """The name the 8-bit (scaled) kernel of the build registered as `target` has."""
    return f"{target}_scaled"


def register(target: str, flags=native_build.CXXFLAGS, cache_dir: str | None = None) -> int:
    """Build with `flags`, register the float32 kernel as `target` and the 8-bit one as scaled_target(target);
    the floats per vector the build uses."""
    lib = ctypes.CDLL(str(native_build.build(SOURCE, flags, cache_dir)))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.JaxpagedPackedMatmul), platform="cpu")
    jax.ffi.register_ffi_target(
        scaled_target(target), jax.ffi.pycapsule(lib.JaxpagedPackedScaledMatmul), platform="cpu"
    )
    return lib.JaxpagedPackedMatmulLanes()


@functools.cache
def lanes() -> int:
    """Floats per vector of this machine's build (16 with AVX-512); 0 where it cannot be built."""
    try:
        return register(TARGET)
    except Exception as e:  # noqa: BLE001 - any failure means: XLA's dot
        logger.warning("the native CPU matmul is unavailable, using XLA's dot: %s", e)
        return 0


def may_take_auto() -> bool:
    """Whether matmul_backend="auto" could pick the kernel on this CPU (AVX-512), before building it."""
    return "avx512f" in native_build.cpu_flags()


def start_build() -> None:
    """Compile the kernel in the background where "auto" may take it (see native_build.start_build)."""
    if may_take_auto():
        native_build.start_build(SOURCE)


def available() -> bool:
    """Builds (once per machine) and registers the kernel; False, with a warning, where that fails."""
    return lanes() > 0


def pack(kernel: jax.Array) -> jax.Array:
    """[K, N] -> panels [ceil(N / 32), K, 32], zero past column N. Done on the host, once per weight at load:
    eager jnp ops would compile a program for every weight shape. Traced (a weight update lays new weights out
    inside one jitted program: worker/weight_update.py), the same layout in jnp."""
    if isinstance(kernel, jax.core.Tracer):
        return _panels(kernel.T)
    kernel = np.asarray(kernel)
    k, n = kernel.shape
    panels = np.zeros((-(-n // PANEL) * PANEL, k), kernel.dtype)
    panels[:n] = kernel.T
    return jax.device_put(panels.reshape(-1, PANEL, k).transpose(0, 2, 1).copy())


def pack_rows(table: jax.Array) -> jax.Array:
    """pack(table.T) for a [N, K] table (a tied LM head's embedding), without a transposed copy."""
    if isinstance(table, jax.core.Tracer):
        return _panels(table)
    table = np.asarray(table)
    n, k = table.shape
    panels = np.zeros((-(-n // PANEL) * PANEL, k), table.dtype)
    panels[:n] = table
    return jax.device_put(panels.reshape(-1, PANEL, k).transpose(0, 2, 1).copy())


def _panels(rows: jax.Array) -> jax.Array:
    """[N, K] rows (traced) -> [ceil(N / 32), K, 32] panels, zero past row N: what pack and pack_rows make."""
    n, k = rows.shape
    padded = jnp.pad(rows, ((0, -(-n // PANEL) * PANEL - n), (0, 0)))
    return padded.reshape(-1, PANEL, k).transpose(0, 2, 1)


def unpack(packed: jax.Array, n: int) -> jax.Array:
    """pack's inverse: [K, n]."""
    panels, k, _ = packed.shape
    return packed.transpose(1, 0, 2).reshape(k, panels * PANEL)[:, :n]


def packed_rows(packed: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows `ids` of the [N, K] table that pack_rows packed: [..., K]."""
    return packed[ids // PANEL, :, ids % PANEL]


def packed_matmul(
    x: jax.Array, packed: jax.Array, n: int, scale: jax.Array | None = None, *, target: str = TARGET
) -> jax.Array:
    """x [..., K] float32 @ the [K, n] weight that `pack` packed: [..., n] float32. With `scale` [n], the packed
    weight is int8 or float8_e4m3fn and the product is (x @ packed) * scale, the weight decoded in the kernel."""
    if target == TARGET and not available():
        raise RuntimeError("the native CPU matmul could not be built; see the warning logged above")
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).astype(jnp.float32)
    out = jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32)
    if scale is None:
        y = jax.ffi.ffi_call(target, out, vmap_method="sequential")(rows, packed)
    else:
        if packed.dtype not in SCALED_DTYPES:
            raise TypeError(f"the scaled packed matmul reads int8 or float8_e4m3fn weights (got {packed.dtype})")
        call = jax.ffi.ffi_call(scaled_target(target), out, vmap_method="sequential")
        y = call(rows, packed, scale.astype(jnp.float32))
    return y.reshape(*lead, n)


def resolve_matmul_backend(requested: str, *, platform: str, dtype, tensor_parallel_size: int) -> str:
    """ "auto" -> "native" where it applies (float32, one CPU device) and the kernel builds with AVX-512 (16-float
    vectors: the build measured faster than XLA's dot; narrower ones are correct but were not measured faster),
    else "xla"."""
    applies = platform == "cpu" and jnp.dtype(dtype) == jnp.float32 and tensor_parallel_size == 1
    if requested == "auto":  # a CPU without AVX-512 never gets 16 lanes: no need to build to find out
        return "native" if applies and may_take_auto() and lanes() >= 16 else "xla"
    if requested == "native" and not (applies and available()):
        why = "it does not build here" if applies else "it serves float32 on one CPU device only"
        raise ValueError(f"matmul_backend='native' is the packed float32 CPU matmul, and {why}")
    if requested not in ("xla", "native"):
        raise ValueError(f"matmul_backend must be 'auto', 'xla' or 'native' (got {requested!r})")
    return requested


@dataclasses.dataclass(frozen=True)
class PackedLinear:
    """A Linear whose kernel `pack` has packed."""

    def apply(self, layer, x: jax.Array) -> jax.Array:
        return packed_matmul(x, layer.kernel[...], layer.out_features)


@dataclasses.dataclass(frozen=True)
class PackedChannelLinear:
    """A ChannelLinear (8-bit kernel, float32 scale per output channel) whose kernel `pack` has packed: decoded
    in the kernel, y = (x @ q) * scale."""

    def apply(self, layer, x: jax.Array) -> jax.Array:
        return packed_matmul(x, layer.kernel[...], layer.out_features, layer.scale[...])


@dataclasses.dataclass(frozen=True)
class PackedEmbedding:
    """An Embedding (a tied LM head) whose table `pack_rows` has packed: rows read back out of the panels."""

    def lookup(self, layer, ids: jax.Array) -> jax.Array:
        return packed_rows(layer.embedding[...], ids)

    def attend(self, layer, x: jax.Array) -> jax.Array:
        return packed_matmul(x, layer.embedding[...], layer.num_embeddings)

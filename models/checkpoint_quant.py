"""Pre-quantized safetensors checkpoints (config.json's `quantization_config`), read into models/quantization.py's
host containers so the weights stay quantized on the device.

A quantized Linear is several tensors in the checkpoint (codes, scales, zero points, shapes); a format here turns
them into one ChannelQuantized or GroupQuantized under the Linear's `X.weight` name, exactly (no requantization:
the containers' dequantization equals the format's own, up to float32 rounding of an exact product). Conventions:

- compressed-tensors (vLLM / llm-compressor): w = (q - z) * s with q and z signed (num_bits wide) and z = 0 when
  symmetric. int-/float-/naive-quantized store `weight` as int8 or float8_e4m3fn; pack-quantized stores
  `weight_packed` int32 [out, in * bits / 32], element i at bits [bits * i, bits * (i + 1)) of the little-endian
  stream, offset by 2 ** (bits - 1), and an asymmetric `weight_zero_point` packed the same way along the
  *output* axis. Scales: [out, in / group] (group), [out, 1] (channel), [1] (tensor).
- GPTQ (AutoGPTQ / GPTQModel): `qweight` int32 [in * bits / 32, out] packed along the input axis (row 32/bits * i
  + k at bits [bits * k, ...)), `qzeros` int32 [groups, out * bits / 32] packed along the output axis, `scales`
  [groups, out]; w = s * (q - z). checkpoint_format "gptq" (v1, the default) stores z - 1 per value: AutoGPTQ's
  dequantization unpacks each zero and adds 1 (no carry, so a stored 15 is 16), which is what is done here;
  "gptq_v2" stores z. Act-order (`desc_act`) checkpoints whose g_idx is not i // group_size are refused.
- AWQ (AutoAWQ GEMM): `qweight` int32 [in, out / 8] and `qzeros` int32 [groups, out / 8], packed along the output
  axis in AWQ's order (nibble i of a word holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]), `scales` [groups, out];
  w = s * (q - z).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

logger = logging.getLogger("jaxpaged.loader")

SUPPORTED = (
    "compressed-tensors int-quantized / naive-quantized (int8 per channel or tensor, int8 or int4 values per group), "
    "float-quantized (fp8 e4m3 per channel or tensor) and pack-quantized (int4 or int8 per group, channel or tensor); "
    "gptq (4 or 8 bits, checkpoint_format gptq or gptq_v2, without act-order); awq (4-bit GEMM with zero points); "
    "mxfp4 (GPT-OSS experts: 4-bit with moe_kernel='triton', else dequantized at load); fp8 (block-wise or per tensor, DeepSeek-V3's and transformers' "
    "finegrained FP8, dequantized at load)"
)
CT_FORMATS = ("int-quantized", "float-quantized", "naive-quantized", "pack-quantized")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column 8c + AWQ_ORDER[i] sits in nibble i
ACTIVATIONS = ("static input activation quantization: activations stay in the model dtype, or quantize_activations "
               "quantizes them per token")  # fmt: skip

Read = Callable[[str], tuple[np.ndarray, str]]  # a tensor's array and the file it came from


def _refuse(method: str, what: str | None, source: str) -> ValueError:
    holds = f"a {method} checkpoint with {what}" if what else f"a {method!r}-quantized checkpoint"
    return ValueError(
        f"{source} holds {holds}, which jaxpaged cannot load; supported pre-quantized checkpoints: {SUPPORTED}. "
        "Load its float original (quantization='int8' or 'fp8' quantizes at load) or a GGUF instead"
    )


def checkpoint_format(qcfg: dict | None, source: str, dtype=np.float32, keep_mxfp4: bool = False) -> CheckpointFormat | None:
    """The reader for a config.json `quantization_config`; ValueError naming what is refused. dtype: what a format
    that dequantizes at load (fp8 blocks) casts to. keep_mxfp4: MXFP4 experts stay 4-bit (the engine's expert loop
    reads them: Platform.keeps_mxfp4), else they are dequantized at load."""
    if not qcfg:
        return None
    method = str(qcfg.get("quant_method", "unknown")).lower()
    if method == "mxfp4":  # GPT-OSS's experts: kept 4-bit for the grouped GEMM, else dequantized at load (models/mxfp4.py)
        from jaxpaged.models.mxfp4 import Mxfp4

        return Mxfp4(qcfg, source, keep=keep_mxfp4)
    if method == "fp8":  # block-wise FP8 (DeepSeek-V3, Kimi K2): dequantized at load (models/fp8_blocks.py)
        from jaxpaged.models.fp8_blocks import Fp8Blocks

        return Fp8Blocks(qcfg, source, dtype)
    readers = {"compressed-tensors": CompressedTensors, "gptq": GPTQ, "awq": AWQ}
    if method not in readers:
        raise _refuse(method, None, source)
    return readers[method](qcfg, source)


class CheckpointFormat:
    """Groups each quantized Linear's tensors into one container named `X.weight`; other tensors pass through."""

    name = ""
    parts: tuple[str, ...] = ()  # suffixes of a quantized Linear's tensors; parts[0] marks one
    dropped: dict[str, str] = {}  # suffix -> why tensors ending so are read nowhere (activation scales)

    def _prefix(self, name: str, names: set[str]) -> str | None:
        for suffix in self.parts:
            if name.endswith(suffix):
                prefix = name[: -len(suffix)]
                if self._is_quantized(prefix, names):
                    return prefix
        return None

    def _is_quantized(self, prefix: str, names: set[str]) -> bool:
        return prefix + self.parts[0] in names

    def tensors(self, names: Iterable[str], read: Read, skip: Callable[[str, str], None]) -> Iterator[tuple[str, Any, str]]:
        """skip(name, why): told of each tensor dropped unread (models/accounting.py logs them)."""
        names = list(names)
        present, done = set(names), set()
        for name in names:
            prefix = self._prefix(name, present)
            if prefix is None:
                suffix = next((s for s in self.dropped if name.endswith(s)), None)
                if suffix is None:
                    yield (name, *read(name))
                else:
                    skip(name, self.dropped[suffix])
                continue
            if prefix in done:
                continue
            done.add(prefix)
            got = {s: read(prefix + s) for s in self.parts if prefix + s in present}
            source = next(iter(got.values()))[1]
            try:
                value = self.convert(prefix, {s: a for s, (a, _) in got.items()})
            except ValueError as exc:
                raise ValueError(f"{self.name} tensors of {prefix} in {source}: {exc}") from exc
            yield prefix + ".weight", value, source

    def convert(self, prefix: str, parts: dict[str, np.ndarray]):
        raise NotImplementedError


# -- bit unpacking shared by the formats ----------------------------------------------------------


def _bytes(words: np.ndarray) -> np.ndarray:
    """int32 [..., n] -> uint8 [..., 4n] in little-endian order: the packing stream, whatever the host's order."""
    words = np.ascontiguousarray(words, dtype="<i4")
    return words.view(np.uint8).reshape(*words.shape[:-1], -1)


def _nibbles(stream: np.ndarray) -> np.ndarray:
    """uint8 [..., n] -> [..., 2n] (low nibble first)."""
    return np.stack([stream & 0xF, stream >> 4], axis=-1).reshape(*stream.shape[:-1], -1)


def _unsigned(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """int32 words packed along the last axis, `bits` per value from bit 0 up -> the first `count` values, int32."""
    stream = _bytes(words)
    values = _nibbles(stream) if bits == 4 else stream
    return values[..., :count].astype(np.int32)


def _group(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bits: int, scheme: str):
    """codes [out, in] int8 (bits 8) or [out, in / 2] uint8 (bits 4, pack_int4 along in), scale and zero
    [out, groups] -> GroupQuantized."""
    from jaxpaged.models.quantization import GroupQuantized

    cols = codes.shape[1] * (2 if bits == 4 else 1)
    groups = scale.shape[1]
    if cols % groups:
        raise ValueError(f"{groups} scale groups do not divide {cols} input features")
    return GroupQuantized(np.ascontiguousarray(codes), np.ascontiguousarray(scale), zero, bits, cols // groups, scheme)


# -- compressed-tensors ---------------------------------------------------------------------------


def _ct_weights_ok(args: dict, fmt: str, group: str, source: str) -> None:
    method = f"compressed-tensors ({fmt})"
    kind, bits, strategy = args.get("type", "int"), int(args.get("num_bits", 8)), args.get("strategy")
    scheme = f"{kind}{bits} {strategy} weights (group {group!r})"
    if args.get("dynamic") not in (False, None):
        raise _refuse(method, f"dynamic {scheme}", source)
    if args.get("actorder") in ("group", "dynamic"):
        raise _refuse(method, f"{scheme} in activation order (actorder={args['actorder']!r}, a g_idx per weight)", source)
    if kind == "float":
        if bits != 8 or strategy not in ("channel", "tensor") or not args.get("symmetric", True):
            raise _refuse(method, scheme, source)
    elif kind != "int" or bits not in (4, 8) or strategy not in ("channel", "tensor", "group"):
        raise _refuse(method, scheme, source)
    elif strategy == "tensor" and not args.get("symmetric", True):
        raise _refuse(method, f"asymmetric {scheme}", source)
    if strategy == "group" and not args.get("group_size"):
        raise _refuse(method, f"{scheme} without a group_size", source)


class CompressedTensors(CheckpointFormat):
    name = "compressed-tensors"
    parts = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx", ".weight")
    dropped = {
        **dict.fromkeys((".input_scale", ".input_zero_point", ".input_global_scale"), ACTIVATIONS),
        **dict.fromkeys((".output_scale", ".output_zero_point"), "output activation quantization: not applied"),
        **dict.fromkeys((".k_scale", ".v_scale", ".q_scale"), "attention (KV cache) scales: kv_cache_dtype chooses the cache"),
    }  # fmt: skip

    def __init__(self, qcfg: dict, source: str):
        top = qcfg.get("format") or "dense"
        status = qcfg.get("quantization_status", "compressed")
        if status != "compressed":
            raise _refuse("compressed-tensors", f"quantization_status {status!r} (saved uncompressed)", source)
        for key in ("sparsity_config", "transform_config"):
            extra = qcfg.get(key) or {}
            if extra and (key == "transform_config" or extra.get("format", "dense") != "dense"):
                raise _refuse("compressed-tensors", f"a {key} ({extra.get('format') or 'rotations'})", source)
        self.formats: set[str] = set()
        for group, scheme in (qcfg.get("config_groups") or {}).items():
            if not isinstance(scheme, dict):
                continue
            fmt = scheme.get("format") or top
            weights = scheme.get("weights")
            if weights:
                if fmt not in CT_FORMATS:
                    raise _refuse("compressed-tensors", f"format {fmt!r}", source)
                _ct_weights_ok(weights, fmt, group, source)
                self.formats.add(fmt)
            for kind in ("input_activations", "output_activations"):
                act = scheme.get(kind)
                if act:
                    logger.info(
                        "%s: the checkpoint's %s%s %s quantization (%s) is not applied as stored: activations stay in "
                        "the model dtype, or with quantize_activations are quantized per token in the step", source,
                        act.get("type", "int"),
                        act.get("num_bits", 8), kind.replace("_", " "), "dynamic" if act.get("dynamic") else "static",
                    )  # fmt: skip
        if qcfg.get("kv_cache_scheme"):
            logger.info("%s: the checkpoint's kv_cache_scheme is ignored (kv_cache_dtype chooses the KV cache)", source)
        if not self.formats:
            raise _refuse("compressed-tensors", f"format {top!r} and no weight quantization", source)
        logger.info("loading a compressed-tensors (%s) checkpoint: weights stay quantized", ", ".join(sorted(self.formats)))

    def _is_quantized(self, prefix: str, names: set[str]) -> bool:
        return prefix + ".weight_packed" in names or (prefix + ".weight" in names and prefix + ".weight_scale" in names)

    def convert(self, prefix: str, parts: dict[str, np.ndarray]):
        from jaxpaged.models.quantization import ChannelQuantized

        if ".weight_g_idx" in parts:
            raise ValueError("activation-ordered groups (weight_g_idx) are not supported")
        scale = np.asarray(parts[".weight_scale"])
        zp = parts.get(".weight_zero_point")
        if ".weight_packed" in parts:
            out, cols = (int(d) for d in np.asarray(parts[".weight_shape"]).reshape(-1))
            packed = np.asarray(parts[".weight_packed"])
            if packed.dtype != np.int32 or packed.shape[0] != out:
                raise ValueError(f"weight_packed is {packed.dtype} {packed.shape}, expected int32 [{out}, ...]")
            bits = packed.shape[1] * 32 // cols
            if bits not in (4, 8) or packed.shape[1] != -(-cols * bits // 32):
                raise ValueError(f"weight_packed {packed.shape} for weight_shape {(out, cols)} is not 4 or 8 bits")
            scale = self._scale(scale, out)
            offset = 1 << (bits - 1)
            if cols % 2:
                raise ValueError(f"weight_shape {(out, cols)} has an odd number of input features")
            stream = _bytes(packed)[:, : cols * bits // 8]  # q + offset, in order (two per byte when bits == 4)
            if zp is None:
                z = np.full(scale.shape, offset, np.int32)
            else:  # packed along the output axis, offset like the weights
                zp = np.asarray(zp)
                if zp.dtype != np.int32:
                    raise ValueError(f"weight_zero_point is {zp.dtype}, expected packed int32")
                z = _unsigned(np.ascontiguousarray(zp.T), bits, out).T
                if z.shape != scale.shape:
                    raise ValueError(f"weight_zero_point unpacks to {z.shape}, but weight_scale is {scale.shape}")
            if bits == 4:  # codes as stored (q + 8): w = (code - (z + 8)) * s
                return _group(stream, scale, -(z.astype(np.float32) * scale.astype(np.float32)), 4, "compressed-tensors int4")
            q = (stream.astype(np.int16) - offset).astype(np.int8)
            if zp is None and scale.shape[1] == 1:
                return ChannelQuantized(q, scale[:, 0].astype(np.float32))
            zero = None if zp is None else -((z - offset).astype(np.float32) * scale.astype(np.float32))
            return _group(q, scale, zero, 8, "compressed-tensors int8")
        weight = np.asarray(parts[".weight"])
        out, cols = weight.shape
        scale = self._scale(scale, out)
        if weight.dtype == np.int8:
            if zp is None and scale.shape[1] == 1:
                return ChannelQuantized(weight, scale[:, 0].astype(np.float32))
            zero = None
            if zp is not None:
                zp = np.asarray(zp).astype(np.float32).reshape(out, -1)
                if zp.shape != scale.shape:
                    raise ValueError(f"weight_zero_point is {zp.shape}, but weight_scale is {scale.shape}")
                zero = -(zp * scale.astype(np.float32))
            return _group(weight, scale, zero, 8, "compressed-tensors int8")
        if weight.dtype.name == "float8_e4m3fn":
            if zp is not None or scale.shape[1] != 1:
                raise ValueError("fp8 weights are supported per channel or per tensor, symmetric")
            return ChannelQuantized(weight, scale[:, 0].astype(np.float32))
        raise ValueError(f"weight is {weight.dtype}; expected int8 or float8_e4m3fn beside a weight_scale")

    @staticmethod
    def _scale(scale: np.ndarray, out: int) -> np.ndarray:
        """[out, groups]: a tensor scale ([1] or []) broadcast over the rows."""
        if scale.size == 1:
            return np.full((out, 1), scale.reshape(()), scale.dtype)
        if scale.ndim == 1:
            scale = scale[:, None]
        if scale.ndim != 2 or scale.shape[0] != out:
            raise ValueError(f"weight_scale is {scale.shape}, expected [{out}, groups]")
        return scale


# -- GPTQ and AWQ ---------------------------------------------------------------------------------


def _int_field(qcfg: dict, *keys: str, default=None):
    for key in keys:
        if qcfg.get(key) is not None:
            return int(qcfg[key])
    return default


class GPTQ(CheckpointFormat):
    name = "gptq"
    parts = (".qweight", ".qzeros", ".scales", ".g_idx")

    def __init__(self, qcfg: dict, source: str):
        self.bits = _int_field(qcfg, "bits", "w_bit", default=4)
        self.group_size = _int_field(qcfg, "group_size", "q_group_size", default=128)
        fmt = str(qcfg.get("checkpoint_format") or qcfg.get("format") or "gptq").lower()
        if self.bits not in (4, 8):
            raise _refuse("gptq", f"{self.bits}-bit weights (4 and 8 are supported)", source)
        if fmt not in ("gptq", "gptq_v2"):
            raise _refuse("gptq", f"checkpoint_format {fmt!r}", source)
        if str(qcfg.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
            raise _refuse("gptq", f"pack_dtype {qcfg['pack_dtype']!r}", source)
        overrides = [k for k in (qcfg.get("dynamic") or {}) if not str(k).startswith("-:")]
        if overrides:
            raise _refuse("gptq", f"per-module `dynamic` overrides ({', '.join(map(str, overrides[:3]))})", source)
        self.v1 = fmt == "gptq"
        self.desc_act = bool(qcfg.get("desc_act"))
        self.source = source
        logger.info(
            "loading a GPTQ checkpoint (%d-bit, group %d, %s): weights stay quantized",
            self.bits, self.group_size, "v1 zeros + 1" if self.v1 else "v2 zeros",
        )  # fmt: skip

    def convert(self, prefix: str, parts: dict[str, np.ndarray]):
        bits = self.bits
        qweight, scales = np.asarray(parts[".qweight"]), np.asarray(parts[".scales"])
        if ".qzeros" not in parts:
            raise ValueError("qzeros is missing")
        if qweight.dtype != np.int32:
            raise ValueError(f"qweight is {qweight.dtype}, expected int32")
        cols, out = qweight.shape[0] * 32 // bits, qweight.shape[1]
        groups = scales.shape[0]
        if scales.shape[1] != out or cols % groups:
            raise ValueError(f"scales {scales.shape} do not fit qweight {qweight.shape} ({bits}-bit)")
        group_size = cols // groups
        if self.group_size not in (-1, group_size):
            raise ValueError(f"scales imply group size {group_size}, but the config says {self.group_size}")
        g_idx = parts.get(".g_idx")
        if g_idx is not None and not np.array_equal(np.asarray(g_idx).reshape(-1), np.arange(cols) // group_size):
            raise ValueError(
                "its g_idx is not i // group_size: act-order (desc_act) GPTQ checkpoints are not supported; "
                "quantize with desc_act=False (or load the float original)"
            )
        if g_idx is None and self.desc_act:
            raise ValueError("desc_act is set but there is no g_idx: act-order GPTQ checkpoints are not supported")
        # qweight rows pack 32/bits consecutive inputs, lowest bits first: its little-endian bytes, put output-major,
        # are the inputs in order (two per byte, low nibble first, when bits == 4)
        stream = _bytes(qweight.T)  # [out, cols * bits / 8]
        z = _unsigned(np.asarray(parts[".qzeros"]), bits, out)  # [groups, out]
        if self.v1:
            z = z + 1
        s = np.ascontiguousarray(scales.T)  # [out, groups]
        zf = z.T.astype(np.float32)
        if bits == 4:
            return _group(stream, s, -(zf * s.astype(np.float32)), 4, "gptq")
        signed = (stream.astype(np.int16) - 128).astype(np.int8)  # q - 128: w = (q' - (z - 128)) * s
        return _group(signed, s, -((zf - 128.0) * s.astype(np.float32)), 8, "gptq")


class AWQ(CheckpointFormat):
    name = "awq"
    parts = (".qweight", ".qzeros", ".scales")

    def __init__(self, qcfg: dict, source: str):
        bits = _int_field(qcfg, "bits", "w_bit", default=4)
        version = str(qcfg.get("version", "gemm")).lower()
        if bits != 4:
            raise _refuse("awq", f"{bits}-bit weights (4 is supported)", source)
        if version != "gemm":
            raise _refuse("awq", f"version {version!r} (the GEMM layout is supported)", source)
        if qcfg.get("zero_point", True) is False:
            raise _refuse("awq", "zero_point=False", source)
        self.group_size = _int_field(qcfg, "group_size", "q_group_size", default=128)
        logger.info("loading an AWQ checkpoint (4-bit GEMM, group %d): weights stay quantized", self.group_size)

    def convert(self, prefix: str, parts: dict[str, np.ndarray]):
        from jaxpaged.models.quantization import pack_int4

        qweight, scales = np.asarray(parts[".qweight"]), np.asarray(parts[".scales"])
        if ".qzeros" not in parts:
            raise ValueError("qzeros is missing")
        if qweight.dtype != np.int32:
            raise ValueError(f"qweight is {qweight.dtype}, expected int32")
        cols, out = qweight.shape[0], qweight.shape[1] * 8
        if scales.shape[1] != out or cols % scales.shape[0]:
            raise ValueError(f"scales {scales.shape} do not fit qweight {qweight.shape}")
        if self.group_size not in (-1, cols // scales.shape[0]):
            raise ValueError(f"scales imply group size {cols // scales.shape[0]}, but the config says {self.group_size}")
        inverse = np.argsort(AWQ_ORDER)  # nibble holding column 8c + j

        def unpack(words):  # [rows, out / 8] -> [rows, out], columns in order
            nib = _nibbles(_bytes(words)).reshape(words.shape[0], -1, 8)
            return nib[..., inverse].reshape(words.shape[0], -1)

        codes = pack_int4(unpack(qweight).T, axis=1)  # [out, in / 2]
        z = unpack(np.asarray(parts[".qzeros"])).T.astype(np.float32)  # [out, groups]
        s = np.ascontiguousarray(scales.T)
        return _group(codes, s, -(z * s.astype(np.float32)), 4, "awq")

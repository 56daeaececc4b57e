"""load_model: a local HF folder, a .gguf file, a bare config.json or a hub id -> a Flax port with weights.

A hub id is resolved to its snapshot folder by models/hub.py (safetensors only); no pickle is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxpaged import platforms
from jaxpaged.config import QUANTIZATION_CHOICES
from jaxpaged.models import checkpoint_quant, convert_cache, gguf_io, hub, orbax_io, pooling_head, safetensors_io, tiktoken_folder
from jaxpaged.models.accounting import TensorLedger
from jaxpaged.models.builtin import builtin_gguf_path
from jaxpaged.models.config import ModelConfig, text_config
from jaxpaged.models.registry import resolve_architecture
from jaxpaged.models.tying import COPY
from jaxpaged.models.tying import decide as tied_head
from jaxpaged.models.weights import WeightPrograms, load_tensors_into, param_bytes, random_tensors
from jaxpaged.utils.logging_utils import progress_hidden
from jaxpaged.pallas_kernels import AttentionBackend
from jaxpaged.platforms import Platform
from jaxpaged.worker.executable_cache import ExecutableCache
from tqdm.auto import tqdm

logger = logging.getLogger("jaxpaged.loader")

GGUF_DEFAULTS = {
    "gguf": "kept quantized as stored (Q8_0/Q4_0/Q4_1/Q4_K)",
    "none": "dequantized to floats for this platform's float matmuls (quantization='gguf' keeps them quantized: less "
            "memory, slower here)",
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclasses.dataclass
class LoadedModel:
    model: nnx.Module  # the port with real weights; nnx.split it once for jitted steps
    config: ModelConfig
    hf_config: Any
    tokenizer: Any  # a transformers tokenizer, or None when the checkpoint has none
    source: str
    dtype: str
    quantization: str | None = None  # the scheme the weights were loaded with (a GGUF's platform default resolved)
    weights_seconds: float = 0.0  # of the load, reading the weights onto the device (the rest: config, imports, tokenizer)
    skipped_tensors: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # reason -> checkpoint names
    # the rest of the load where an HF folder's reader times it: "config" (AutoConfig, transformers' imports with it),
    # "build" (headers, the port's config, the unloaded model), "tokenizer"; a start-up report's breakdown
    load_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # an embedding or classification checkpoint's task, pooling and classifier (models/pooling_head.py); None for others
    pooling: pooling_head.PoolingInfo | None = None


def resolve_dtype(dtype: str) -> str:
    name = DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    return name


def _progress(items: Iterable, total: int, desc: str) -> Iterator:
    return iter(tqdm(items, total=total, desc=desc, unit="tensor", leave=False, disable=progress_hidden()))


def _port_config(hf_config):
    """(the Flax port's class, its ModelConfig) for an HF config."""
    arch, cls = resolve_architecture(getattr(hf_config, "architectures", None), getattr(hf_config, "model_type", None))
    if hasattr(cls, "port_for"):  # an architecture some of whose configs another class serves (LLaVA with a Pixtral tower)
        cls = cls.port_for(hf_config)
    return cls, cls.config_from_hf(hf_config, arch)


def _build(cls, cfg: ModelConfig, dtype_name: str, choose_attention: Callable[[int], AttentionBackend]):
    # a port whose attention is not per-head K/V (MLA) says which head dim its kernels take
    attention = choose_attention(cls.kernel_head_dim(cfg) if hasattr(cls, "kernel_head_dim") else cfg.head_dim)
    logger.info("attention backend: %s", attention.name)
    return cls(cfg, dtype=DTYPES[dtype_name], attention=attention)  # parameters are shapes until loaded


def _abstract_model(hf_config, dtype_name: str, choose_attention: Callable[[int], AttentionBackend]):
    cls, cfg = _port_config(hf_config)
    return cfg, _build(cls, cfg, dtype_name, choose_attention), cls.weight_specs(cfg)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ValueError(f"could not read the shard index {index}: {exc}") from exc
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.exists():
                raise FileNotFoundError(f"shard {f} listed in {index.name} is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{folder} holds only pickle checkpoints ({', '.join(pickles)}); jaxpaged never loads pickle files "
            "because unpickling can run arbitrary code. Convert the checkpoint to safetensors first "
            "(e.g. transformers' `model.save_pretrained(dir, safe_serialization=True)`)."
        )
    raise FileNotFoundError(f"no *.safetensors weights found in {folder}")


def _safetensors_tensors(where: dict, fmt: checkpoint_quant.CheckpointFormat | None, ledger: TensorLedger) -> Iterator:
    """(name, array, file) triples, each array a read-only view of the file's memory map (models/safetensors_io.py);
    `fmt` (a pre-quantized checkpoint) groups each quantized Linear's tensors, telling `ledger` what it drops."""
    if fmt is not None:
        return fmt.tensors(where, lambda name: (where[name].tensor(name), str(where[name].path)), ledger.skip)
    return safetensors_io.tensors_in_order(where)


def _load_tokenizer(folder: Path):
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        logger.info("no tokenizer files in %s; requests must pass token ids", folder)
        return None
    from transformers import AutoTokenizer

    try:
        # a tiktoken.model behind a remote-code tokenizer (Kimi K2, Moonlight): rebuilt without that code
        if remote := tiktoken_folder.remote_tiktoken_class(folder):
            return tiktoken_folder.load_tiktoken_folder(folder, remote)
        # never a checkpoint's own code (trust_remote_code None would ask on a terminal whether to run it)
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as exc:
        raise ValueError(f"could not load the tokenizer in {folder}: {exc}") from exc


WEIGHT_COMPILE_THREADS = 4  # the weights' cast/transpose programs compiled at once on a first start (models/weights.py)

# Where AutoGPTQ and AutoAWQ wrote their settings before config.json carried a quantization_config.
SIDE_QUANT_CONFIGS = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


def _checkpoint_quantization(hf_config, folder: Path, dtype_name: str = "float32",
                             keep_mxfp4: bool = False) -> checkpoint_quant.CheckpointFormat | None:  # fmt: skip
    """The reader of the checkpoint's own quantization (config.json's quantization_config, else AutoGPTQ's or
    AutoAWQ's side file); ValueError naming a method or scheme jaxpaged does not load."""
    qcfg = getattr(hf_config, "quantization_config", None)
    if qcfg and not isinstance(qcfg, dict):
        qcfg = qcfg.to_dict()
    for name, method in SIDE_QUANT_CONFIGS.items():
        if not qcfg and (folder / name).exists():
            try:
                qcfg = {"quant_method": method, **json.loads((folder / name).read_text())}
            except ValueError as exc:
                raise ValueError(f"could not read {folder / name}: {exc}") from exc
    return checkpoint_quant.checkpoint_format(qcfg, str(folder), np.dtype(DTYPES[dtype_name]), keep_mxfp4)


def apply_hf_overrides(hf_config, overrides: dict | None):
    """vLLM's hf_overrides: each field set on the config (and on its text config, where that holds the field too)."""
    if not overrides:
        return hf_config
    text = text_config(hf_config)
    for name, value in overrides.items():
        setattr(hf_config, name, value)
        if text is not hf_config and hasattr(text, name):
            setattr(text, name, value)
    logger.info("config fields overridden (hf_overrides): %s", ", ".join(f"{k}={v!r}" for k, v in overrides.items()))
    return hf_config


def _load_hf_folder(folder: Path, dtype_name: str, choose_attention, quantization: str | None = None, timed: dict | None = None,
                    programs: WeightPrograms | None = None, keep_mxfp4: bool = False, hf_overrides: dict | None = None):  # fmt: skip
    """timed: filled with the seconds of the config's read (imports included) and the tokenizer's. keep_mxfp4: an
    MXFP4 checkpoint's experts stay 4-bit (models/mxfp4.py). hf_overrides: fields set over config.json's. Returns the
    load's result and the folder's PoolingInfo."""
    timed = {} if timed is None else timed
    t0 = time.perf_counter()
    from transformers import AutoConfig

    config_file = folder / "config.json"
    try:
        # never a checkpoint's own code (trust_remote_code None would ask on a terminal whether to run it)
        hf_config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as exc:
        hf_config = _aliased_config(config_file)
        if hf_config is None:
            raise ValueError(f"could not read {config_file}: {exc}") from exc
    hf_config = apply_hf_overrides(hf_config, hf_overrides)
    timed["config"] = time.perf_counter() - t0
    fmt = _checkpoint_quantization(hf_config, folder, dtype_name, keep_mxfp4)
    if fmt is not None and quantization in ("int8", "fp8") and not getattr(fmt, "dequantizes", False):
        logger.info("%s is already %s-quantized: loading it as stored, not as %s", folder.name, fmt.name, quantization)
        quantization = None
    t0 = time.perf_counter()
    cls, cfg = _port_config(hf_config)
    where = safetensors_io.open_files(_safetensors_files(folder))
    ledger = TensorLedger(cls.SKIPPED_TENSORS)
    # tensors a config-dependent rule skips before reading (DeepSeek's MTP layer: never dequantized nor stacked)
    where = ledger.skip_unread(where, cls.unread_tensors(cfg) if hasattr(cls, "unread_tensors") else ())
    # a pooling checkpoint's task, pooling and classifier (read here, from the headers just opened), then its head
    pooling = pooling_head.pooling_info(folder, hf_config, lambda name: where[name].tensor(name) if name in where else None)
    cfg = pooling_head.prepare_load(folder, hf_config, cls, cfg, list(where), ledger, pooling)
    tying = tied_head(cls, cfg, list(where), lambda name: where[name].tensor(name))
    cfg = tying.config
    model = _build(cls, cfg, dtype_name, choose_attention)
    timed["build"] = time.perf_counter() - t0  # the files' headers, the port's config, the attention backend's choice
    if tying.head_is_copy:
        ledger.explain(tying.head, COPY)
    tensors = _progress(_safetensors_tensors(where, fmt, ledger), len(where), "Loading weights")
    weights_s = load_tensors_into(model, tying.specs(cls.weight_specs(cfg)), tensors, DTYPES[dtype_name], quantization, ledger, programs)
    t0 = time.perf_counter()
    tokenizer = _load_tokenizer(folder)
    timed["tokenizer"] = time.perf_counter() - t0
    return model, cfg, hf_config, tokenizer, weights_s, ledger.closed, pooling


def _load_gguf(path: Path, dtype_name: str, choose_attention, cache_dir: str | None, use_cache: bool, quantization: str | None,
               timed: dict | None = None, programs: WeightPrograms | None = None):  # fmt: skip
    """quantization="gguf": Q8_0, Q4_0, Q4_1 and Q4_K tensors stay quantized (models/quantization.py), other types
    are dequantized to dtype. Otherwise every tensor is dequantized, once (the floats are cached as an HF folder
    for the next start), then quantized at load if quantization is "int8" or "fp8"."""
    if quantization == "gguf":
        reader = gguf_io.open_gguf(str(path))
        hf_config = gguf_io.gguf_hf_config(reader, str(path))
        tokenizer = gguf_io.gguf_tokenizer(reader, str(path))
        cfg, model, specs = _abstract_model(hf_config, dtype_name, choose_attention)
        tensors = gguf_io.gguf_tensors(reader, str(path), list(specs), hf_config, keep_quantized=True)
        weights_s = load_tensors_into(model, specs, _progress(tensors, len(specs), "Loading GGUF"), DTYPES[dtype_name], quantization,
                                      programs=programs)  # fmt: skip
        return model, cfg, hf_config, tokenizer, weights_s, {}
    t0 = time.perf_counter()
    entry = convert_cache.entry_dir(convert_cache.cache_root(cache_dir), convert_cache.file_sha256(str(path)), dtype_name)
    if use_cache and entry.exists():
        logger.info("loading converted %s from cache %s", path.name, entry)
        return _load_hf_folder(entry, dtype_name, choose_attention, quantization, timed, programs)[:6]  # (no pooling)
    reader = gguf_io.open_gguf(str(path))
    hf_config = gguf_io.gguf_hf_config(reader, str(path))
    tokenizer = gguf_io.gguf_tokenizer(reader, str(path))
    cfg, model, specs = _abstract_model(hf_config, dtype_name, choose_attention)
    np_dtype = np.dtype(DTYPES[dtype_name])
    converted = {
        name: array.astype(np_dtype)
        for name, array, _ in _progress(gguf_io.gguf_tensors(reader, str(path), list(specs), hf_config), len(specs), "Converting GGUF")
    }
    weights_s = load_tensors_into(model, specs, ((n, a, str(path)) for n, a in converted.items()), DTYPES[dtype_name], quantization,
                                  programs=programs)  # fmt: skip
    logger.info("converted %s in %.1fs", path.name, time.perf_counter() - t0)
    if use_cache:
        convert_cache.save_entry(entry, converted, hf_config, tokenizer)
        logger.info("cached the converted parameters in %s", entry)
    return model, cfg, hf_config, tokenizer, weights_s, {}


# model_types transformers does not know, of checkpoints that are an architecture jaxpaged runs: config.json read
# into that architecture's transformers config where its `architectures` names it (the checkpoint's auto_map points
# at its own copy of that class, remote code that is never run). model_type -> (architecture, model_type read as)
CONFIG_ALIASES = {
    "kimi_k2": ("DeepseekV3ForCausalLM", "deepseek_v3"),  # Kimi K2 (-Base, -Instruct): DeepSeek-V3's fields
}


def _aliased_config(config_file: Path):
    """config.json as CONFIG_ALIASES reads it, or None where no alias applies (or the file is no JSON object)."""
    from transformers import AutoConfig

    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    alias = CONFIG_ALIASES.get(raw.get("model_type")) if isinstance(raw, dict) else None
    if alias is None or alias[0] not in (raw.get("architectures") or []):
        return None
    architecture, model_type = alias
    try:
        hf_config = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k not in ("model_type", "auto_map")})
    except Exception as exc:
        raise ValueError(f"could not read {config_file} as {model_type}: {exc}") from exc
    logger.info("%s: model_type %r (unknown to transformers) read as %s for %s, the auto_map's code not run", config_file,
                raw["model_type"], type(hf_config).__name__, architecture)  # fmt: skip
    return hf_config


def _config_json(config_file: Path):
    from transformers import AutoConfig

    try:
        raw = json.loads(config_file.read_text())
        return AutoConfig.for_model(raw.pop("model_type"), **raw)
    except (ValueError, KeyError) as exc:
        if (hf_config := _aliased_config(config_file)) is not None:
            return hf_config
        raise ValueError(f"could not read model config {config_file}: {exc}") from exc


def _load_random(config_file: Path, dtype_name: str, choose_attention, quantization: str | None = None,
                 programs: WeightPrograms | None = None):  # fmt: skip
    """A bare config.json: random weights in its shapes, for benchmarks and tests."""
    hf_config = _config_json(config_file)
    cfg, model, specs = _abstract_model(hf_config, dtype_name, choose_attention)
    weights_s = load_tensors_into(model, specs, random_tensors(specs, model), DTYPES[dtype_name], quantization, programs=programs)
    folder = config_file.parent
    return model, cfg, hf_config, _load_tokenizer(folder), weights_s, {}


def model_config(config_file: str | Path) -> ModelConfig:
    """The shapes a config.json describes (layers, KV heads, head dim, vocabulary), without making the model."""
    return _port_config(_config_json(Path(config_file)))[1]


def random_checkpoint(config_file: str | Path, draw=None):
    """(HF config, {HF name: float32 array}): the random weights that loading `config_file` makes, so a
    benchmark can write them once as an HF folder that every engine it compares loads. draw: a predicate on HF
    names; those it refuses are not drawn and map to their shape (a tuple) instead (models/weights.py random_tensors)."""
    hf_config = _config_json(Path(config_file))
    _, model, specs = _abstract_model(hf_config, "float32", functools.partial(platforms.get().attention_backend, "auto"))
    return hf_config, {name: array for name, array, _ in random_tensors(specs, model, draw=draw)}


def load_model(
    model: str | None = None,
    *,
    dtype: str = "float32",
    attention_backend: str = "auto",
    batch_invariant: bool = False,
    platform: Platform | None = None,
    cache_dir: str | None = None,
    use_cache: bool = True,
    revision: str | None = None,
    quantization: str | None = None,
    hf_config: str | None = None,
    checkpoint_mapping=None,
    devices=None,
    tensor_parallel_size: int = 1,
    moe_kernel: str = "loop",
    hf_overrides: dict | None = None,
) -> LoadedModel:
    """Load `model` (None means the built-in SmolLM2-135M-Instruct) into a Flax port whose attention `platform`
    (default: the one JAX runs on) resolves from `attention_backend`. quantization: EngineConfig.quantization.
    An Orbax checkpoint (models/orbax_io.py) takes hf_config and checkpoint_mapping, and is restored onto `devices`
    (split as a tensor_parallel_size engine splits it). moe_kernel: EngineConfig.moe_kernel, the expert loop the
    engine will run: where the platform's reads MXFP4 (Platform.keeps_mxfp4: the grouped GEMM), an MXFP4 checkpoint's
    experts stay 4-bit unless quantization is "none"; else they are dequantized once at load. hf_overrides
    (EngineConfig.hf_overrides): fields set over an HF folder's config.json."""
    dtype_name = resolve_dtype(dtype)
    if quantization not in (None, *QUANTIZATION_CHOICES):
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES} or None (got {quantization!r})")
    source = builtin_gguf_path() if model is None else str(model)
    if model is not None and hub.is_hub_id(source):
        source = hub.snapshot_folder(source, revision)
    elif revision is not None:
        raise ValueError(f"revision applies to Hugging Face Hub ids only, and {source!r} is a local path")
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {source!r} not found: pass a local HF folder, a .gguf file, a config.json "
            "(random weights) or a Hugging Face Hub id (org/name)"
        )
    t0 = time.perf_counter()
    timed: dict[str, float] = {}  # the readers' own phases besides the weights (LoadedModel.load_seconds)
    orbax_item = orbax_io.checkpoint_item(path) if path.is_dir() and not any(path.glob("*.safetensors")) else None
    # the weights' cast and transpose programs, kept with the steps' executables (a warm start compiles none),
    # compiled on threads while the weights stream in; an Orbax checkpoint is restored as saved and needs none
    programs = None if orbax_item is not None else WeightPrograms(
        ExecutableCache(convert_cache.cache_root(cache_dir) / "executables") if use_cache else None,
        threads=WEIGHT_COMPILE_THREADS)  # fmt: skip
    if hf_overrides and (orbax_item is not None or not path.is_dir() or not (path / "config.json").exists()):
        raise ValueError(f"hf_overrides applies to HF folders (a config.json beside safetensors), and {path} is not one")
    for name, value in (("hf_config", hf_config), ("checkpoint_mapping", checkpoint_mapping)):
        if value is not None and orbax_item is None:
            raise ValueError(f"{name} applies to Orbax checkpoints, and {path} is not one")
    if orbax_item is None and path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise FileNotFoundError(f"{path} has no config.json and {len(ggufs)} .gguf files; expected an HF folder or one .gguf")
        path = ggufs[0]
    platform = platform or platforms.get()
    is_gguf = path.suffix == ".gguf"
    if quantization == "gguf" and not is_gguf:
        raise ValueError(f"quantization='gguf' keeps a GGUF's weights quantized, and {path.name} is not a .gguf file")
    if quantization is None and is_gguf:
        quantization = platform.gguf_quantization
        logger.info("GGUF weights: %s on %s (quantization=%r)", GGUF_DEFAULTS[quantization], platform.name, quantization)
    choose_attention = functools.partial(platform.attention_backend, attention_backend, batch_invariant=batch_invariant)
    pooling = None  # an HF folder's embedding or classifier checkpoint (models/pooling_head.py)
    try:
        if orbax_item is not None:
            if quantization not in (None, "none"):
                raise ValueError(f"quantization={quantization!r} is not supported for an Orbax checkpoint (its floats load as dtype)")
            result = orbax_io.load(path, dtype_name, choose_attention, hf_config=hf_config, mapping=checkpoint_mapping,
                                   devices=devices, tensor_parallel_size=tensor_parallel_size)  # fmt: skip
        elif path.is_dir():
            keep_mxfp4 = quantization != "none" and platform.keeps_mxfp4(moe_kernel)
            *result, pooling = _load_hf_folder(path, dtype_name, choose_attention, quantization, timed, programs, keep_mxfp4,
                                               hf_overrides)  # fmt: skip
        elif path.suffix == ".gguf":
            result = _load_gguf(path, dtype_name, choose_attention, cache_dir, use_cache, quantization, timed, programs)
        elif path.suffix == ".json":
            result = _load_random(path, dtype_name, choose_attention, quantization, programs)
        else:
            raise ValueError(f"cannot load {path}: expected an HF folder, a .gguf file or a config.json")
    finally:
        if programs is not None:
            programs.close()
    module, cfg, hf_config, tokenizer, weights_s, skipped = result
    size = param_bytes(nnx.state(module, nnx.Param))
    logger.info(
        "loaded %s (%s, %.1f MB of %s weights%s) in %.1fs", path.name, cfg.architecture, size / 1e6, dtype_name,
        f", quantization {quantization}" if quantization not in (None, "none") else "", time.perf_counter() - t0,
    )
    return LoadedModel(module, cfg, hf_config, tokenizer, str(path), dtype_name, quantization, weights_s, skipped, timed, pooling)


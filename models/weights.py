"""Putting HF-named tensors into a port's parameters, with errors that name what is wrong."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

logger = logging.getLogger(__name__)

# Buffers some checkpoints carry that no port needs.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.masked_bias", "attn.bias")


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    path: str  # dotted attribute path of the nnx.Param in the port
    transpose: bool = False  # torch Linear weights are [out, in]; ports keep [in, out]


def _variable(model: nnx.Module, path: str) -> nnx.Variable:
    obj: Any = model
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _set(var: nnx.Variable, value) -> None:
    if hasattr(var, "set_value"):
        var.set_value(value)
    else:  # older Flax
        var.value = value


def load_tensors_into(
    model: nnx.Module,
    specs: dict[str, WeightSpec],
    tensors: Iterable[tuple[str, Any, str]],
    dtype,
) -> None:
    """Fill model's params from (hf_name, array, source) triples; raise on a missing or misshapen tensor."""
    filled: set[str] = set()
    for name, array, source in tensors:
        spec = specs.get(name)
        if spec is None:
            if not name.endswith(IGNORED_SUFFIXES):
                logger.warning("ignoring tensor %s from %s: the port has no place for it", name, source)
            continue
        var = _variable(model, spec.path)
        value = jnp.asarray(array)
        if spec.transpose:
            value = value.T
        expected = tuple(var.shape)
        if tuple(value.shape) != expected:
            raise ValueError(
                f"tensor {name} in {source} has shape {tuple(value.shape)}, but the config implies {expected}"
            )
        _set(var, value.astype(dtype))
        filled.add(name)
    missing = sorted(set(specs) - filled)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) the model needs: {shown}")


def random_tensors(specs: dict[str, WeightSpec], model: nnx.Module, seed: int = 0, std: float = 0.02):
    """HF-named random weights in the model's shapes, for benchmarks on a bare config.json."""
    rng = np.random.default_rng(seed)
    for name, spec in specs.items():
        shape = tuple(_variable(model, spec.path).shape)
        if spec.transpose:
            shape = shape[::-1]
        if name.endswith("norm.weight") or ".ln" in name:
            array = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            array = np.zeros(shape, np.float32)
        else:
            array = rng.normal(0.0, std, size=shape).astype(np.float32)
        yield name, array, "random init"


def param_bytes(state) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state))

"""Orbax checkpoints (issue 47): a Flax NNX state saved by orbax-checkpoint, as Tunix's and MaxText's trainers save
them, restored onto the engine's devices.

A path names a PyTree item folder (its `_METADATA` beside the arrays), a step folder holding one (`model_params`, as
Tunix's CheckpointManager writes; `default`, `state`, `params`, `model`), or a CheckpointManager's root (its latest
numbered step). The checkpoint carries no model config: `hf_config` names the HF folder or config.json it is a
checkpoint of, else the first config.json found in the checkpoint's folder or up to four folders above it (the
tokenizer is read from that config's folder). Leaves are named by their path (`layers.0.self_attn.q_proj.kernel`,
NNX's `value` left out) and taken as update_weights takes names: the port's parameter paths, HF names, or a
trainer's through `checkpoint_mapping` (worker/weight_update.py). Only the leaves used are read, each restored
straight onto the devices it is split over (a tensor-parallel engine's shards go to their own devices), then cast,
transposed or split in one jitted program. Every checkpoint leaf must be used or skipped by the mapping, and every
parameter given: otherwise one ValueError names them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

logger = logging.getLogger("jaxpaged.loader")

ITEMS = ("model_params", "default", "state", "params", "model")
CONFIG_SEARCH_DEPTH = 4  # folders above the item a config.json may sit in (item < step < manager root < run < ...)


def checkpoint_item(path: Path) -> Path | None:
    """The PyTree item folder an Orbax checkpoint path names, or None if it names none."""
    path = Path(path)
    if not path.is_dir():
        return None
    if (path / "_METADATA").is_file():
        return path
    for name in ITEMS:
        if (path / name / "_METADATA").is_file():
            return path / name
    steps = sorted((int(p.name), p) for p in path.iterdir() if p.is_dir() and p.name.isdigit())
    for _, step in reversed(steps):  # the latest step that holds an item (a step being written may not yet)
        item = checkpoint_item(step)
        if item is not None:
            return item
    return None


def config_file(item: Path, named: str | None) -> Path:
    """The config.json an Orbax checkpoint is of: `named` (a folder or the file), else found in or above it."""
    if named is not None:
        path = Path(named).expanduser()
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"hf_config {named!r}: no config.json there")
        return path
    for folder in [item, *list(item.parents)[:CONFIG_SEARCH_DEPTH]]:
        if (folder / "config.json").is_file():
            return folder / "config.json"
    raise FileNotFoundError(
        f"the Orbax checkpoint {item} holds no model config, and no config.json was found beside it: pass hf_config= "
        "(the HF folder or config.json it is a checkpoint of)")  # fmt: skip


def _metadata(item: Path) -> list[tuple[tuple[str, ...], jax.ShapeDtypeStruct]]:
    """(key path, shape and dtype) of every array leaf of the checkpoint, read without its arrays."""
    import orbax.checkpoint as ocp

    meta = ocp.PyTreeCheckpointer().metadata(item)
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
    if tree is None:
        tree = getattr(meta, "tree", meta)
    out = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            continue  # a scalar written as a value, not an array
        keys = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keypath)
        out.append((keys, jax.ShapeDtypeStruct(tuple(leaf.shape), jnp.dtype(leaf.dtype))))
    return out


def _nested(pairs: list[tuple[tuple[str, ...], Any]]) -> dict:
    tree: dict = {}
    for keys, value in pairs:
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return tree


def _split_spec(mesh, path: str, shape: tuple[int, ...], transpose: bool = False):
    """Where a parameter (or a checkpoint tensor laid out for it, transposed) lives on the engine's TP mesh: as
    models/sharding.py places the parameter, or replicated where its split axis does not divide."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpaged.models.sharding import partition_spec
    from jaxpaged.pallas_kernels.attention import TP_AXIS

    n = mesh.shape[TP_AXIS]
    own = shape[::-1] if transpose else shape
    spec = tuple(partition_spec(path, own, n)) + (None,) * (len(own) - len(partition_spec(path, own, n)))
    if any(axis is not None and dim % n for axis, dim in zip(spec, own)):
        spec = (None,) * len(own)
    if transpose:
        spec = spec[::-1]
    return NamedSharding(mesh, P(*spec))


def load(path: Path, dtype_name: str, choose_attention, *, hf_config: str | None = None, mapping=None,
         devices=None, tensor_parallel_size: int = 1):  # fmt: skip
    """-> (model, ModelConfig, HF config, tokenizer, seconds reading the weights, {}) as the loader's readers return."""
    import orbax.checkpoint as ocp

    from jaxpaged.models.loader import _build, _config_json, _load_tokenizer, _port_config
    from jaxpaged.models.sharding import make_mesh
    from jaxpaged.worker.weight_update import LoadedLayout, fill_model, resolve

    item = checkpoint_item(path)
    if item is None:
        raise ValueError(f"{path} is not an Orbax checkpoint (no _METADATA in it, in a {'/'.join(ITEMS)} item or a numbered step)")
    cfg_path = config_file(item, hf_config)
    hf = _hf_config(cfg_path, _config_json)
    cls, cfg = _port_config(hf)
    model = _build(cls, cfg, dtype_name, choose_attention)
    t0 = time.perf_counter()
    leaves = _metadata(item)
    named = []  # (given, target, struct, fn), as update_weights names tensors
    for keys, struct in leaves:
        name = ".".join(k for k in keys if k not in ("value", "raw_value"))
        target: Any = name
        if callable(mapping):
            target = mapping(name)
        elif mapping is not None:
            target = mapping.get(name, name)
        if target is None:
            continue
        target, fn = target if isinstance(target, tuple) else (target, None)
        named.append((keys, (name, str(target), struct, fn)))
    what = f"Orbax checkpoint {item}"
    # names, shapes and dtypes checked before anything is read
    layout = LoadedLayout.of_model(model, cfg)
    entries, accepted, _ = resolve(layout, [n for _, n in named], what=what)
    index_of = {id(struct): n for n, (_, (_, _, struct, _)) in enumerate(named)}
    devices = list(jax.devices() if devices is None else devices)
    mesh = make_mesh(tensor_parallel_size, devices) if tensor_parallel_size > 1 else None
    single = jax.sharding.SingleDeviceSharding(devices[0])
    # each leaf restored onto the devices its parameter lives on: no full copy on one device under TP
    by_given = {index_of[id(accepted[e.given])]: e for e in entries}
    targets = []
    for n, (keys, (_, _, stored, fn)) in enumerate(named):
        e, sharding = by_given.get(n), single
        if mesh is not None and e is not None and fn is None and e.split is None and len(e.targets) == 1:
            sharding = _split_spec(mesh, layout.paths[e.targets[0]], tuple(stored.shape), e.transpose)
        elif mesh is not None:
            sharding = _split_spec(mesh, "", tuple(stored.shape))  # replicated
        targets.append((keys, jax.ShapeDtypeStruct(stored.shape, stored.dtype, sharding=sharding)))
    target = _nested(targets)
    restored = ocp.PyTreeCheckpointer().restore(item, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
    values = []
    for keys, _ in targets:
        node = restored
        for key in keys:
            node = node[key]
        values.append(node)

    def sharding(path, shape):
        return single if mesh is None else _split_spec(mesh, path, shape)

    fill_model(model, cfg, [(g, t, v, fn) for (_, (g, t, _, fn)), v in zip(named, values)], what=what, sharding=sharding)
    seconds = time.perf_counter() - t0
    logger.info("restored %d tensors from the Orbax checkpoint %s in %.1fs (config: %s)", len(named), item, seconds, cfg_path)
    return model, cfg, hf, _load_tokenizer(cfg_path.parent), seconds, {}


def _hf_config(path: Path, config_json):
    """The HF config of a config.json: through AutoConfig where its folder is an HF folder, else read alone."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path.parent)) if path.name == "config.json" else config_json(path)
    except Exception:  # noqa: BLE001 - a config.json AutoConfig cannot place: read it as the random-weights path does
        return config_json(path)

"""Converted GGUF parameters cached with orbax, keyed by the file's content hash and the dtype.

A GGUF must be dequantized tensor by tensor; a second start restores the result instead.
Each entry is a folder holding config.json, the tokenizer, and an orbax checkpoint of the
HF-named tensors; it appears under its final name only once complete.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # bump when conversion output changes, so stale entries are not used


def cache_root(cache_dir: str | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir)
    env = os.environ.get("JAXPAGED_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxpaged"


def file_sha256(path: str, chunk: int = 1 << 23) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def entry_dir(root: Path, content_hash: str, dtype_name: str) -> Path:
    return root / "converted" / f"{content_hash[:40]}-{dtype_name}-v{CONVERTER_VERSION}"


def _nest(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for name, array in flat.items():
        node = tree
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = array
    return tree


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def save_entry(entry: Path, tensors: dict[str, np.ndarray], hf_config, tokenizer) -> None:
    import orbax.checkpoint as ocp

    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=entry.name + ".", dir=entry.parent))
    try:
        hf_config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save((staging / "params").absolute(), _nest(tensors))
        checkpointer.wait_until_finished()
        checkpointer.close()
        os.replace(staging, entry)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if not entry.exists():  # a concurrent writer finishing first is fine
            logger.warning("could not write the conversion cache at %s: %s", entry, exc)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def load_entry_tensors(entry: Path) -> dict[str, np.ndarray]:
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    try:
        tree = checkpointer.restore((entry / "params").absolute())
    finally:
        checkpointer.close()
    return _flatten(tree)

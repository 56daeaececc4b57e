"""Converted GGUF parameters cached as an HF folder, keyed by the file's content hash and the dtype.

A GGUF must be dequantized tensor by tensor; a second start loads the result instead, through the same
path as any HF folder: config.json, the tokenizer and one model.safetensors of the HF-named tensors
(memory-mapped, so a warm load is a copy). An entry appears under its final name only once complete.
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

CONVERTER_VERSION = 2  # bump when conversion output changes, so stale entries are not used


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


def save_entry(entry: Path, tensors: dict[str, np.ndarray], hf_config, tokenizer) -> None:
    from safetensors.numpy import save_file

    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=entry.name + ".", dir=entry.parent))
    try:
        hf_config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        save_file({name: np.ascontiguousarray(a) for name, a in tensors.items()}, str(staging / "model.safetensors"))
        os.replace(staging, entry)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if not entry.exists():  # a concurrent writer finishing first is fine
            logger.warning("could not write the conversion cache at %s: %s", entry, exc)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise

"""The native CPU kernels this process has built, handed to a fresh cache folder, for tests whose subprocesses start on
an empty cache but do not test the C++ build (~25 s of CPU a kernel)."""

from __future__ import annotations

import shutil
from pathlib import Path


def copy_built_kernels(cache: Path) -> None:
    """Each kernel already built into this process's cache, to the path `cache` would build it at (the same sources,
    JAX version, flags and CPU name the same file)."""
    from jaxpaged.platforms.cpu import attention, matmul, native_build

    for built, there in ((attention.library_path(), attention.library_path(str(cache))),
                         (native_build.library_path(matmul.SOURCE), native_build.library_path(matmul.SOURCE, cache_dir=str(cache)))):  # fmt: skip
        if built.exists():
            there.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(built, there)

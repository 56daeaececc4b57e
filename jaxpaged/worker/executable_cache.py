"""Compiled steps kept on disk, so that a warm start skips tracing, lowering and compiling them.

JAX's persistent compilation cache spares XLA's compile only: each start still traces and lowers every
step. Here the compiled executable itself is stored,
keyed by everything that shapes it: jaxpaged's source, the model's graph (static attributes included),
the arguments' shapes and dtypes, JAX's version, the devices, the CPU and XLA's flags.
An entry that fails to load is compiled again and rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import serialize_executable

from jaxpaged.platforms.cpu import native_build
from jaxpaged.utils import compile_monitor

logger = logging.getLogger("jaxpaged.executables")

FORMAT = 2  # bump when the file layout changes
STALE_AFTER_S = 14 * 24 * 3600  # a version folder unused this long is removed
# Programs (hashes of their StableHLO) compiled or loaded in this process. XLA:CPU compiles a program it has
# seen before in the process into an executable that leans on the first one's code: serialized, it fails in a
# new process ("Function wrapped_convert not found"). So is one that JAX's persistent compilation cache
# returned (JAX 0.10). Only a program's first real compile here is stored.
_programs_seen: set[str] = set()
# (program, device) -> the executable this process still holds for it (some runner uses it): a stored entry for such
# a program is taken from here, not deserialized a second time (XLA:CPU's JIT would then hold two copies of one
# program's code; a CI run crashed in deserialize_executable that way). Weak: an executable no runner holds is freed,
# not kept for the life of the process (a test process creates hundreds of engines).
_in_process: weakref.WeakValueDictionary[tuple[str, str], jax.stages.Compiled] = weakref.WeakValueDictionary()


@functools.cache
def source_digest() -> str:
    """jaxpaged's own code: any change to it may change a traced step."""
    import jaxpaged
    from jaxpaged import models, pallas_kernels

    roots = [Path(package.__file__).parent for package in (jaxpaged, models, pallas_kernels)]
    # a wheel holds models/ and pallas_kernels/ inside jaxpaged/, an editable install beside it: read each file once
    roots = [root for root in roots if not any(root != other and root.is_relative_to(other) for other in roots)]
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cc", ".h")):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def environment_digest() -> str:
    """The platform the executables were compiled for."""
    import jaxlib

    devices = jax.devices()
    parts = [
        FORMAT, jax.__version__, jaxlib.__version__, devices[0].platform, devices[0].client.platform_version,
        [d.device_kind for d in devices], os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
        jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision,
        native_build.cpu_signature(),  # XLA:CPU compiles for the CPU it runs on
    ]  # fmt: skip
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _signature(args: tuple) -> str:
    """Shapes and dtypes of the arguments (arrays or ShapeDtypeStructs alike), and their tree structure.
    Placement is left out: executables are stored for one device, named by the environment digest."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    described = []
    for leaf in leaves:
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            leaf = np.asarray(leaf)
        described.append((tuple(leaf.shape), str(leaf.dtype), bool(getattr(leaf, "weak_type", False))))
    return repr((str(tree), described))


class ExecutableCache:
    """A folder of serialized executables; `directory=None` compiles without storing anything."""

    def __init__(self, directory: str | Path | None, salt: str = "", device: jax.Device | None = None):
        self.salt = salt
        self.device = device  # where loaded executables run (the runner's one device)
        self.directory = None
        if directory is not None:
            version = hashlib.sha256((environment_digest() + source_digest()).encode()).hexdigest()[:20]
            self.directory = Path(directory) / version
        self.num_loaded = 0
        self.num_compiled = 0
        self._unstored: list[tuple[Path, str, Any]] = []  # compiled off the main thread: stored by store_pending()

    def compile(self, name: str, jitted, args: tuple, store_now: bool = True) -> jax.stages.Compiled:
        """`jitted` compiled for `args`: from the folder when an entry matches, else compiled and stored (at once,
        or with store_now False by a later store_pending())."""
        path = None
        if self.directory is not None:
            where = self._where()  # the device it is compiled for
            key = hashlib.sha256((self.salt + name + _signature(args) + where).encode()).hexdigest()[:32]
            path = self.directory / f"{name}-{key}.exe"
            compiled = self._load(path)
            if compiled is not None:
                self.num_loaded += 1
                return compiled
        t0 = time.perf_counter()
        lowered = jitted.lower(*args)
        program = hashlib.sha256(lowered.as_text().encode()).hexdigest()
        hits = compile_monitor.persistent_cache_hits()
        compiled = lowered.compile()
        from_xla_cache = compile_monitor.persistent_cache_hits() != hits  # serializes incomplete, as above
        self.num_compiled += 1
        logger.debug("compiled %s in %.2fs", name, time.perf_counter() - t0)
        if path is not None and program not in _programs_seen and not from_xla_cache:
            if store_now:
                self._store(path, program, compiled)
            else:
                self._unstored.append((path, program, compiled))
        _programs_seen.add(program)
        _in_process.setdefault((program, self._where()), compiled)
        return compiled

    @property
    def has_unstored(self) -> bool:
        return bool(self._unstored)

    def store_pending(self) -> None:
        """Store what compile(store_now=False) left: on the main thread, with nothing running. Serializing on a
        compile thread crashed XLA:CPU now and then (a segfault in serialize_executable during warm-up, even with
        no step running), so background compiles leave it to the runner's quiet moments."""
        while self._unstored:
            self._store(*self._unstored.pop(0))

    def _where(self) -> str:
        return "" if self.device is None or self.device.id == 0 else f"device{self.device.id}"

    def _load(self, path: Path) -> Any:
        if not path.exists():
            return None
        try:
            with open(path, "rb") as f:
                program, serialized, in_tree, out_tree = pickle.load(f)
            compiled = _in_process.get((program, self._where()))
            if compiled is None:
                # stored executables run on one device: loaded onto all of a multi-device host, they would ask for a
                # shard per device
                devices = [self.device or jax.devices()[0]]
                compiled = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree, execution_devices=devices)
                _in_process[(program, self._where())] = compiled
            _programs_seen.add(program)
        except Exception as exc:  # noqa: BLE001 - a damaged or foreign entry: compile instead
            logger.warning("could not load the cached executable %s (%s); compiling it again", path, exc)
            return None
        os.utime(self.directory)  # marks the version as in use, for pruning
        return compiled

    def _store(self, path: Path, program: str, compiled) -> None:
        try:
            blob = pickle.dumps((program, *serialize_executable.serialize(compiled)))
        except Exception as exc:  # noqa: BLE001 - some backends cannot serialize: still usable, just not stored
            logger.debug("cannot store the executable %s: %s", path.name, exc)
            return
        try:
            fresh = not self.directory.exists()
            self.directory.mkdir(parents=True, exist_ok=True)
            if fresh:
                _prune(self.directory.parent, keep=self.directory.name)
            fd, staging = tempfile.mkstemp(dir=self.directory, prefix=path.name + ".")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(staging, path)
        except OSError as exc:
            logger.warning("could not write the executable cache at %s: %s", path, exc)


def _prune(root: Path, keep: str) -> None:
    """Remove version folders (older jaxpaged or JAX) nobody has used for STALE_AFTER_S."""
    now = time.time()
    for folder in root.iterdir():
        if folder.name != keep and folder.is_dir() and now - folder.stat().st_mtime > STALE_AFTER_S:
            shutil.rmtree(folder, ignore_errors=True)

"""Building the native CPU kernels (XLA FFI custom calls in C++) once per machine.

Each kernel's shared library is compiled on first use with the system's C++ compiler (`CXX`, else
`c++`, `g++` or `clang++`), tuned for this CPU (-march=native), and kept under the jaxpaged cache root
keyed by the source (and the headers beside it), the flags, the JAX version and the CPU, so later starts only
load it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

CXXFLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-fno-math-errno", "-pthread")


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpuinfo_flags_line() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags (/proc/cpuinfo), e.g. {"avx2", "fma", ...}; empty where unknown."""
    line = _cpuinfo_flags_line()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


def cpu_signature() -> str:
    """What -march=native depends on: the machine and its instruction-set flags."""
    return f"{platform.machine()} {_cpuinfo_flags_line()}"


def march_flags(march: str, flags=CXXFLAGS) -> tuple[str, ...]:
    """`flags` building for `march` (e.g. "haswell") instead of this CPU: the narrower builds tests check."""
    return tuple(f for f in flags if not f.startswith("-march=")) + (f"-march={march}",)


def library_path(source: Path, flags=CXXFLAGS, cache_dir: str | None = None) -> Path:
    from jaxpaged.models.convert_cache import cache_root  # the one cache root for everything jaxpaged keeps

    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # the kernels' shared helpers
    for part in (
        source.read_bytes(),
        *headers,
        jax.__version__.encode(),
        " ".join(flags).encode(),
        cpu_signature().encode(),
    ):
        key.update(part)
    return cache_root(cache_dir) / "native" / f"{source.stem}-{key.hexdigest()[:16]}.so"


_in_flight: dict[Path, tuple[subprocess.Popen, str]] = {}  # library path -> (compiler process, its output file)
_lock = threading.Lock()


def start_build(source: Path, flags=CXXFLAGS, cache_dir: str | None = None) -> None:
    """Start compiling `source` in the background unless it is cached or already compiling, so the compiler
    runs beside the model's loading; build() then waits for it."""
    out = library_path(source, flags, cache_dir)
    cxx = compiler()
    with _lock:
        if out.exists() or out in _in_flight or cxx is None:
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp]
        logger.info("building the native CPU kernel %s (once per machine and version)", source.name)
        logger.debug("%s", " ".join(cmd))
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _in_flight[out] = (proc, tmp)


def build(source: Path, flags=CXXFLAGS, cache_dir: str | None = None) -> Path:
    """Compile `source` unless a build for it, these flags, JAX and this CPU is cached; the library's path."""
    out = library_path(source, flags, cache_dir)
    if out.exists():
        return out
    if compiler() is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    while not out.exists():
        start_build(source, flags, cache_dir)
        with _lock:
            entry = _in_flight.pop(out, None)
        if entry is None:  # finished by another thread meanwhile
            continue
        proc, tmp = entry
        _, stderr = proc.communicate()
        if proc.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"compiling {source.name} failed:\n{stderr[-4000:]}")
        os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same bytes
    return out

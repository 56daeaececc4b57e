"""glibc malloc settings that keep XLA:CPU's per-step buffers mapped between steps.

XLA:CPU mallocs an executable's temporaries (tens of MB a step) on every run, from its worker threads.
glibc serves those from secondary arenas, which cannot hold a block over 64 MB and hand an emptied heap back
to the kernel, so every step would map its temporaries afresh (thousands of page faults). One arena with high
mmap and trim thresholds keeps that memory mapped.

This must run before XLA's threads first allocate, so the CPU platform calls it first thing when an engine
starts (platforms/cpu.py); `import jaxpaged` alone changes nothing.
It changes nothing when the user has already chosen (any `MALLOC_*` or `GLIBC_TUNABLES` variable set),
when `JAXPAGED_MALLOC_TUNING=0`, or off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# mallopt parameter numbers from glibc's malloc.h
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
# Blocks up to this size come from the heap and stay mapped; bigger ones (the KV cache) are mmapped once.
MMAP_THRESHOLD = 512 << 20
# Free memory at the heap's top kept for reuse instead of given back.
TRIM_THRESHOLD = 1 << 30
USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")

applied: bool = False


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # only glibc has it; musl's mallopt is a no-op
        return libc
    except (OSError, AttributeError):
        return None


def tune_malloc(environ=os.environ) -> bool:
    """Apply the settings above once; True if they are in force."""
    global applied
    if applied:
        return True
    if environ.get("JAXPAGED_MALLOC_TUNING", "1") == "0" or any(k in environ for k in USER_SETTINGS):
        return False
    libc = _libc()
    if libc is None:
        return False
    ok = all(
        libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1
        for param, value in ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    )
    applied = ok
    return ok

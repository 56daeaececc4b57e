"""Counts XLA compilations in this process, so the engine can prove none happen after warm-up.

Every jit lowering emits the `jaxpr_to_mlir_module` event, whether or not the persistent
cache then spares the backend compile, so counting it counts every new trace.
"""

from __future__ import annotations

import contextlib
import threading

import jax

_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_count = 0
_cache_hits = 0  # executables JAX's persistent compilation cache returned instead of compiling
_expected = 0  # lowerings inside expected(): a bucket compiled on first use, as asked for
_local = threading.local()  # expected() depth of this thread: a lowering is reported in the thread doing it
_installed = False


def _on_event(name: str, *args, **kwargs) -> None:
    global _count, _expected
    if name == _LOWERING_EVENT:
        wanted = getattr(_local, "expected", 0) > 0
        with _lock:
            _count += 1
            _expected += wanted
        if not wanted:
            _local.unexpected = getattr(_local, "unexpected", 0) + 1


def _on_plain_event(name: str, *args, **kwargs) -> None:
    global _cache_hits
    if name == _CACHE_HIT_EVENT:
        with _lock:
            _cache_hits += 1


def install() -> None:
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            jax.monitoring.register_event_listener(_on_plain_event)
            _installed = True


def persistent_cache_hits() -> int:
    install()
    return _cache_hits


def compile_count() -> int:
    install()
    return _count


def unexpected_count() -> int:
    """Lowerings outside expected() blocks, in any thread."""
    install()
    return _count - _expected


def unexpected_in_this_thread() -> int:
    """Lowerings outside expected() blocks in this thread: what a step caused, and not what a trainer (or anything
    else) compiled on another thread meanwhile."""
    install()
    return getattr(_local, "unexpected", 0)


@contextlib.contextmanager
def expected():
    """Lowerings in this block, in this thread, are wanted (compiling a step bucket on its first use)."""
    install()
    _local.expected = getattr(_local, "expected", 0) + 1
    try:
        yield
    finally:
        _local.expected -= 1

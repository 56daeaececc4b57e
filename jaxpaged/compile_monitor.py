"""Counts XLA compilations in this process, so the engine can prove none happen after warm-up.

Every jit lowering emits the `jaxpr_to_mlir_module` event, whether or not the persistent
cache then spares the backend compile, so counting it counts every new trace.
"""

from __future__ import annotations

import threading

import jax

_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def _on_event(name: str, *args, **kwargs) -> None:
    global _count
    if name == _LOWERING_EVENT:
        with _lock:
            _count += 1


def install() -> None:
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _installed = True


def compile_count() -> int:
    install()
    return _count

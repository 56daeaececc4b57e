"""The suite's own set-up: how many processes `-n auto` (pyproject's addopts) starts."""

from __future__ import annotations

import importlib.util
import os

from tests import conftest


def test_a_worker_per_core_on_the_cpu_and_one_beside_an_accelerator(monkeypatch):
    cores = max(1, min(4, len(os.sched_getaffinity(0))))
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert conftest.pytest_xdist_auto_num_workers(None) == cores
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "jax_cuda12_plugin" else None)
    assert conftest.pytest_xdist_auto_num_workers(None) == 1  # each worker would take most of the GPU's memory
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert conftest.pytest_xdist_auto_num_workers(None) == cores

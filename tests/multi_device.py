"""Tests that need 4 devices on a one-device suite: the file's first test re-runs the whole file in a subprocess
with XLA_FLAGS=--xla_force_host_platform_device_count=4 (the count is fixed when JAX starts), where its device
tests, marked `needs_devices`, run; in the main process they skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from tests import REPO

DEVICES = 4
MULTI = jax.device_count() >= DEVICES and jax.default_backend() == "cpu"
needs_devices = pytest.mark.skipif(not MULTI, reason="runs in the 4-device subprocess started by the first test")


def rerun_with_devices(test_file: str, timeout: float = 1800) -> None:
    """The launcher test's body: run test_file on 4 CPU devices and require everything there to pass."""
    if MULTI:
        pytest.skip("this process has the devices: the tests below run here")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", str(Path(test_file).resolve())],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "1 skipped" in summary, summary  # only the launcher skips there


def reference_family(cache: dict, name: str, config, tmp_path_factory, lengths, max_tokens: int, vocab: int = 256):
    """(checkpoint folder, prompts, transformers' greedy tokens) of a random model, once per name."""
    from tests.hf_reference import hf_greedy, random_hf_model, random_prompts, save_hf_model

    if name not in cache:
        hf = random_hf_model(config)
        folder = save_hf_model(hf, tmp_path_factory.mktemp(name))
        prompts = random_prompts(vocab, lengths, seed=5)
        cache[name] = folder, prompts, [hf_greedy(hf, p, max_tokens) for p in prompts]
    return cache[name]

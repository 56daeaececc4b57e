"""Shared fixtures: the engine tests' tiny random Llama, the tiny cycle model and the server processes that serve it
(started once per session)."""

from __future__ import annotations

import logging

import pytest

DEVICE_MARKS = ("gpu", "tpu")  # tests that run compiled on that device; skipped elsewhere


def pytest_configure(config):
    _one_torch_thread_per_worker()
    _fast_cpu_compiles()
    _build_native_kernels_before_the_workers(config)
    for mark in DEVICE_MARKS:
        config.addinivalue_line("markers", f"{mark}: needs a {mark.upper()}: runs compiled there, skipped elsewhere")
    config.addinivalue_line("markers", "network: installs packages from PyPI (skipped when it is unreachable; "
                            "deselect with -m 'not network')")


def _one_torch_thread_per_worker() -> None:
    """With several workers, each takes one of torch's threads (the reference models): torch's OpenMP threads spin
    while they wait, and with two workers on two cores a reference generate ran 9x slower beside the other worker
    than alone (156 s against 18 s, 31 s with one thread each). Set before any test module imports torch; the
    subprocesses tests start inherit it."""
    import os
    import sys

    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)


CPU_TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
# XLA:CPU's elemental emitters instead of its newer fusion emitters: a tiny engine's warm-up compiled in about half
# the CPU time (backend compile 25 -> 11 s, same tokens). A jaxlib without the flag aborts on it, so it is probed.
CPU_TEST_EMITTER_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _fast_cpu_compiles() -> None:
    """On the CPU, the tests' programs are compiled with LLVM's optimizations off and the older emitters: compiling
    is most of an engine test's time (its warm-up compiles each bucket's executables), and -O0 alone made three
    engine test files 23% faster (114.9 -> 87.9 s). The programs run slower, which tiny test models do not notice,
    and their values can differ only in rounding (XLA:CPU leaves fast-math off; LLVM may fuse multiply-adds
    differently). Set before JAX starts its backend, in the controlling process: xdist's workers and the
    subprocesses tests start inherit it. A run with XLA_FLAGS of its own keeps them."""
    import os

    if _accelerator_plugin() or "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return
    flags = CPU_TEST_XLA_FLAGS
    if _xla_knows(CPU_TEST_EMITTER_FLAG):
        flags = f"{flags} {CPU_TEST_EMITTER_FLAG}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA accepts `flag` (an unknown one ends the process at start): asked of a child."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, timeout=120)
    return probe.returncode == 0


def _accelerator_plugin() -> bool:
    """JAX will run on an accelerator here (a plugin is installed and JAX_PLATFORMS does not say cpu)."""
    import importlib.util
    import os

    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")
    return os.environ.get("JAX_PLATFORMS", "") != "cpu" and any(importlib.util.find_spec(p) for p in plugins)


def _build_native_kernels_before_the_workers(config) -> None:
    """The native CPU kernels, compiled once by the controlling process (~25 s of C++ each) before the workers
    start: each worker's first engine would otherwise compile them again beside the other's."""
    if hasattr(config, "workerinput") or _accelerator_plugin():
        return
    from jaxpaged.platforms.cpu import attention, matmul, native_build

    if native_build.compiler() is None:
        return
    attention.start_build()
    matmul.start_build()  # where the engine may take it (AVX-512)
    try:
        attention.build()
        if matmul.may_take_auto():
            native_build.build(matmul.SOURCE)
    except RuntimeError:  # reported by the tests that need the kernels
        pass


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): on the CPU a worker per core, at most 4, each a JAX process of a few GB at
    its peak; one where JAX has an accelerator plugin (each process would take most of the device's memory),
    unless JAX_PLATFORMS=cpu. Decided without starting JAX in this, the controlling, process."""
    import os

    if _accelerator_plugin():
        return 1
    return max(1, min(4, len(os.sched_getaffinity(0))))


def pytest_collection_modifyitems(config, items):
    import jax

    from tests.scheduling import longest_files_first

    longest_files_first(items)

    here = jax.default_backend()
    for item in items:
        for mark in DEVICE_MARKS:
            if item.get_closest_marker(mark) is not None and mark != here:
                item.add_marker(pytest.mark.skip(reason=f"needs a {mark.upper()} (this is {here})"))

@pytest.fixture(scope="module", autouse=True)
def _free_memory_after_each_module():
    """A worker runs hundreds of test files in one process: without this its memory grew by ~0.3 GB a minute (JAX's
    compile caches, arrays in reference cycles, freed heap glibc keeps), two workers reached 10.6 + 6.7 GB near the
    suite's end, and the kernel killed one (CI's 'node down' at 99%). Collected garbage, JAX's caches dropped and the
    free heap handed back after each file kept a worker at ~0.8 GB over four model test files in one process (1.1 ->
    1.9 GB without)."""
    yield
    import ctypes
    import gc
    import sys

    gc.collect()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


CYCLE_MODEL = "cycle"
API_KEY = "test-key-123"
# One config for both servers and the in-process engine, so the persistent XLA cache compiles each shape once.
ENGINE_ARGS = ["--max-model-len", "512", "--max-num-seqs", "32", "--max-num-batched-tokens", "64", "--block-size", "8",
               "--num-kv-blocks", "1024", "--dtype", "float32"]


@pytest.fixture(scope="module")
def hf_model():
    """The engine tests' model: a tiny random GQA Llama (4 query heads, 2 KV heads, 256 positions) in transformers,
    the reference; a module that needs another shape defines its own `hf_model`."""
    from tests.hf_reference import random_hf_model, tiny_llama_config

    return random_hf_model(tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))


@pytest.fixture(scope="module")
def model_dir(hf_model, tmp_path_factory):
    """`hf_model` saved as an HF folder, which jaxpaged loads."""
    from tests.hf_reference import save_hf_model

    return str(save_hf_model(hf_model, tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def cycle_model_dir(tmp_path_factory):
    from tests.cycle_model import write_cycle_model

    return write_cycle_model(tmp_path_factory.mktemp("cycle-model"))


@pytest.fixture(scope="session")
def server(cycle_model_dir, tmp_path_factory):
    from tests.server_harness import ServerProcess

    proc = ServerProcess(
        ["--model", str(cycle_model_dir), "--served-model-name", CYCLE_MODEL, "other-name", *ENGINE_ARGS],
        tmp_path_factory.mktemp("server") / "server.log",
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def keyed_server(cycle_model_dir, tmp_path_factory):
    """API key, a 1-request waiting queue and a 4 KiB body limit."""
    from tests.server_harness import ServerProcess

    proc = ServerProcess(
        ["--model", str(cycle_model_dir), "--served-model-name", CYCLE_MODEL, "--max-waiting", "1",
         "--max-request-bytes", "4096", *ENGINE_ARGS],
        tmp_path_factory.mktemp("keyed-server") / "server.log", api_key=API_KEY,
    )
    yield proc
    proc.stop()


@pytest.fixture
def caplog(caplog):
    """pytest's caplog, also on the "jaxpaged" logger itself: once any LLM() in this worker has set jaxpaged's logging
    up, "jaxpaged" stops propagating and the root logger's handler would miss its records. Propagation is held off
    for the test, so a record is seen once either way."""
    log = logging.getLogger("jaxpaged")
    propagate = log.propagate
    log.addHandler(caplog.handler)
    log.propagate = False
    yield caplog
    log.removeHandler(caplog.handler)
    log.propagate = propagate

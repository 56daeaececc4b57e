"""jaxpaged.platforms.cpu.host_malloc: an engine starting on the CPU keeps XLA:CPU's per-run temporaries mapped, a user's
own malloc settings win, and `import jaxpaged` alone changes nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from jaxpaged.platforms.cpu.host_malloc import _libc

pytestmark = pytest.mark.skipif(_libc() is None, reason="glibc only")

# A jitted program whose temporaries (two 64 MiB cumsums) are allocated by XLA's threads on every run.
# Tuned, a run faults 0 pages once the heap has grown to fit them, but while it settles a run can still
# fault 35-51k (seen on 2-core VMs: in up to 4 of 20 runs), so the test compares medians, not means.
FAULTS_PER_RUN = textwrap.dedent(
    """
    import resource
    from jaxpaged.platforms.cpu import host_malloc
    host_malloc.tune_malloc()  # what the CPU platform does when an engine starts, before XLA runs anything
    import jax, jax.numpy as jnp
    x = jnp.ones((2048, 8192), jnp.float32)
    f = jax.jit(lambda x: (jnp.cumsum(x, axis=1) * 2.0 + jnp.cumsum(x, axis=0)).max())
    f(x).block_until_ready()
    faults = []
    for _ in range(20):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x).block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    # the median: while the heap settles, a few early runs still land on fresh pages
    print(host_malloc.applied, sorted(faults)[len(faults) // 2])
    """
)


def _run(code: str, **env) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    environ.pop("JAXPAGED_MALLOC_TUNING", None)
    environ.update(env, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True).stdout


def _optimized_xla_flags() -> str:
    """XLA_FLAGS without the suite's -O0 (tests/conftest.py): the cumsums' runs are what is measured, and at -O0 each
    took ~4 s of CPU (98 s a process against 15-20 s); their page faults are the same either way (0 tuned, ~67.7k
    untuned)."""
    return re.sub(r"--xla_backend_optimization_level=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()


def test_tuned_malloc_keeps_xla_temporaries_mapped():
    flags = _optimized_xla_flags()
    tuned_applied, tuned = _run(FAULTS_PER_RUN, XLA_FLAGS=flags).split()
    plain_applied, plain = _run(FAULTS_PER_RUN, JAXPAGED_MALLOC_TUNING="0", XLA_FLAGS=flags).split()
    assert (tuned_applied, plain_applied) == ("True", "False")
    # untuned, every run maps its 128 MiB of temporaries afresh: ~32k+ page faults
    assert float(plain) > 20_000
    assert float(tuned) < float(plain) / 4


@pytest.mark.parametrize("env", [{"JAXPAGED_MALLOC_TUNING": "0"}, {"MALLOC_ARENA_MAX": "4"}, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}])
def test_user_settings_are_left_alone(env):
    code = "from jaxpaged.platforms.cpu import host_malloc; print(host_malloc.tune_malloc(), host_malloc.applied)"
    assert _run(code, **env).strip() == "False False"


def test_importing_jaxpaged_changes_no_process_wide_setting():
    code = "import jaxpaged, jaxpaged.entrypoints.generate; from jaxpaged.platforms.cpu import host_malloc; print(host_malloc.applied)"
    assert _run(code).strip() == "False"


def test_an_engine_starting_on_the_cpu_tunes_malloc(tmp_path):
    from tests.cycle_model import write_cycle_model

    model = write_cycle_model(tmp_path / "cycle")
    code = (
        "from jaxpaged.config import EngineConfig; from jaxpaged.engine.llm_engine import LLMEngine; "
        "from jaxpaged.platforms.cpu import host_malloc; "
        f"LLMEngine(EngineConfig(model={str(model)!r}, max_model_len=64, max_num_seqs=2, num_kv_blocks=16, "
        f"precompile=False, cache_dir={str(tmp_path / 'cache')!r})); print(host_malloc.applied)"
    )
    assert _run(code).strip().splitlines()[-1] == "True"

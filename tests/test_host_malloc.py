"""jaxpaged.host_malloc: XLA:CPU's per-run temporaries stay mapped, and a user's own malloc settings win."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from jaxpaged.host_malloc import _libc

pytestmark = pytest.mark.skipif(_libc() is None, reason="glibc only")

# A jitted program whose temporaries (two 64 MiB cumsums) are allocated by XLA's threads on every run.
# Tuned, a run faults 0 pages once the heap has grown to fit them, but while it settles a run can still
# fault 35-51k (seen on 2-core VMs: in up to 4 of 20 runs), so the test compares medians, not means.
FAULTS_PER_RUN = textwrap.dedent(
    """
    import resource
    import jaxpaged
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
    print(jaxpaged.host_malloc.applied, sorted(faults)[len(faults) // 2])
    """
)


def _run(code: str, **env) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    environ.pop("JAXPAGED_MALLOC_TUNING", None)
    environ.update(env, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True).stdout


def test_importing_jaxpaged_keeps_xla_temporaries_mapped():
    tuned_applied, tuned = _run(FAULTS_PER_RUN).split()
    plain_applied, plain = _run(FAULTS_PER_RUN, JAXPAGED_MALLOC_TUNING="0").split()
    assert (tuned_applied, plain_applied) == ("True", "False")
    # untuned, every run maps its 128 MiB of temporaries afresh: ~32k+ page faults
    assert float(plain) > 20_000
    assert float(tuned) < float(plain) / 4


@pytest.mark.parametrize("env", [{"JAXPAGED_MALLOC_TUNING": "0"}, {"MALLOC_ARENA_MAX": "4"}, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}])
def test_user_settings_are_left_alone(env):
    assert _run("import jaxpaged; print(jaxpaged.host_malloc.applied)", **env).strip() == "False"

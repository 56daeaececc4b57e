"""Where a benchmark's numbers came from: the date, the machine, the packages, the GPU, and how fast this host was on
the day. One copy of each probe, so every script's JSON records them the same way; each script still picks its own
keys, since docs/data's reports and scripts/plots.py read them as they were first written.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess

# the GPU's name, driver and memory, one CSV line a GPU
NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
# environment variables that change how XLA compiles and how a GPU executable's dispatch waits on the host
RUNTIME_ENV_PREFIXES = ("XLA_", "JAX_", "PJRT_", "TF_", "CUDA_")


def today() -> str:
    """'2026-11-28': the local date, as the reports' `date` fields hold it."""
    return datetime.date.today().isoformat()


def utc_now() -> str:
    """'2026-11-28T09:15:02+00:00': the moment in UTC, to the second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def versions(dists) -> dict[str, str]:
    """{distribution: version} of those installed, read from their metadata (nothing is imported, and one missing
    is left out rather than failing a run)."""
    import importlib.metadata

    out = {}
    for dist in dists:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def command_output(cmd: list[str], timeout: float = 15.0) -> str | None:
    """A command's stdout, or None when it is missing, fails or hangs (a probe, never a reason to stop)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def nvidia_smi_text() -> str | None:
    """nvidia-smi's CSV lines for NVIDIA_SMI_QUERY as it printed them (None where there is no NVIDIA GPU)."""
    return (command_output(NVIDIA_SMI_QUERY) or "").strip() or None


def nvidia_smi() -> dict | None:
    """GPU name, driver, memory and the driver's CUDA version from nvidia-smi (None where there is none)."""
    query = command_output(NVIDIA_SMI_QUERY)
    if query is None:
        return None
    fields = ("name", "driver_version", "memory_total")
    gpus = [dict(zip(fields, (c.strip() for c in line.split(",")))) for line in query.strip().splitlines()]
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", command_output(["nvidia-smi"]) or "")
    return {"gpus": gpus, "cuda_version": cuda.group(1) if cuda else None}


def runtime_env() -> dict[str, str]:
    """The XLA_/JAX_/PJRT_/TF_/CUDA_ variables set for this run."""
    return {k: v for k, v in os.environ.items() if k.startswith(RUNTIME_ENV_PREFIXES)}


def machine_info() -> dict:
    """What a plot needs to say where its numbers came from (bench_throughput's `machine`: scripts/plots.py reads
    these keys)."""
    import jax
    import machine_load
    import torch
    import transformers

    info = {
        "platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "jax_device_kind": jax.devices()[0].device_kind, "cpu_model": machine_load.cpu_model(), "date": utc_now(),
    }  # fmt: skip
    return info | ({"torch_device": torch.cuda.get_device_name(0)} if torch.cuda.is_available() else {})


def calibrate(iters: int = 10) -> dict:
    """This machine's speed today, measured in the same run: float32 matmul rates (2048^3, jax and torch)
    and a large read (jnp.sum of 256 MB). Hosts differ from day to day, and jaxpaged's matmul-bound steps
    follow the matmul rate while transformers' overhead-bound loop does not: a figure without these cannot
    be compared with another day's."""
    import jax
    import jax.numpy as jnp
    import torch
    from workload import median_seconds

    n, flops = 2048, 2 * 2048**3
    a = jnp.ones((n, n), jnp.float32)
    big = jnp.ones((64 << 20,), jnp.float32)
    t = torch.ones(n, n, device="cuda" if torch.cuda.is_available() else "cpu")

    def torch_matmul() -> None:
        torch.mm(t, t)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    matmul = jax.jit(lambda x: jnp.dot(x, x, precision="highest"))
    return {
        "f32_matmul_gflops_jax": flops / median_seconds(matmul, a, iters=iters) / 1e9,
        "f32_matmul_gflops_torch": flops / median_seconds(torch_matmul, iters=iters) / 1e9,
        "read_gb_s_jax": big.nbytes / median_seconds(jax.jit(jnp.sum), big, iters=iters) / 1e9,
    }

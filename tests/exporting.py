"""Lowering for an accelerator that is not here: jax.export traces and lowers for the named platform only."""

from __future__ import annotations

import contextlib
import re

import jax

TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call")  # JAX's Triton custom call, by JAX version
MOSAIC_CALL = "tpu_custom_call"


@contextlib.contextmanager
def lowering_for(platform: str):
    """From JAX 0.11 a Triton kernel lowers without a GPU only for an abstract GPU device, as JAX's own deviceless
    AOT tests do (0.10 fell back to compute capability 9.0 by itself); TPU needs nothing."""
    if platform != "cuda":
        yield
        return
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("export",), abstract_device=device)):
        yield


def export_checks(platform: str) -> dict:
    """jax.export refuses custom calls it cannot promise to keep stable unless told they are expected."""
    if platform != "cuda":
        return {}
    return {"disabled_checks": [jax.export.DisabledSafetyCheck.custom_call(name) for name in TRITON_CALLS]}


def kernel_bodies(module_text: str, targets) -> set[str]:
    """The distinct kernels the module launches: each call's backend config (Triton's `ir` attribute, or Mosaic's
    serialized kernel), without its grid or source location."""
    bodies = set()
    for call in kernel_calls(module_text, targets):
        body = re.sub(r"grid_[xyz] = \d+ : i32", "", call.split("backend_config", 1)[-1])
        bodies.add(re.sub(r"loc\(#loc\d+\)\s*$", "", body))
    return bodies


def kernel_calls(module_text: str, targets) -> list[str]:
    """The custom-call ops in a lowered module that launch one of `targets` (their whole text: the kernel's IR,
    grid and launch parameters), one entry per op in the text."""
    return [line for line in module_text.splitlines()
            if "custom_call" in line and any(re.search(rf"@{re.escape(t)}\b|\"{re.escape(t)}\"", line) for t in targets)]  # fmt: skip

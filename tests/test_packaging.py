"""Installing jaxpaged. It installs one import name: a built wheel, installed into a new venv, generates from a
folder that holds its own `models.py` and `pallas_kernels.py` (common names in ML projects, which shadowed ours when
they were top-level packages). The extras' packages (gguf, fastapi, uvicorn) are optional: a missing one names its
extra, and an offline GPU image without them installs with --no-deps and generates."""

from __future__ import annotations

import os
import shutil
import site as site_module
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests import REPO
from tests.cycle_model import CYCLE_TEXT, write_cycle_model
from tests.native_kernels import copy_built_kernels


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    import setuptools

    # the build needs setuptools>=68: use this environment's when it has one, else let pip fetch one (isolated build)
    isolation = ["--no-build-isolation"] if int(setuptools.__version__.split(".")[0]) >= 68 else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(out), str(REPO)],
                   check=True, cwd=out)  # fmt: skip
    (path,) = out.glob("jaxpaged-*.whl")
    return path


def test_the_wheel_holds_one_top_level_package_with_the_kernel_sources(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"jaxpaged"}
    # every module and kernel source of the checkout, where the mapping puts it (a package missing from
    # pyproject.toml's list would be left out)
    expected = set()
    for folder, inside in (("jaxpaged", ""), ("models", "models/"), ("pallas_kernels", "pallas_kernels/")):
        expected |= {f"jaxpaged/{inside}{p.relative_to(REPO / folder).as_posix()}"
                     for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".cc", ".h")}  # fmt: skip
    assert not expected - set(names)


def test_a_users_models_py_does_not_shadow_jaxpaged(wheel, tmp_path):
    # a new venv that sees this environment's dependencies (a .pth line) but not its jaxpaged
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    # (every site dir: a venv made with --system-site-packages keeps the dependencies in its base's)
    (site / "dependencies.pth").write_text("".join(f"{d}\n" for d in site_module.getsitepackages()))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)], check=True)

    project = tmp_path / "my_project"
    project.mkdir()
    (project / "models.py").write_text("raise ImportError('the user models.py was imported')\n")
    (project / "pallas_kernels.py").write_text("raise ImportError('the user pallas_kernels.py was imported')\n")
    model = write_cycle_model(tmp_path / "cycle")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAXPAGED_CACHE_DIR"] = str(tmp_path / "cache")
    where = subprocess.run([python, "-c", "import jaxpaged.models.llama, jaxpaged.pallas_kernels; print(jaxpaged.__file__)"],
                           cwd=project, env=env, capture_output=True, text=True)  # fmt: skip
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(site)  # the wheel's copy, not this checkout
    run = subprocess.run([python, "-m", "jaxpaged.generate", "--model", str(model), "--max-tokens", "16",
                          "--quiet", "a"], cwd=project, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert CYCLE_TEXT[:4] in run.stdout  # the greedy cycle, after "a"


def test_a_missing_extra_names_the_extra_to_install(monkeypatch, capsys, tmp_path):
    from jaxpaged.entrypoints import serve
    from jaxpaged.models import gguf_io
    from jaxpaged.utils.extras import MissingExtraError

    for module in ("gguf", "uvicorn"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it now fails as if it were not installed
    with pytest.raises(MissingExtraError, match=r"pip install 'jaxpaged\[gguf\]'"):
        gguf_io.open_gguf(str(tmp_path / "model.gguf"))
    # the server says so before its engine starts (the model path does not even exist)
    assert serve.main(["--model", str(tmp_path / "nowhere")]) == 2
    assert "pip install 'jaxpaged[serve]'" in capsys.readouterr().err


# "A typical GPU image" (issue 20): jax with its CUDA plugin, flax, transformers, safetensors, orbax-checkpoint,
# prometheus-client, jinja2 and torch preinstalled, and no network. The venv below holds those packages (CPU jax,
# and setuptools for --no-build-isolation) but not torch: a subset is the stronger check that nothing needs it.
IMAGE_PACKAGES = ("setuptools>=68", "jax", "jaxlib", "flax", "transformers", "safetensors", "orbax-checkpoint",
                  "prometheus-client", "jinja2")  # fmt: skip
NOT_IN_THE_IMAGE = ("gguf", "fastapi", "uvicorn", "torch")  # the extras' packages (and torch) must not be needed
OFFLINE = {"PIP_NO_INDEX": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _pinned(requirement: str) -> str:
    """This environment's version of a package, so pip's cache serves it and the venv matches the tested one."""
    import importlib.metadata

    if any(c in requirement for c in "<>="):
        return requirement
    try:
        return f"{requirement}=={importlib.metadata.version(requirement)}"
    except importlib.metadata.PackageNotFoundError:
        return requirement


def _index_reachable() -> str | None:
    """None if pip's index answers, else why not."""
    import urllib.request

    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/").rstrip("/") + "/pip/"
    try:
        urllib.request.urlopen(url, timeout=15).close()
    except Exception as exc:  # noqa: BLE001 (no network, a proxy, DNS: all mean skip)
        return f"{url}: {exc}"
    return None


@pytest.mark.network
def test_an_offline_gpu_image_installs_with_no_deps_and_generates(tmp_path):
    """Issue 20: on a machine holding only the image's packages, `pip install --no-deps --no-build-isolation -e .`
    and the generate CLI on a bare config.json (random weights) work offline."""
    if (why := _index_reachable()) is not None:
        pytest.skip(f"the image's packages come from PyPI, which is unreachable ({why})")
    env_dir = tmp_path / "image"
    venv.create(env_dir, with_pip=True)  # no system site packages
    python = str(env_dir / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_NO_INDEX")}
    env |= {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "JAXPAGED_CACHE_DIR": str(tmp_path / "cache")}
    # --no-compile: no bytecode for all of those packages' modules ahead of time, only for those the run imports
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-compile", *map(_pinned, IMAGE_PACKAGES)], env=env,
                   check=True, cwd=tmp_path, timeout=1200)  # fmt: skip

    # from here on, offline; a copy of the sources, so the checkout gets no build files
    env |= OFFLINE
    src = tmp_path / "src"
    for name in ("jaxpaged", "models", "pallas_kernels"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(src)],
                             env=env, cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    for module in NOT_IN_THE_IMAGE:
        probe = subprocess.run([python, "-c", f"import {module}"], env=env, cwd=tmp_path, capture_output=True)
        assert probe.returncode != 0, f"{module} is importable in the image venv, so the test proves nothing about it"

    # a bare config.json (random weights) beside tokenizer files: the cycle model without its weights
    model = write_cycle_model(tmp_path / "model")
    (model / "model.safetensors").unlink()
    copy_built_kernels(tmp_path / "cache")  # the wheel test above builds them from installed sources; not again here
    run = subprocess.run([python, "-m", "jaxpaged.generate", "--model", str(model / "config.json"), "--max-tokens", "4",
                          "Hello"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip(), run.stderr  # the continuation (4 random tokens) streams on stdout

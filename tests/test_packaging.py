"""jaxpaged installs one import name: a built wheel, installed into a new venv, generates from a folder that holds
its own `models.py` and `pallas_kernels.py` (common names in ML projects, which shadowed ours when they were
top-level packages)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from tests import REPO
from tests.cycle_model import CYCLE_TEXT, write_cycle_model


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
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
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

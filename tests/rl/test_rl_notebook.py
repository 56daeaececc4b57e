"""notebooks/rl_grpo.ipynb, executed top to bottom in a python3 kernel on the CPU: Tunix's GRPO on the built-in model
with jaxpaged as the rollout engine, the engine equal to the trainer's model after every weight sync (about two
minutes on 2 cores)."""

from __future__ import annotations

import os

import pytest

from tests import REPO

pytest.importorskip("tunix", reason="google-tunix is not installed: pip install -e '.[rl]' (docs/rl.md)")
pytest.importorskip("nbclient")
NOTEBOOK = REPO / "notebooks" / "rl_grpo.ipynb"


def test_grpo_notebook_runs_and_checks_every_sync():
    import nbformat
    from nbclient import NotebookClient

    from jaxpaged.models.builtin import builtin_gguf_path

    try:
        builtin_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(f"the notebook trains the built-in model: {exc}")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        mp.setenv("JAX_PLATFORMS", "cpu")
        NotebookClient(nb, kernel_name="python3", timeout=900, resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    train = next(c for c in nb.cells if "train" in c.metadata.get("tags", []))
    printed = "".join(o.get("text", "") for o in train.outputs if o.output_type == "stream" and o.name == "stdout")
    lines = [line for line in printed.splitlines() if line.startswith("after sync")]
    assert len(lines) == 3 and all("greedy equal to Tunix's sampler: True" in line for line in lines), printed
    summary = next(c for c in nb.cells if "summary" in c.metadata.get("tags", []))
    assert any("3 GRPO steps" in o.get("text", "") for o in summary.outputs), summary.outputs

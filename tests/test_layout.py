"""The layout's rules that a reader relies on, checked on the source itself."""

from __future__ import annotations

import re

from tests import REPO


def _sources():
    for folder in ("jaxpaged", "models", "pallas_kernels"):
        yield from (REPO / folder).rglob("*.py")


def test_the_device_kind_is_asked_in_one_place():
    """platforms.get() chooses once; nothing else (runner, loader, models, kernels) asks JAX which device it is on."""
    askers = sorted(str(p.relative_to(REPO)) for p in _sources() if re.search(r"default_backend\(\)", p.read_text()))
    assert askers == ["jaxpaged/platforms/__init__.py"]



def test_core_imports_nothing_from_the_layers_above_it():
    """core/ (requests, blocks, scheduling) is pure Python that the engine and worker build on, never the reverse."""
    for path in (REPO / "jaxpaged" / "core").rglob("*.py"):
        imports = re.findall(r"^\s*(?:from|import) jaxpaged\.(\w+)", path.read_text(), re.M)
        assert not set(imports) & {"engine", "worker", "entrypoints"}, (path, imports)

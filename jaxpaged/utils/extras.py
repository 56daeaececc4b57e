"""Optional packages: each is imported only where it is used, and a missing one names the extra that installs it."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {"gguf": "gguf", "fastapi": "serve", "uvicorn": "serve", "prometheus_client": "serve", "tunix": "rl", "openai_harmony": "harmony",
          "av": "video"}  # module -> extra


class MissingExtraError(ModuleNotFoundError):
    """An optional package is not installed; the message says which of jaxpaged's extras installs it."""


def require(module: str, purpose: str) -> ModuleType:
    """Import the optional package `module`, or raise MissingExtraError: "`purpose` needs ...; pip install ..."."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise  # the package is there but one of its own imports failed: that error says more
        extra = EXTRAS[module]
        raise MissingExtraError(
            f"{purpose} needs the {module} package, which is not installed; install it with: "
            f"pip install 'jaxpaged[{extra}]' (or pip install -e '.[{extra}]' in a checkout)",
            name=module,
        ) from None

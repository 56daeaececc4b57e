"""OpenAI-compatible HTTP server over AsyncLLMEngine (`python -m jaxpaged.serve`); its packages are the `serve`
extra's."""

from jaxpaged.utils.extras import require

for _module in ("fastapi", "prometheus_client"):
    require(_module, "the OpenAI server (python -m jaxpaged.serve)")

from jaxpaged.entrypoints.openai.app import build_app  # noqa: E402
from jaxpaged.entrypoints.openai.serving import ServerSettings  # noqa: E402

__all__ = ["ServerSettings", "build_app"]

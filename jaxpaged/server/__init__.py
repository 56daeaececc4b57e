"""OpenAI-compatible HTTP server over AsyncLLMEngine (`python -m jaxpaged.serve`)."""

from jaxpaged.server.app import build_app
from jaxpaged.server.serving import ServerSettings

__all__ = ["ServerSettings", "build_app"]

"""OpenAI-compatible HTTP server over AsyncLLMEngine (`python -m jaxpaged.serve`)."""

from jaxpaged.entrypoints.openai.app import build_app
from jaxpaged.entrypoints.openai.serving import ServerSettings

__all__ = ["ServerSettings", "build_app"]

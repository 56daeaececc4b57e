"""jaxpaged: serve LLMs with JAX over a paged KV cache."""

__version__ = "0.1.0"

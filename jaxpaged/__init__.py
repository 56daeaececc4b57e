"""jaxpaged: serve LLMs with JAX over a paged KV cache."""

__version__ = "0.1.0"

from jaxpaged.llm import LLM  # noqa: E402
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from jaxpaged.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]

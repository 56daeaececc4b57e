"""jaxpaged: serve LLMs with JAX over a paged KV cache."""

__version__ = "0.1.0"

from jaxpaged.host_malloc import tune_malloc  # noqa: E402

tune_malloc()  # before anything starts XLA's threads: see host_malloc.py

from jaxpaged.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence  # noqa: E402
from jaxpaged.llm import LLM  # noqa: E402
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from jaxpaged.sampling_params import SamplingParams  # noqa: E402

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]

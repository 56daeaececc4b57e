"""jaxpaged: serve LLMs with JAX over a paged KV cache."""

__version__ = "0.1.0"

from jaxpaged.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxpaged.entrypoints.llm import LLM
from jaxpaged.lora import LoRARequest
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "Logprob",
    "LoRARequest",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]

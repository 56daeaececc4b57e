"""jaxpaged: serve LLMs with JAX over a paged KV cache."""

__version__ = "0.1.0"

from jaxpaged.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxpaged.entrypoints.llm import LLM
from jaxpaged.lora import LoRARequest
from jaxpaged.outputs import (
    ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob,
    PoolingOutput, PoolingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput,
)  # fmt: skip
from jaxpaged.pooling_params import PoolerConfig, PoolingParams
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "LoRARequest",
    "PoolerConfig",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
]

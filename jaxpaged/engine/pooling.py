"""A pooling engine (runner="pooling"): what it pools and how a pooled vector becomes a caller's output.

The device sums each prompt's final hidden states over the positions its pooling type reads (the runner's `pool_rows`:
the last, every, or the first position), chunk by chunk, into float32 rows; the host adds a prompt's chunks, and
here turns the sum into vLLM's outputs: an embedding (the mean for MEAN, cut to `dimensions`, then normalized) or a
classifier's probabilities (its head on the host: a [labels, hidden] matmul, then softmax, or sigmoid for one label).
A request is run as a one-token greedy generation whose token is dropped, so the scheduler needs nothing new.
"""

from __future__ import annotations

import logging

import numpy as np

from jaxpaged.core.request import POOL_CLS, POOL_LAST, POOL_MEAN
from jaxpaged.pooling_params import PoolerConfig, PoolingParams
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxpaged.engine")

# each pooling type's ParentRequest.pool_code (the positions it reads: Request.pooled_span)
POOLING_CODES = {"LAST": POOL_LAST, "MEAN": POOL_MEAN, "CLS": POOL_CLS}
# a pooling request's run: the prompt, then one greedy token, never decoded or returned
POOLING_RUN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
                             output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip


def wants_pooling_runner(runner: str, pooling_info) -> bool:
    """runner "auto": pooling for a checkpoint whose architecture pools (an embedding or classifier model), or that
    says how to pool (a sentence-transformers modules.json: Qwen3-Embedding names Qwen3ForCausalLM)."""
    if runner != "auto":
        return runner == "pooling"
    return pooling_info is not None and (pooling_info.task in ("embed", "classify") or pooling_info.pooling_type is not None)


class Pooler:
    """The engine's pooling: its type and defaults, each request's checks, and the finished vectors."""

    def __init__(self, pooling_info, config: PoolerConfig | None, hidden_size: int):
        config = config or PoolerConfig()
        self.classifier = None if pooling_info is None else pooling_info.classifier
        self.id2label = None if pooling_info is None else pooling_info.id2label
        self.task = "classify" if self.classifier is not None else "embed"
        from_checkpoint = None if pooling_info is None else pooling_info.pooling_type
        self.pooling_type = config.pooling_type or from_checkpoint or "LAST"
        checkpoint_normalize = None if pooling_info is None else pooling_info.normalize
        self.normalize = config.normalize if config.normalize is not None else (
            checkpoint_normalize if checkpoint_normalize is not None else True)  # fmt: skip
        self.hidden_size = hidden_size
        self.code = POOLING_CODES[self.pooling_type]
        logger.info("pooling runner: %s, %s pooling%s", self.task, self.pooling_type,
                    ", normalized" if self.task == "embed" and self.normalize else "")  # fmt: skip

    @property
    def num_labels(self) -> int:
        return 0 if self.classifier is None else int(self.classifier.shape[0])

    def check(self, params: PoolingParams) -> PoolingParams:
        """params with its task settled (the model's); a task or field this model cannot serve is a ValueError."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams (got {type(params).__name__})")
        task = params.task or self.task
        if task == "score":  # a cross-encoder scores with its classifier, an embedding model by cosine similarity
            task = self.task
        if task != self.task:
            what = "an embedding model" if self.task == "embed" else f"a classifier ({self.num_labels} labels)"
            raise ValueError(f"task {params.task!r} is not supported by this model: it is {what}, so it serves "
                             f"{self.task!r}")  # fmt: skip
        if params.dimensions is not None:
            if task != "embed":
                raise ValueError("dimensions applies to embeddings only")
            if params.dimensions > self.hidden_size:
                raise ValueError(f"dimensions must be <= the model's hidden size {self.hidden_size} (got {params.dimensions})")
        if params.normalize is not None and task != "embed":
            raise ValueError("normalize applies to embeddings only (a classifier's output is its activation's)")
        if params.activation is not None and task != "classify":
            raise ValueError("activation applies to classifiers only")
        resolved = params.clone()
        resolved.task = task
        return resolved

    def finish(self, total: np.ndarray, num_tokens: int, params: PoolingParams) -> np.ndarray:
        """A prompt's summed hidden states -> its output vector (float32)."""
        vector = total / num_tokens if self.pooling_type == "MEAN" else total
        if params.task == "classify":
            logits = self.classifier @ vector
            if params.activation is False:
                return logits.astype(np.float32)
            if logits.shape[0] == 1:
                return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
            e = np.exp(logits - logits.max())
            return (e / e.sum()).astype(np.float32)
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = self.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return vector.astype(np.float32)

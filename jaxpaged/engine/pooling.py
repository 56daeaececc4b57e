"""A pooling engine (runner="pooling"): what it pools and how a pooled vector becomes a caller's output.

The device sums each prompt's final hidden states over the positions its pooling type reads (the runner's `pool_rows`:
the last, every, or the first position), chunk by chunk, into float32 rows; the host adds a prompt's chunks, and
here turns the sum into vLLM's outputs: an embedding (the mean for MEAN, cut to `dimensions`, then normalized) or a
classifier's probabilities (its head on the host: a [labels, hidden] matmul, then softmax, or sigmoid for one label).
The token tasks (token_embed, token_classify: ALL pooling) read every prompt position's hidden state instead, which
the step hands back whole (the runner's pooled tokens) and the host keeps chunk by chunk; their rows are finished
here alike, one per position (STEP: only the positions holding step_tag_id).
A request is run as a one-token greedy generation whose token is dropped, so the scheduler needs nothing new.
"""

from __future__ import annotations

import logging

import numpy as np

from jaxpaged.core.request import POOL_ALL, POOL_CLS, POOL_LAST, POOL_MEAN
from jaxpaged.pooling_params import SEQUENCE_POOLING, TOKEN_TASKS, PoolerConfig, PoolingParams
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxpaged.engine")

# each pooling type's ParentRequest.pool_code (the positions it reads: Request.pooled_span); STEP reads ALL's
POOLING_CODES = {"LAST": POOL_LAST, "MEAN": POOL_MEAN, "CLS": POOL_CLS, "ALL": POOL_ALL, "STEP": POOL_ALL}
# a pooling request's run: the prompt, then one greedy token, never decoded or returned
POOLING_RUN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
                             output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
# the tasks each kind of checkpoint serves, as vLLM's poolers (an embedding model, a sequence or a token classifier)
MODEL_TASKS = {"embed": ("embed", "token_embed"), "classify": ("classify", "token_classify"),
               "token_classify": ("token_classify",)}  # fmt: skip


def wants_pooling_runner(runner: str, pooling_info) -> bool:
    """runner "auto": pooling for a checkpoint whose architecture pools (an embedding model, a sequence or token
    classifier), or that says how to pool (a sentence-transformers modules.json: Qwen3-Embedding names
    Qwen3ForCausalLM)."""
    if runner != "auto":
        return runner == "pooling"
    return pooling_info is not None and (pooling_info.task in MODEL_TASKS or pooling_info.pooling_type is not None)


def matryoshka(hf_config) -> tuple[bool, list[int] | None]:
    """(is_matryoshka, matryoshka_dimensions) as vLLM's ModelConfig reads them from the checkpoint's config."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return bool(dims) or bool(getattr(hf_config, "is_matryoshka", False)), (list(dims) if dims else None)


def _activate(logits: np.ndarray) -> np.ndarray:
    """A classifier's activation over the last axis: softmax, or sigmoid for one label."""
    if logits.shape[-1] == 1:
        return 1.0 / (1.0 + np.exp(-logits))
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class Pooler:
    """The engine's pooling: its types and defaults, each request's checks, and the finished vectors."""

    def __init__(self, pooling_info, config: PoolerConfig | None, hidden_size: int, hf_config=None):
        config = config or PoolerConfig()
        self.classifier = None if pooling_info is None else pooling_info.classifier
        self.bias = None if pooling_info is None else pooling_info.bias
        self.id2label = None if pooling_info is None else pooling_info.id2label
        kind = None if pooling_info is None else pooling_info.task
        self.tasks = MODEL_TASKS["token_classify" if kind == "token_classify" else
                                 "classify" if self.classifier is not None else "embed"]  # fmt: skip
        self.task = self.tasks[0]  # a request's task when it names none
        from_checkpoint = None if pooling_info is None else pooling_info.pooling_type
        seq_type = config.pooling_type if config.pooling_type in SEQUENCE_POOLING else None
        self.pooling_type = seq_type or from_checkpoint or "LAST"
        self.token_pooling_type = "ALL" if seq_type or config.pooling_type is None else config.pooling_type
        self.step_defaults = {"step_tag_id": config.step_tag_id, "returned_token_ids": config.returned_token_ids}
        checkpoint_normalize = None if pooling_info is None else pooling_info.normalize
        self.normalize = config.normalize if config.normalize is not None else (
            checkpoint_normalize if checkpoint_normalize is not None else True)  # fmt: skip
        self.hidden_size = hidden_size
        self.is_matryoshka, self.matryoshka_dimensions = matryoshka(hf_config)
        self.code = POOLING_CODES[self.pooling_type]
        logger.info("pooling runner: %s, %s pooling%s", "/".join(self.tasks), self.pooling_type,
                    ", normalized" if self.task == "embed" and self.normalize else "")  # fmt: skip

    @property
    def num_labels(self) -> int:
        return 0 if self.classifier is None else int(self.classifier.shape[0])

    def describe(self) -> str:
        if self.task == "embed":
            return "an embedding model"
        kind = "a token classifier" if self.task == "token_classify" else "a classifier"
        return f"{kind} ({self.num_labels} labels)"

    def code_for(self, params: PoolingParams) -> int:
        """The step's pool code of a checked request: ALL's rows for a token task, else the model's pooling type."""
        return POOL_ALL if params.task in TOKEN_TASKS else self.code

    def check(self, params: PoolingParams) -> PoolingParams:
        """params with its task settled (the model's); a task or field this model cannot serve is a ValueError."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams (got {type(params).__name__})")
        task = params.task or self.task
        if task == "score" and self.task != "token_classify":  # a cross-encoder scores with its classifier, an embedding model by cosine
            task = self.task
        if task not in self.tasks:
            raise ValueError(f"task {task!r} is not supported by this model: it is {self.describe()}, so it serves "
                             f"{', '.join(map(repr, self.tasks))}")  # fmt: skip
        embeds = task in ("embed", "token_embed")
        if params.dimensions is not None:
            self._check_dimensions(params.dimensions, embeds)
        if params.normalize is not None and not embeds:
            raise ValueError("normalize applies to embeddings only (a classifier's output is its activation's)")
        if params.activation is not None and embeds:
            raise ValueError("activation applies to classifiers only")
        resolved = params.clone()
        resolved.task = task
        self._step_params(resolved)
        return resolved

    def _check_dimensions(self, dimensions: int, embeds: bool) -> None:
        """vLLM's Matryoshka check: the model's config must say it is one (is_matryoshka, or matryoshka_dimensions,
        which then lists the dimensions it serves)."""
        if not embeds:
            raise ValueError("dimensions applies to embeddings only")
        if not self.is_matryoshka:
            raise ValueError("dimensions: this model does not support Matryoshka representation (its config sets "
                             "neither is_matryoshka nor matryoshka_dimensions); changing the output dimensions would "
                             "give poor results")  # fmt: skip
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions must be one of the model's matryoshka_dimensions {self.matryoshka_dimensions} "
                             f"(got {dimensions})")  # fmt: skip
        if dimensions > self.hidden_size:
            raise ValueError(f"dimensions must be <= the model's hidden size {self.hidden_size} (got {dimensions})")

    def _step_params(self, params: PoolingParams) -> None:
        """step_tag_id and returned_token_ids: STEP pooling's (a token task's), the pooler config's where unset."""
        asked = [k for k in self.step_defaults if getattr(params, k) is not None]
        if params.task not in TOKEN_TASKS or self.token_pooling_type != "STEP":
            if asked:
                raise ValueError(f"{', '.join(asked)}: only with STEP pooling (pooler_config pooling_type 'STEP') and a "
                                 f"token task (token_embed, token_classify)")  # fmt: skip
            return
        for key, default in self.step_defaults.items():
            if getattr(params, key) is None and default is not None:
                setattr(params, key, list(default) if key == "returned_token_ids" else default)
        columns = self.num_labels if params.task == "token_classify" else self.hidden_size
        if params.returned_token_ids is not None and max(params.returned_token_ids) >= columns:
            raise ValueError(f"returned_token_ids must be < {columns}, the output's columns (got {params.returned_token_ids})")

    def finish(self, total: np.ndarray, num_tokens: int, params: PoolingParams) -> np.ndarray:
        """A prompt's summed hidden states -> its output vector (float32)."""
        vector = total / num_tokens if self.pooling_type == "MEAN" else total
        return self._head(vector[None], params)[0]

    def finish_tokens(self, rows: np.ndarray, prompt_token_ids: list[int], params: PoolingParams) -> np.ndarray:
        """A token task's prompt hidden states [n, D] -> one output row per position (STEP: per step_tag_id)."""
        if params.step_tag_id is not None:
            rows = rows[np.asarray(prompt_token_ids) == params.step_tag_id]
        return self._head(rows, params)

    def _head(self, rows: np.ndarray, params: PoolingParams) -> np.ndarray:
        """Rows of hidden states -> the task's outputs: a classifier's activated logits, or embeddings (cut to
        `dimensions`, normalized); returned_token_ids keeps those columns first (STEP pooling, as vLLM's)."""
        if params.task in ("classify", "token_classify"):
            logits = rows @ self.classifier.T
            if self.bias is not None:
                logits = logits + self.bias
            if params.returned_token_ids is not None:
                logits = logits[:, params.returned_token_ids]
            return (logits if params.activation is False else _activate(logits)).astype(np.float32)
        if params.returned_token_ids is not None:
            rows = rows[:, params.returned_token_ids]
        if params.dimensions is not None:
            rows = rows[:, : params.dimensions]
        normalize = self.normalize if params.normalize is None else params.normalize
        if normalize:
            rows = rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1e-12)
        return rows.astype(np.float32)

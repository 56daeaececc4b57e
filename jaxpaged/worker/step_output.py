"""What a dispatched step hands back: device futures until fetched, then host arrays."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxpaged import distributed


@dataclasses.dataclass
class DispatchedStep:
    """A step handed to the device: its outputs are futures until fetch() reads them back.

    The forward pass and the sampler are two dispatches: a step whose sampling needs the previous step's
    tokens on the host (a grammar's mask, a penalty's history) runs its forward first and is sampled once
    they are read (ModelRunner.sample), so the device computes the forward while the host catches up.
    """

    bucket: int
    logits: jax.Array | None  # [S, V] of the sampling rows, until sampled
    prompt: tuple | None  # prompt logprobs (device arrays), when some row wants them
    out: object = None  # the sampler's output (device arrays)
    sampled: jax.Array | None = None  # [max_num_seqs] the sampled tokens, padded: the next step's inputs, kept on the device
    want_top: bool = False
    seq: int = -1  # the runner's count of dispatched steps: followers of a process group find theirs by it
    pooled: jax.Array | None = None  # a pooling engine's [S, D] pooled sums (model_runner.pooled_sums)
    pooled_tokens: jax.Array | None = None  # [T, D] its final hidden states, kept when a row runs a token task
    hidden: jax.Array | None = None  # [T, D] the final hidden states, for the MTP layer (ModelRunner.keep_hidden)
    mtp_step: object = None  # the step's inputs, until the MTP layer's shadow step has run (ModelRunner._shadow)

    def fetch(self) -> StepResult:
        get = lambda tree: jax.tree.map(distributed.host_value, tree)  # noqa: E731
        tokens, logprobs = get((self.out.tokens, self.out.logprobs))
        top_ids, top_lp = get((self.out.top_ids, self.out.top_logprobs)) if self.want_top else (None, None)
        return StepResult(tokens, logprobs, top_ids, top_lp, get(self.prompt) if self.prompt is not None else None,
                          get(self.pooled) if self.pooled is not None else None,
                          get(self.pooled_tokens) if self.pooled_tokens is not None else None)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class StepRef:
    """A DispatchedStep named in a message to followers, who hold their own copy of it."""

    seq: int


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray  # [S]
    logprobs: np.ndarray  # [S] of the sampled tokens
    top_ids: np.ndarray | None  # [S, 20] when some row asked for logprobs
    top_logprobs: np.ndarray | None
    prompt: tuple[np.ndarray, ...] | None = None  # prompt_logprobs per row: (logprob, rank, top ids, top logprobs)
    pooled: np.ndarray | None = None  # a pooling engine's [S, D] float32: each row's pooled sum in this step
    pooled_tokens: np.ndarray | None = None  # [T, D] the step's final hidden states, when a row runs a token task

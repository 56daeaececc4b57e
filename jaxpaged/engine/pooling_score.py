"""vLLM's score (LLM.score, the server's /score and /rerank) on a pooling engine, in one place for both callers.

A ScorePlan says which prompts to pool and turns their outputs into scores, so the LLM runs them with its own steps
and the server through the async engine: an embedding model scores a pair by the cosine of the two embeddings (each
text pooled once), a one-label classifier (a cross-encoder) by its sigmoid over the pair, encoded together as its
tokenizer pairs two texts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxpaged.outputs import PoolingRequestOutput, ScoringOutput, ScoringRequestOutput
from jaxpaged.pooling_params import PoolingParams


@dataclasses.dataclass
class ScorePlan:
    first: list[str]  # the pairs, one to one
    second: list[str]
    prompts: list  # what to pool: each distinct text (embeddings), or each pair's token ids (a cross-encoder)
    cross_encoder: bool

    def results(self, outs: Sequence[PoolingRequestOutput]) -> list[ScoringRequestOutput]:
        """The pooled `prompts`' outputs, in order -> one score per pair."""
        if self.cross_encoder:
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids, True)
                    for o in outs]  # fmt: skip
        vectors = dict(zip(self.prompts, outs))
        results = []
        for a, b in zip(self.first, self.second):
            u, v = vectors[a].outputs.data, vectors[b].outputs.data
            cosine = float(u @ v / max(float(np.linalg.norm(u) * np.linalg.norm(v)), 1e-12))
            ids = vectors[a].prompt_token_ids + vectors[b].prompt_token_ids
            results.append(ScoringRequestOutput(f"{vectors[a].request_id}-{vectors[b].request_id}", ScoringOutput(cosine),
                                                ids, True))  # fmt: skip
        return results


def score_plan(pooler, tokenizer, data_1: str | Sequence[str], data_2: str | Sequence[str]) -> ScorePlan:
    """One text against many (1 -> N) or pair by pair (N -> N); a model that cannot score is a ValueError."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second) or not second:
        raise ValueError(f"data_1 must hold one text or as many as data_2 (got {len(first)} and {len(second)})")
    if pooler is None:
        raise ValueError("score needs a pooling model (runner='pooling')")
    if pooler.task == "classify":
        if pooler.num_labels != 1:
            raise ValueError(f"score needs an embedding model or a one-label classifier (this one has {pooler.num_labels})")
        pairs = [tokenizer(a, b)["input_ids"] for a, b in zip(first, second)]
        return ScorePlan(first, second, pairs, cross_encoder=True)
    return ScorePlan(first, second, list(dict.fromkeys(first + second)), cross_encoder=False)


def score_params(pooling_params: PoolingParams | None, truncate_prompt_tokens: int | None = None) -> PoolingParams:
    """A score's PoolingParams: task "score" (the model's own: cosine or its classifier)."""
    params = dataclasses.replace(pooling_params or PoolingParams(), task="score")
    if truncate_prompt_tokens is not None:
        params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
    return params

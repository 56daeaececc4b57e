"""vLLM's pooling endpoints: POST /v1/embeddings, /pooling, /classify, /score (/v1/score) and /rerank (/v1/rerank,
/v2/rerank).

Each input is one engine request with PoolingParams (queued all or none, aborted if the client leaves), as the
generation endpoints queue theirs; a server serves the endpoints of its model's task and refuses the others with a
400 saying what it serves (a generating model: completions and chat; an embedding model: embeddings, pooling,
score, rerank; a classifier: classify, pooling, and score and rerank with one label; a token classifier: pooling).
"""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.requests import Request

from jaxpaged.engine.async_engine import EngineDeadError
from jaxpaged.engine.pooling_score import score_params, score_plan
from jaxpaged.entrypoints.openai import errors
from jaxpaged.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from jaxpaged.entrypoints.openai.serving import Serving
from jaxpaged.outputs import PoolingRequestOutput
from jaxpaged.pooling_params import PoolingParams

GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
# the engine's and PoolingParams' words -> the request's fields
FIELDS = {name: name for name in ("dimensions", "normalize", "activation", "truncate_prompt_tokens", "messages",
                                  "priority", "task", "step_tag_id", "returned_token_ids")}


def served_endpoints(pooler) -> list[str]:
    if pooler is None:
        return list(GENERATION_ENDPOINTS)
    if pooler.task == "token_classify":
        return ["/pooling"]
    scores = ["/score", "/rerank"] if pooler.task == "embed" or pooler.num_labels == 1 else []
    return ["/v1/embeddings" if pooler.task == "embed" else "/classify", "/pooling", *scores]


def refuse_unless_served(serving: Serving, endpoint: str) -> None:
    """A 400 for an endpoint this model's task does not serve, saying which it does."""
    pooler = getattr(serving.engine.engine, "pooler", None)
    served = served_endpoints(pooler)
    if endpoint in served:
        return
    if pooler is None:
        what = "generates text (runner 'generate')"
    elif pooler.task == "embed":
        what = "is an embedding model (runner 'pooling')"
    else:
        kind = "token classifier" if pooler.task == "token_classify" else "classifier"
        what = f"is a {kind} with {pooler.num_labels} label(s) (runner 'pooling')"
    raise errors.bad_request(f"{endpoint} is not served: this model {what}, so this server serves {', '.join(served)}",
                             code="unsupported_endpoint")  # fmt: skip


def _params(body, fields: dict[str, str]) -> PoolingParams:
    try:
        return body.params()
    except ValueError as exc:
        raise errors.from_value_error(exc, fields) from None


async def _pool(serving: Serving, http_request: Request, prefix: str, prompts: list, params: PoolingParams,
                fields: dict[str, str], prompt_field: str, body) -> tuple[str, list[PoolingRequestOutput]]:  # fmt: skip
    """Queue the prompts (all or none, with the body's model and priority) and wait for every one's pooled output."""
    request_id, run = await serving.submit(http_request, prefix, prompts, params, {**fields, "prompt": prompt_field,
                                           "prompt_token_ids": prompt_field}, prompt_field, model=body.model,
                                           priority=body.priority)  # fmt: skip
    try:
        finals = await run.final()
    except EngineDeadError as exc:
        raise errors.engine_dead(str(exc)) from None
    if run.disconnected:
        raise _Gone
    if any(out is None or out.outputs is None for out in finals):  # aborted: the engine slept or new weights came
        raise errors.APIError(503, "the request was aborted before its prompts were pooled; retry", type="server_error",
                              code="aborted")  # fmt: skip
    return request_id, finals


class _Gone(Exception):
    """The client left: nobody reads the answer."""


def _meta(request_id: str, serving: Serving, model: str | None) -> dict:
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": serving.response_model(model)}


def _usage(outs) -> dict:
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _engine_prompt(serving: Serving, prompt: str | list[int], add_special_tokens: bool):
    """A text the engine tokenizes (with its special tokens), or token ids; add_special_tokens false: tokenized here."""
    if isinstance(prompt, str):
        if add_special_tokens:
            return prompt
        if serving.tokenizer is None:
            raise errors.bad_request("this model has no tokenizer; send token ids", param="input")
        return {"prompt_token_ids": list(serving.tokenizer.encode(prompt, add_special_tokens=False)), "prompt": prompt}
    return {"prompt_token_ids": prompt, "prompt": None}


def _prompts(serving: Serving, body) -> tuple[list, str]:
    """(engine prompts, the field they came from) of an embedding or /pooling body: its chat messages through the
    template, or each input."""
    if body.messages is not None:
        return [body.chat_prompt(serving.template_for(body.chat_template))], "messages"
    special = body.add_special_tokens is not False
    return [_engine_prompt(serving, p, special) for p in body.inputs()], "input"


async def create_embedding(serving: Serving, http_request: Request):
    refuse_unless_served(serving, "/v1/embeddings")
    body: EmbeddingRequest = await serving.parse(http_request, EmbeddingRequest)
    params = _params(body, FIELDS)
    prompts, field = _prompts(serving, body)
    request_id, outs = await _pool(serving, http_request, "embd", prompts, params, FIELDS, field, body)
    data = [{"index": i, "object": "embedding", "embedding": _encode(o.outputs.data, body.encoding_format)}
            for i, o in enumerate(outs)]  # fmt: skip
    return JSONResponse({**_meta(request_id, serving, body.model), "data": data, "usage": _usage(outs)})


def _encode(vector: np.ndarray, encoding_format: str):
    """float: a JSON list (of lists, for a token task's rows); base64: the little-endian float32 bytes, row after
    row (what the openai client asks for and decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(vector, dtype=np.float32).tolist()


async def create_pooling(serving: Serving, http_request: Request):
    """vLLM's /pooling: the task's raw output per input (a vector, or a row per prompt token for a token task)."""
    refuse_unless_served(serving, "/pooling")
    body: PoolingRequest = await serving.parse(http_request, PoolingRequest)
    try:
        params = body.params(serving.engine.engine.pooler.task)
    except ValueError as exc:
        raise errors.from_value_error(exc, FIELDS) from None
    prompts, field = _prompts(serving, body)
    request_id, outs = await _pool(serving, http_request, "pool", prompts, params, FIELDS, field, body)
    data = [{"index": i, "object": "pooling", "data": _encode(o.outputs.data, body.encoding_format)}
            for i, o in enumerate(outs)]  # fmt: skip
    return JSONResponse({**_meta(request_id, serving, body.model), "data": data, "usage": _usage(outs)})


async def create_classification(serving: Serving, http_request: Request):
    refuse_unless_served(serving, "/classify")
    body: ClassificationRequest = await serving.parse(http_request, ClassificationRequest)
    params = _params(body, FIELDS)
    special = body.add_special_tokens is not False
    prompts = [_engine_prompt(serving, p, special) for p in body.inputs()]
    request_id, outs = await _pool(serving, http_request, "classify", prompts, params, FIELDS, "input", body)
    id2label = getattr(serving.engine.engine.pooler, "id2label", None) or {}
    data = []
    for i, o in enumerate(outs):
        probs = np.asarray(o.outputs.data, dtype=np.float32)
        best = int(np.argmax(probs))
        data.append({"index": i, "label": id2label.get(best), "probs": probs.tolist(), "num_classes": len(probs)})
    return JSONResponse({**_meta(request_id, serving, body.model), "data": data, "usage": _usage(outs)})


async def _scores(serving: Serving, http_request: Request, prefix: str, body, first, second, field: str):
    """The shared plan (engine/pooling_score.py, as LLM.score) run through the async engine -> ScoringRequestOutputs."""
    pooler = serving.engine.engine.pooler
    try:
        plan = score_plan(pooler, serving.tokenizer, first, second)
        params = score_params(body.params())
    except ValueError as exc:
        raise errors.from_value_error(exc, FIELDS, default=field) from None
    prompts = [{"prompt_token_ids": p, "prompt": None} for p in plan.prompts] if plan.cross_encoder else plan.prompts
    request_id, outs = await _pool(serving, http_request, prefix, prompts, params, FIELDS, field, body)
    return request_id, plan.results(outs)


async def create_score(serving: Serving, http_request: Request):
    refuse_unless_served(serving, "/score")
    body: ScoreRequest = await serving.parse(http_request, ScoreRequest)
    request_id, results = await _scores(serving, http_request, "score", body, body.text_1, body.text_2, "text_2")
    data = [{"index": i, "object": "score", "score": r.outputs.score} for i, r in enumerate(results)]
    return JSONResponse({**_meta(request_id, serving, body.model), "data": data, "usage": _usage(results)})


async def create_rerank(serving: Serving, http_request: Request):
    refuse_unless_served(serving, "/rerank")
    body: RerankRequest = await serving.parse(http_request, RerankRequest)
    request_id, results = await _scores(serving, http_request, "rerank", body, body.query, body.documents, "documents")
    ranked = sorted(range(len(results)), key=lambda i: -results[i].outputs.score)[: body.top_n or None]
    ranked = [{"index": i, "document": {"text": body.documents[i]}, "relevance_score": results[i].outputs.score}
              for i in ranked]  # fmt: skip
    usage = {"total_tokens": _usage(results)["total_tokens"]}
    return JSONResponse({"id": request_id, "model": serving.response_model(body.model), "usage": usage, "results": ranked})


def add_routes(app: FastAPI, serving: Serving) -> None:
    async def answer(handler, *args):
        try:
            return await handler(serving, *args)
        except _Gone:
            return JSONResponse({}, status_code=499)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await answer(create_embedding, request)

    @app.post("/pooling")
    async def pool(request: Request):
        return await answer(create_pooling, request)

    @app.post("/classify")
    async def classify(request: Request):
        return await answer(create_classification, request)

    async def score(request: Request):
        return await answer(create_score, request)

    async def rerank(request: Request):
        return await answer(create_rerank, request)

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])

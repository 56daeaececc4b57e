"""The FastAPI app: routes, error handlers, middleware, and the engine's lifetime."""

from __future__ import annotations

import contextlib
import logging
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from jaxpaged import __version__
from jaxpaged.engine.async_engine import AsyncLLMEngine
from jaxpaged.entrypoints.openai import errors, pooling
from jaxpaged.entrypoints.openai.chat import create_chat_completion
from jaxpaged.entrypoints.openai.completions import create_completion
from jaxpaged.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from jaxpaged.entrypoints.openai.middleware import APIKeyMiddleware, BodyLimitMiddleware
from jaxpaged.entrypoints.openai.serving import ServerSettings, Serving

logger = logging.getLogger("jaxpaged.server")


def build_app(engine: AsyncLLMEngine, settings: ServerSettings) -> FastAPI:
    """An app serving `engine`; it starts the engine loop and shuts it down with the app."""
    metrics = ServerMetrics(engine)
    engine.stats_listener = metrics.observe
    serving = Serving(engine, settings)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="jaxpaged", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.metrics, app.state.settings = engine, metrics, settings

    @app.exception_handler(errors.APIError)
    async def _api_error(request: Request, exc: errors.APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return errors.APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # a bug: say so in OpenAI's shape, keep serving
        logger.exception("unexpected error on %s", request.url.path)
        return JSONResponse(errors.APIError(500, f"internal error: {exc!r}", type="server_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        if engine.errored:
            return errors.engine_dead(f"the engine loop has died: {engine.dead_error}").response()
        return JSONResponse({"status": "ok"})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():  # vLLM's (SageMaker's) liveness probe: /health under another name
        return await health()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "jaxpaged", "max_model_len": engine.max_model_len}

    def lora_card(name: str) -> dict:
        request = serving.loras.by_name[name]
        return {**model_card(name), "root": request.lora_path, "parent": serving.model_name}

    @app.get("/v1/models")
    async def list_models():
        cards = [model_card(name) for name in settings.served_model_names]
        return {"object": "list", "data": cards + [lora_card(name) for name in list(serving.loras.by_name)]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str):
        if name in serving.loras.by_name:
            return lora_card(name)
        if name not in settings.served_model_names:
            raise errors.model_not_found(name, serving.all_model_names)
        return model_card(name)

    if settings.allow_runtime_lora_updating:
        from jaxpaged.entrypoints.openai import lora

        lora.add_routes(app, serving.loras)

    if settings.allow_weight_updates:
        from jaxpaged.entrypoints.openai import rollout

        rollout.add_routes(app, engine)

    from jaxpaged.entrypoints.openai import dev

    dev.add_routes(app, engine, settings)  # /reset_prefix_cache (--enable-dev-endpoints), /start_profile, /stop_profile (--profiler-dir)

    from jaxpaged.entrypoints.openai import tokenize

    tokenize.add_routes(app, serving)  # vLLM's /tokenize and /detokenize
    pooling.add_routes(app, serving)  # vLLM's /v1/embeddings, /classify, /score, /rerank: a pooling model's

    from jaxpaged.entrypoints.openai import responses

    responses.add_routes(app, serving, pooling.refuse_unless_served)  # OpenAI's Responses API, run as chat turns
    from jaxpaged.entrypoints.openai import anthropic

    anthropic.add_routes(app, serving, pooling.refuse_unless_served)  # Anthropic's Messages API, run as chat turns

    @app.post("/v1/completions")
    async def completions(request: Request):
        pooling.refuse_unless_served(serving, "/v1/completions")
        return await create_completion(serving, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        pooling.refuse_unless_served(serving, "/v1/chat/completions")
        return await create_chat_completion(serving, request)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(BodyLimitMiddleware, limit=settings.max_request_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)  # added last: runs first
    return app

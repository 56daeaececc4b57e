"""vLLM's engine-control routes: POST /reset_prefix_cache (a development route in vLLM, VLLM_SERVER_DEV_MODE; here
with --enable-dev-endpoints) and POST /start_profile, /stop_profile (served only with --profiler-dir, as vLLM serves
them only with a profiler directory). Each runs on the engine thread between steps; errors are OpenAI-shaped."""

from __future__ import annotations

from starlette.requests import Request

from jaxpaged.engine.profiler import ProfilerError
from jaxpaged.entrypoints.openai import errors

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _flag(request: Request, name: str) -> bool:
    """A boolean query parameter (vLLM's ?reset_running_requests=true), False when absent."""
    raw = request.query_params.get(name)
    if raw is None or raw.lower() in _FALSE:
        return False
    if raw.lower() in _TRUE:
        return True
    raise errors.bad_request(f"{name} must be true or false (got {raw!r})", param=name)


def add_routes(app, engine, settings) -> None:
    if settings.enable_dev_endpoints:

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(request: Request):
            """200 {"reset": true} once every cached prefix is forgotten; 409 while requests hold KV blocks."""
            for name in ("reset_running_requests", "reset_external"):
                if _flag(request, name):
                    raise errors.bad_request(f"{name}=true is not supported: the cache is reset only when no request "
                                             "holds KV blocks", param=name)  # fmt: skip
            if not await engine.reset_prefix_cache():
                raise errors.APIError(409, "the prefix cache was not reset: requests in flight hold KV blocks; retry "
                                      "once they finish", type="conflict", code="kv_blocks_in_use")  # fmt: skip
            return {"reset": True}

    if engine.profiler_dir is not None:

        @app.post("/start_profile")
        async def start_profile(request: Request):
            prefix = request.query_params.get("profile_prefix")
            try:
                folder = await engine.start_profile(prefix)
            except ValueError as exc:
                raise errors.bad_request(str(exc), param="profile_prefix") from None
            except ProfilerError as exc:
                raise errors.APIError(409, str(exc), type="conflict", code="profile_running") from None
            return {"status": "ok", "profiler_dir": folder}

        @app.post("/stop_profile")
        async def stop_profile():
            try:
                folder = await engine.stop_profile()
            except ProfilerError as exc:
                raise errors.APIError(409, str(exc), type="conflict", code="no_profile_running") from None
            return {"status": "ok", "trace_dir": folder}

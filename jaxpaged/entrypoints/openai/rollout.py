"""A trainer's rollout routes on the server (--allow-weight-updates), after vLLM's sleep-mode and weight-update
endpoints: POST /update_weights (a folder of safetensors the server can read), POST /sleep, POST /wake_up,
GET /is_sleeping. Bad input is a 400 naming the field, in OpenAI's error shape; while asleep the completion routes
answer 503 (code "engine_asleep") unless the engine was put to sleep with queue_requests."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request

from jaxpaged.engine.weight_sync import EngineAsleepError
from jaxpaged.entrypoints.openai import errors


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class UpdateWeightsRequest(_Body):
    path: str  # a folder of safetensors (or one file) on the server's file system
    in_flight: Literal["finish", "abort"] = "finish"


class SleepRequest(_Body):
    level: Literal[1, 2] = 1
    in_flight: Literal["finish", "abort"] = "finish"
    queue_requests: bool = False


class WakeUpRequest(_Body):
    tags: list[Literal["weights", "kv_cache"]] | None = None


async def _parse(request: Request, model: type[BaseModel]) -> BaseModel:
    raw = await request.body()
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        raise errors.from_validation_error(exc) from None


def _summary(result: dict) -> dict:
    """The engine's report without the outputs it settled (their requests' streams got them)."""
    return {k: v for k, v in result.items() if k not in ("outputs", "replicas")} | {
        "requests_settled": len(result.get("outputs", []))}


def add_routes(app, engine) -> None:
    @app.post("/update_weights")
    async def update_weights(request: Request):
        body = await _parse(request, UpdateWeightsRequest)
        try:
            result = await engine.update_weights(body.path, in_flight=body.in_flight)
        except ValueError as exc:
            raise errors.bad_request(str(exc), param="path") from None
        except EngineAsleepError as exc:
            raise errors.bad_request(str(exc), param="path", code="engine_asleep") from None
        return {"status": "ok", **_summary(result)}

    @app.post("/sleep")
    async def sleep(request: Request):
        body = await _parse(request, SleepRequest)
        result = await engine.sleep(body.level, in_flight=body.in_flight, queue_requests=body.queue_requests)
        return {"status": "ok", **_summary(result)}

    @app.post("/wake_up")
    async def wake_up(request: Request):
        body = await _parse(request, WakeUpRequest)
        result = await engine.wake_up(body.tags)
        return {"status": "ok", **_summary(result)}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": engine.is_sleeping}

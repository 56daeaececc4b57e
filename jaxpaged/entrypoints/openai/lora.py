"""LoRA adapters on the server, as vLLM's: `--lora-modules name=path` at start, `model: <adapter name>` selecting one,
and behind --allow-runtime-lora-updating POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from jaxpaged.entrypoints.openai import errors
from jaxpaged.lora import LoRARequest

logger = logging.getLogger("jaxpaged.server")


def parse_lora_modules(specs: list[str] | None) -> list[tuple[str, str]]:
    """--lora-modules' `name=path` items -> (name, path); a ValueError naming the flag for a malformed one."""
    modules = []
    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path items (got {spec!r})")
        modules.append((name, path))
    return modules


class ServedLoRAs:
    """The adapters the server knows by name; each gets its own engine id (1, 2, ...)."""

    def __init__(self, engine, base_names: list[str]):
        self.engine = engine  # the AsyncLLMEngine
        self.base_names = base_names
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, name: str, path: str) -> LoRARequest:
        """Load (and check) the adapter now: ValueError for a bad one or a name already in use."""
        with self._lock:
            if name in self.by_name or name in self.base_names:
                raise ValueError(f"lora_name {name!r} is already in use")
            request = LoRARequest(name, next(self._ids), path)
        self.engine.engine.add_lora(request)
        with self._lock:
            self.by_name[name] = request
        logger.info("serving LoRA adapter %r from %s", name, path)
        return request

    def remove(self, name: str) -> bool:
        with self._lock:
            request = self.by_name.pop(name, None)
        if request is None:
            return False
        self.engine.engine.remove_lora(request.lora_int_id)
        logger.info("LoRA adapter %r unloaded", name)
        return True


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str


async def _parse(request: Request, model: type[BaseModel]) -> BaseModel:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise errors.from_validation_error(exc) from None


def add_routes(app, loras: ServedLoRAs) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await _parse(request, LoadLoRAAdapterRequest)
        try:
            await asyncio.to_thread(loras.add, body.lora_name, body.lora_path)
        except ValueError as exc:
            param = "lora_name" if "lora_name" in str(exc) else "lora_path"
            raise errors.bad_request(str(exc), param=param) from None
        return {"status": "ok", "message": f"LoRA adapter {body.lora_name!r} loaded"}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await _parse(request, UnloadLoRAAdapterRequest)
        if not loras.remove(body.lora_name):
            raise errors.APIError(404, f"no LoRA adapter named {body.lora_name!r} is loaded", type="not_found",
                                  param="lora_name", code="lora_not_found")  # fmt: skip
        return {"status": "ok", "message": f"LoRA adapter {body.lora_name!r} unloaded"}

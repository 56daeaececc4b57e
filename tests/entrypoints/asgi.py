"""An engine's app served in-process (no server process start): the openai or anthropic client on an ASGI transport."""

from __future__ import annotations

import asyncio

import httpx

ENGINE = {"max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 8, "num_kv_blocks": 256,
          "dtype": "float32", "precompile": False}  # fmt: skip
MODEL = "m"


def app_for(folder, api_key: str | None = None):
    """(app, async engine) serving the model in `folder` as MODEL; the engine loop started."""
    from jaxpaged import LLM
    from jaxpaged.engine.async_engine import AsyncLLMEngine
    from jaxpaged.entrypoints.openai import ServerSettings, build_app

    engine = AsyncLLMEngine(LLM(str(folder), log_level="WARNING", **ENGINE).engine)
    engine.start()
    return build_app(engine, ServerSettings([MODEL], api_key=api_key)), engine


def run(app, work, base_url: str = "http://t/v1"):
    """await work(http) against `app`, `http` an httpx.AsyncClient on it (hand it to a client as http_client)."""

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url, timeout=120) as http:
            return await work(http)

    return asyncio.run(main())

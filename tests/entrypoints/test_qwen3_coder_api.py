"""tool_choice "auto" with Qwen3-Coder's XML calls, end to end through the openai client (in-process, over an ASGI
transport): the XML tool model (tests/xml_tool_model.py) answers with text and a `<tool_call>`; the server found
the qwen3_coder parser in its chat template, types the arguments by the tool's schema, and a stream's pieces join
into the unstreamed call.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.xml_tool_model import CALLS, CONTENT, write_xml_tool_model

ENGINE = {"max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 8, "num_kv_blocks": 256,
          "dtype": "float32", "precompile": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]  # fmt: skip
ASK = {"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS, "temperature": 0,
       "max_tokens": 40}  # fmt: skip


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from jaxpaged import LLM
    from jaxpaged.engine.async_engine import AsyncLLMEngine
    from jaxpaged.entrypoints.openai import ServerSettings, build_app

    folder = write_xml_tool_model(tmp_path_factory.mktemp("xml-tools"))
    engine = AsyncLLMEngine(LLM(str(folder), log_level="WARNING", **ENGINE).engine)
    engine.start()
    yield build_app(engine, ServerSettings(["m"]))
    engine.shutdown()


def _run(app, work):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/v1", timeout=120) as http:
            return await work(openai.AsyncOpenAI(base_url="http://t/v1", api_key="unused", http_client=http, max_retries=0))

    return asyncio.run(main())


def test_calls_come_back_typed_whole_and_streamed(app):
    r = _run(app, lambda c: c.chat.completions.create(**ASK))
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == CONTENT
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == CALLS
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo", "days": 3}

    async def stream(client):
        return [chunk async for chunk in await client.chat.completions.create(**ASK, stream=True)]

    chunks = _run(app, stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == CONTENT  # no piece of a tag leaks into the content
    pieces = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "weather"
    assert "".join(p.function.arguments or "" for p in pieces) == CALLS[0][1]
    assert len(pieces) >= 4  # the opening, "{", each parameter as it closed, "}"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

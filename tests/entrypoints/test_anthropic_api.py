"""POST /v1/messages with the anthropic client (in-process, through an ASGI transport): the think model
(tests/reasoning_model.py, the qwen3 reasoning parser) answers with a thinking block and a text block; the tool
model (tests/tool_model.py, Hermes) with tool_use blocks; a stream's events build the same message (the client's
own accumulator reads them); tool results go back; stop sequences and max_tokens set the stop reason; count_tokens
counts what /v1/messages would send; errors come back in Anthropic's shape, x-api-key accepted.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest

from tests.entrypoints.asgi import MODEL, app_for, run
from tests.reasoning_model import CONTENT, REASONING, write_think_model
from tests.tool_model import CALLS, write_tool_model

USER = [{"role": "user", "content": "2 + 2?"}]
KEY = "sk-test"
GREEDY = {"temperature": 0}  # (the anthropic client no longer takes temperature: vLLM's extra, in the body)


@pytest.fixture(scope="module")
def think(tmp_path_factory):
    app, engine = app_for(write_think_model(tmp_path_factory.mktemp("think")))
    yield app
    engine.shutdown()


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    app, engine = app_for(write_tool_model(tmp_path_factory.mktemp("tools")), api_key=KEY)
    yield app, engine
    engine.shutdown()


def _run(app, work):
    """work(client, None) against `app`, the anthropic client on an ASGI transport of its own HTTP package (httpx2
    since anthropic 2.x; httpx before)."""
    base = anthropic._base_client
    http = getattr(base, "httpx2", None) or base.httpx  # the package the client checks http_client against

    async def main():
        async with http.AsyncClient(transport=http.ASGITransport(app=app), base_url="http://t", timeout=120) as transport:
            client = anthropic.AsyncAnthropic(base_url="http://t", api_key=KEY, http_client=transport, max_retries=0)
            return await work(client, None)

    return asyncio.run(main())


def test_thinking_and_text_blocks(think):
    m = _run(think, lambda c, _: c.messages.create(model=MODEL, messages=USER, max_tokens=40, extra_body=GREEDY))
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    thinking, text = m.content
    assert (thinking.type, thinking.thinking) == ("thinking", REASONING)
    assert (text.type, text.text) == ("text", CONTENT)
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.output_tokens > 0 and m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


def test_a_stream_builds_the_same_message(think):
    async def work(client, _):
        async with client.messages.stream(model=MODEL, messages=USER, max_tokens=40, extra_body=GREEDY) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_message()
        plain = await client.messages.create(model=MODEL, messages=USER, max_tokens=40, extra_body=GREEDY)
        return events, final, plain

    events, final, plain = _run(think, work)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == plain.usage.output_tokens


def test_system_thinking_history_and_template_kwargs(think):
    history = [*USER, {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                                        {"type": "text", "text": "4"}]},
               {"role": "user", "content": [{"type": "text", "text": "And 3 + 3?"}]}]  # fmt: skip

    async def work(client, _):
        long = await client.messages.create(model=MODEL, messages=history, max_tokens=40, extra_body=GREEDY, system="Be brief.")
        short = await client.messages.create(model=MODEL, messages=USER, max_tokens=40,
                                             extra_body={"temperature": 0, "chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
        counted = await client.messages.count_tokens(model=MODEL, messages=history, system="Be brief.")
        return long, short, counted

    long, short, counted = _run(think, work)
    assert long.usage.input_tokens + long.usage.cache_read_input_tokens == counted.input_tokens
    assert [b.type for b in short.content] == ["text"]  # the template closed the thinking


def test_max_tokens_and_stop_sequences(think):
    async def work(client, _):
        cut = await client.messages.create(model=MODEL, messages=USER, max_tokens=2, extra_body=GREEDY)
        stopped = await client.messages.create(model=MODEL, messages=USER, max_tokens=40, extra_body=GREEDY,
                                               stop_sequences=["answer"])  # fmt: skip
        return cut, stopped

    cut, stopped = _run(think, work)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "answer")


def test_tool_use_blocks_and_results_go_back(tools):
    app, _ = tools
    defs = [{"name": "weather", "description": "forecast", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
            {"name": "now", "input_schema": {"type": "object", "properties": {}}}]  # fmt: skip
    ask = [{"role": "user", "content": "Weather in Oslo?"}]

    async def work(client, _):
        m = await client.messages.create(model=MODEL, messages=ask, tools=defs, max_tokens=60, extra_body=GREEDY)
        one = await client.messages.create(model=MODEL, messages=ask, tools=defs, max_tokens=60, extra_body=GREEDY,
                                           tool_choice={"type": "auto", "disable_parallel_tool_use": True})  # fmt: skip
        async with client.messages.stream(model=MODEL, messages=ask, tools=defs, max_tokens=60, extra_body=GREEDY) as s:
            events = [e async for e in s]
            streamed = await s.get_final_message()
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": "sunny"} for b in m.content if b.type == "tool_use"]
        after = await client.messages.create(model=MODEL, tools=defs, max_tokens=60, extra_body=GREEDY,
                                             messages=[*ask, {"role": "assistant", "content": m.content}, {"role": "user", "content": results}])  # fmt: skip
        return m, one, events, streamed, after

    m, one, events, streamed, after = _run(app, work)
    text, *uses = m.content
    assert text.text == "Let me check." and m.stop_reason == "tool_use"
    assert [(u.type, u.name, u.input) for u in uses] == [("tool_use", n, json.loads(a)) for n, a in CALLS]
    assert all(u.id.startswith("toolu_") for u in uses)
    assert [b.name for b in one.content if b.type == "tool_use"] == ["weather"]
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta" and e.index == 1]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == json.loads(CALLS[0][1])
    assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == [(b.type, getattr(b, "input", None)) for b in m.content]
    total = lambda u: u.input_tokens + u.cache_read_input_tokens  # noqa: E731 (input_tokens leaves out cache hits)
    assert total(after.usage) > total(m.usage) and after.usage.cache_read_input_tokens > 0  # the turn's prefix was cached


def test_output_config_format_constrains_the_answer(tools):
    app, _ = tools
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}

    async def work(client, _):
        return await client.messages.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                            max_tokens=30, extra_body=GREEDY,
                                            output_config={"format": {"type": "json_schema", "schema": schema}})  # fmt: skip

    (text,) = _run(app, work).content
    assert json.loads(text.text) in ({"ok": True}, {"ok": False})


@pytest.mark.parametrize("body, fragment", [
    ({"messages": USER}, "max_tokens"),
    ({"messages": [], "max_tokens": 5}, "messages"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "w"}]}, "tools.0.type"),
    ({"messages": USER, "max_tokens": 5, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}], "max_tokens": 5}, "messages.0.content.0.type"),
    ({"messages": USER, "max_tokens": 5, "model": "claude-x"}, "claude-x"),
    ({"messages": USER, "max_tokens": 5, "output_config": {"format": {"type": "yaml"}}}, "output_config.format"),
    ({"messages": USER, "max_tokens": 5, "output_config": {"effort": "extreme"}}, "output_config.effort"),
])  # fmt: skip
def test_errors_in_anthropic_shape(tools, body, fragment):
    app, engine = tools

    async def work(http):
        bad = await http.post("/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": KEY})
        denied = await http.post("/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": "wrong"})
        return bad, denied

    bad, denied = run(app, work, base_url="http://t")
    assert bad.status_code in (400, 404), bad.text
    err = bad.json()
    assert err["type"] == "error" and err["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert fragment in err["error"]["message"], err
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert engine.engine.scheduler.kv.pool.num_used == 0


def test_thinking_budget_tokens_close_the_thinking(think):
    """thinking.budget_tokens is enforced (the end marker forced after 1 thinking token), as chat completions'
    thinking_token_budget, which it becomes; a bad budget is a 400 naming it."""
    from tests.entrypoints.asgi import run
    from tests.reasoning_model import ANSWER

    budget = {"type": "enabled", "budget_tokens": 1}
    m = _run(think, lambda c, _: c.messages.create(model=MODEL, messages=USER, max_tokens=40, thinking=budget, extra_body=GREEDY))
    thinking, text = m.content
    assert (thinking.thinking, text.text) == ("Let me think.", "\n\n" + ANSWER)

    async def chat(http):
        body = {"model": MODEL, "messages": USER, "max_tokens": 40, "temperature": 0}
        ok = (await http.post("/chat/completions", json=body | {"thinking_token_budget": 1})).json()
        bad = await http.post("/chat/completions", json=body | {"thinking_token_budget": -2})
        return ok["choices"][0]["message"], bad.status_code, bad.json()

    message, status, error = run(think, chat)
    assert (message["reasoning_content"], message["content"]) == ("Let me think.", "\n\n" + ANSWER)
    assert status == 400 and "thinking_token_budget" in error["error"]["message"]

    async def bad_messages(client, _):
        with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
            await client.messages.create(model=MODEL, messages=USER, max_tokens=40, thinking={"type": "enabled", "budget_tokens": -1})

    _run(think, bad_messages)

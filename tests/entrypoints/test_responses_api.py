"""POST /v1/responses with the openai client (in-process, through an ASGI transport): the think model
(tests/reasoning_model.py, Qwen3-shaped template, so the qwen3 reasoning parser) answers with a reasoning item
and a message; the tool model (tests/tool_model.py, Hermes) with function_call items; a stream's events build
the same response (the client's own accumulator checks their order); previous_response_id carries the
conversation on; stored responses are read back and deleted; bad fields are 400s named as the Responses API
names them.
"""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest

from tests.entrypoints.asgi import MODEL
from tests.entrypoints.asgi import app_for as _app
from tests.entrypoints.asgi import run
from tests.reasoning_model import CONTENT, REASONING, write_think_model
from tests.tool_model import CALLS, write_tool_model


@pytest.fixture(scope="module")
def think(tmp_path_factory):
    app, engine = _app(write_think_model(tmp_path_factory.mktemp("think")))
    yield app
    engine.shutdown()


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    app, engine = _app(write_tool_model(tmp_path_factory.mktemp("tools")))
    yield app, engine
    engine.shutdown()


def _run(app, work):
    """work(client, http) -> awaitable, run against `app` with the openai client and raw httpx."""

    async def main(http):
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="unused", http_client=http, max_retries=0)
        return await work(client, http)

    return run(app, main)


def test_reasoning_and_answer_as_items(think):
    r = _run(think, lambda c, _: c.responses.create(model=MODEL, input="2 + 2?", temperature=0, max_output_tokens=40))
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING and reasoning.summary == []
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert r.output_text == CONTENT and message.content[0].annotations == []
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.temperature == 0 and r.model == MODEL and r.store is True


def test_a_stream_builds_the_same_response(think):
    async def work(client, _):
        events = []
        async with client.responses.stream(model=MODEL, input="2 + 2?", temperature=0, max_output_tokens=40) as stream:
            async for e in stream:
                events.append(e)
            final = await stream.get_final_response()
        return events, final

    events, final = _run(think, work)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == CONTENT
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    assert final.output_text == CONTENT and final.output[0].content[0].text == REASONING


def test_instructions_and_thinking_off_reach_the_template(think):
    async def work(client, _):
        return await client.responses.create(model=MODEL, input=[{"role": "user", "content": "2 + 2?"}], temperature=0,
                                             instructions="Be brief.", extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                                             max_output_tokens=40)  # fmt: skip

    r = _run(think, work)
    assert [item.type for item in r.output] == ["message"]  # the template closed the thinking: an answer at once
    assert r.instructions == "Be brief." and r.usage.output_tokens_details.reasoning_tokens == 0


def test_max_output_tokens_makes_it_incomplete(think):
    async def work(client, _):
        plain = await client.responses.create(model=MODEL, input="2 + 2?", temperature=0, max_output_tokens=2)
        events = [e async for e in await client.responses.create(model=MODEL, input="2 + 2?", temperature=0,
                                                                  max_output_tokens=2, stream=True)]  # fmt: skip
        return plain, events

    plain, events = _run(think, work)
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    assert plain.output[-1].status == "incomplete" and plain.usage.output_tokens == 2
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_previous_response_id_continues_and_store_reads_back(think):
    async def work(client, http):
        first = await client.responses.create(model=MODEL, input="2 + 2?", temperature=0, max_output_tokens=40)
        second = await client.responses.create(model=MODEL, input="And 3 + 3?", previous_response_id=first.id,
                                               temperature=0, max_output_tokens=40)  # fmt: skip
        alone = await client.responses.create(model=MODEL, input="And 3 + 3?", temperature=0, max_output_tokens=40)
        got = await client.responses.retrieve(first.id)
        deleted = await client.responses.delete(first.id)
        gone = await http.get(f"/responses/{first.id}")
        unknown = await http.post("/responses", json={"model": MODEL, "input": "x", "previous_response_id": first.id})
        unstored = await client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
        missing = await http.get(f"/responses/{unstored.id}")
        return first, second, alone, got, deleted, gone, unknown, missing

    first, second, alone, got, deleted, gone, unknown, missing = _run(think, work)
    # the first turn (its question, reasoning and answer) is in the second's prompt: more tokens than asking alone
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.input_tokens - 5
    assert second.previous_response_id == first.id
    assert got.id == first.id and got.output_text == first.output_text
    assert deleted is None or getattr(deleted, "deleted", True)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "previous_response_id"
    assert missing.status_code == 404


def test_background_responses_run_on_and_can_be_cancelled(think):
    async def work(client, http):
        foreground = await client.responses.create(model=MODEL, input="2 + 2?", temperature=0, max_output_tokens=40)
        queued = await client.responses.create(model=MODEL, input="2 + 2?", temperature=0, max_output_tokens=40,
                                               background=True)  # fmt: skip
        done = queued
        while done.status in ("queued", "in_progress"):
            await asyncio.sleep(0.05)
            done = await client.responses.retrieve(queued.id)
        # a long one (EOS ignored, to the context's end), cancelled while it runs
        long = await client.responses.create(model=MODEL, input="2 + 2?", max_output_tokens=480, background=True,
                                             extra_body={"ignore_eos": True})  # fmt: skip
        running = await client.responses.retrieve(long.id)
        cancelled = await client.responses.cancel(long.id)
        follow = await http.post("/responses", json={"model": MODEL, "input": "x", "previous_response_id": long.id})
        again = await client.responses.cancel(queued.id)  # finished: comes back as it is
        return foreground, queued, done, running, cancelled, follow, again

    foreground, queued, done, running, cancelled, follow, again = _run(think, work)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    assert done.status == "completed" and done.output_text == foreground.output_text == CONTENT
    assert done.usage.output_tokens == foreground.usage.output_tokens
    assert running.status in ("queued", "in_progress") and cancelled.status == "cancelled"
    assert follow.status_code == 400 and follow.json()["error"]["param"] == "previous_response_id"
    assert again.status == "completed" and again.id == queued.id
    pool = think.state.engine.engine.scheduler.kv.pool
    for _ in range(100):  # the abort reaches the engine thread within a step or two
        if pool.num_used == 0:
            break
        time.sleep(0.05)
    assert pool.num_used == 0  # the cancelled run's KV blocks came back


def test_function_calls_as_items_and_their_outputs_go_back(tools):
    app, _ = tools
    tool_defs = [{"type": "function", "name": "weather", "description": "forecast",
                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
                 {"type": "function", "name": "now", "parameters": {"type": "object", "properties": {}}}]  # fmt: skip

    async def work(client, _):
        r = await client.responses.create(model=MODEL, input="Weather in Oslo?", tools=tool_defs, temperature=0,
                                          max_output_tokens=60)  # fmt: skip
        one = await client.responses.create(model=MODEL, input="Weather in Oslo?", tools=tool_defs, temperature=0,
                                            max_output_tokens=60, parallel_tool_calls=False)  # fmt: skip
        events = [e async for e in await client.responses.create(model=MODEL, input="Weather in Oslo?", tools=tool_defs,
                                                                  temperature=0, max_output_tokens=60, stream=True)]  # fmt: skip
        calls = [item for item in r.output if item.type == "function_call"]
        follow = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]
        after = await client.responses.create(model=MODEL, input=follow, previous_response_id=r.id, tools=tool_defs,
                                              temperature=0, max_output_tokens=60)  # fmt: skip
        return r, one, events, after

    r, one, events, after = _run(app, work)
    message, *calls = r.output
    assert message.type == "message" and r.output_text == "Let me check."
    assert [(c.type, c.name, c.arguments) for c in calls] == [("function_call", n, a) for n, a in CALLS]
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed" for c in calls)
    assert [c.name for c in one.output if c.type == "function_call"] == ["weather"]
    streamed = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in streamed] == list(CALLS)
    weather_pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.output_index == 1]
    assert len(weather_pieces) > 1 and "".join(weather_pieces) == CALLS[0][1]  # the arguments arrive in pieces
    assert events[-1].response.output[1].arguments == CALLS[0][1]
    assert after.status == "completed" and after.usage.input_tokens > r.usage.input_tokens


def test_a_json_schema_text_format_constrains_the_answer(tools):
    app, _ = tools
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}

    async def work(client, _):
        return await client.responses.create(model=MODEL, input="Weather in Oslo?", temperature=0, max_output_tokens=30,
                                             text={"format": {"type": "json_schema", "name": "r", "schema": schema}})  # fmt: skip

    r = _run(app, work)
    assert json.loads(r.output_text) in ({"ok": True}, {"ok": False})
    assert r.text.format.type == "json_schema"


def test_logprobs_when_included(tools):
    app, _ = tools

    async def work(client, _):
        return await client.responses.create(model=MODEL, input="Weather in Oslo?", temperature=0, max_output_tokens=3,
                                             include=["message.output_text.logprobs"], top_logprobs=2)  # fmt: skip

    r = _run(app, work)
    (part,) = r.output[0].content
    assert len(part.logprobs) == r.usage.output_tokens == 3
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "r", "schema": 3}}}, "text.format.schema"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "background": True, "stream": True}, "background"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "model": "other"}, "model"),
])  # fmt: skip
def test_bad_fields_are_named(tools, body, param):
    app, engine = tools

    async def work(_, http):
        return await http.post("/responses", json=body)

    r = _run(app, work)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert engine.engine.scheduler.kv.pool.num_used == 0  # nothing was queued, nothing held


def test_gpt_oss_harmony_reasoning_and_calls(tmp_path):
    """The gpt_oss parsers (detected from a harmony template): the analysis channel as the reasoning item, a
    commentary message `to=functions.add` as a function_call item, whole and streamed alike."""
    from tests.entrypoints.test_reasoning_api import _needs_harmony
    from tests.reasoning_model import HARMONY_CALL, HARMONY_REASONING, write_harmony_model

    _needs_harmony()
    app, engine = _app(write_harmony_model(tmp_path / "model", tools=True))
    add = [{"type": "function", "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}]

    async def work(client, _):
        plain = await client.responses.create(model=MODEL, input="2 + 2?", tools=add, temperature=0, max_output_tokens=60)
        events = [e async for e in await client.responses.create(model=MODEL, input="2 + 2?", tools=add, temperature=0,
                                                                  max_output_tokens=60, stream=True)]  # fmt: skip
        return plain, events

    try:
        plain, events = _run(app, work)
    finally:
        engine.shutdown()
    for r in (plain, events[-1].response):
        reasoning, call = r.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == HARMONY_REASONING
        assert (call.type, call.name, call.arguments) == ("function_call", *HARMONY_CALL)
        assert r.status == "completed" and r.output_text == ""

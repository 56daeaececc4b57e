"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), GET and DELETE /v1/responses/{id}.

A response runs as a chat completion (responses_protocol.py reads the request into one; chat.prepare makes the
sampling params and prompt); its output is the chat message cut into items: a reasoning item (the reasoning
parser's reasoning_content), a message with one output_text part, and a function_call item per tool call. A
stream sends the same items as OpenAI's events (`response.created` ... `response.completed`), built by the same
OutputItems from chat's message deltas, so a stream and a plain response agree. Stored responses (`store`, the
default) are kept in memory, the most recent `max_stored_responses`, for GET and `previous_response_id`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.requests import Request

from jaxpaged.engine.async_engine import EngineDeadError
from jaxpaged.entrypoints.openai import errors
from jaxpaged.entrypoints.openai.chat_turn import chat_request, final_message, message_deltas, submit
from jaxpaged.entrypoints.openai.logprobs import chat_logprobs
from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest
from jaxpaged.entrypoints.openai.responses_protocol import ResponsesRequest, renamed
from jaxpaged.entrypoints.openai.serving import Serving
from jaxpaged.entrypoints.openai.streaming import RequestRun

MAX_STORED_RESPONSES = 1024


@dataclasses.dataclass
class StoredResponse:
    body: dict  # the response object as it was returned
    conversation: list[dict]  # the chat messages of the turns so far (no instructions), this response's included
    pending: bool = False  # a background response still being made: not yet a conversation to continue


class ResponseStore:
    """The stored responses, the oldest dropped past `capacity` (memory stays bounded; OpenAI keeps them 30 days)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES):
        self.capacity = capacity
        self._by_id: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self._by_id[stored.body["id"]] = stored
        self._by_id.move_to_end(stored.body["id"])
        while len(self._by_id) > self.capacity:
            self._by_id.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        stored = self._by_id.get(response_id)
        if stored is None:
            raise errors.APIError(404, f"Response with id {response_id!r} not found", param=param, code="response_not_found")
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._by_id[response_id]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """A response's output items built from chat's message deltas, with the stream events that build them:
    a delta of another kind than the open item's closes it (its `.done` events) and opens the next."""

    def __init__(self, logprobs: bool, max_calls: int | None):
        self.items: list[dict] = []
        self.logprobs = logprobs
        self.max_calls = max_calls
        self._open: dict | None = None
        self._calls = 0

    def feed(self, delta: dict, logprobs: list[dict] | None = None) -> list[dict]:
        """The events of one delta ({"reasoning_content"}, {"content"} or {"tool_calls"}); `logprobs` those of the
        tokens behind it (an output_text delta carries them)."""
        events: list[dict] = []
        if "reasoning_content" in delta and delta["reasoning_content"]:
            events += self._ensure("reasoning")
            item = self._open
            item["content"][0]["text"] += delta["reasoning_content"]
            events.append({"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": len(self.items) - 1,
                           "content_index": 0, "delta": delta["reasoning_content"]})  # fmt: skip
        if "content" in delta and delta["content"]:
            events += self._ensure("message")
            part = self._open["content"][0]
            part["text"] += delta["content"]
            if self.logprobs:
                part["logprobs"] += logprobs or []
            events.append({"type": "response.output_text.delta", "item_id": self._open["id"], "output_index": len(self.items) - 1,
                           "content_index": 0, "delta": delta["content"], "logprobs": logprobs or []})  # fmt: skip
        for call in delta.get("tool_calls") or ():
            if "id" in call:  # a new call: its id and name
                events += self._close()
                if self.max_calls is not None and self._calls >= self.max_calls:
                    continue  # parallel_tool_calls false: the first call only
                self._calls += 1
                fn = call["function"]
                item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                        "name": fn["name"], "arguments": ""}  # fmt: skip
                events += self._add(item)
                call = {"function": {"arguments": fn.get("arguments", "")}}
            pieces = call.get("function", {}).get("arguments")
            item = self._open
            if pieces and item is not None and item["type"] == "function_call":
                item["arguments"] += pieces
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": len(self.items) - 1, "delta": pieces})  # fmt: skip
        return events

    def finish(self, status: str) -> list[dict]:
        """Close the open item (`status` completed or incomplete); an answer with no item gets an empty message."""
        events = [] if self.items else self._ensure("message")
        return events + self._close(status)

    def _ensure(self, kind: str) -> list[dict]:
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self._close()
        if kind == "reasoning":
            item = {"id": _item_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip
        else:
            part = {"type": "output_text", "text": "", "annotations": [], **({"logprobs": []} if self.logprobs else {})}
            item = {"id": _item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": [part]}
        events += self._add(item)
        added = {**item["content"][0], "text": ""}
        events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": len(self.items) - 1,
                       "content_index": 0, "part": added})  # fmt: skip
        return events

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self._open = item
        shown = {**item, "content": []} if "content" in item else dict(item)
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": shown}]

    def _close(self, status: str = "completed") -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        at = {"item_id": item["id"], "output_index": len(self.items) - 1}
        item["status"] = status
        events = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append({"type": "response.reasoning_text.done", **at, "content_index": 0, "text": text})
            events.append({"type": "response.content_part.done", **at, "content_index": 0, "part": item["content"][0]})
        elif item["type"] == "message":
            part = item["content"][0]
            events.append({"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"],
                           "logprobs": part.get("logprobs") or []})  # fmt: skip
            events.append({"type": "response.content_part.done", **at, "content_index": 0, "part": part})
        else:
            events.append({"type": "response.function_call_arguments.done", **at, "name": item["name"],
                           "arguments": item["arguments"]})  # fmt: skip
        events.append({"type": "response.output_item.done", "output_index": at["output_index"], "item": item})
        return events

    def message(self) -> dict:
        """The assistant turn these items make, as a chat message (for previous_response_id)."""
        message: dict = {"role": "assistant", "content": None}
        for item in self.items:
            if item["type"] == "reasoning":
                message["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                message["content"] = (message["content"] or "") + item["content"][0]["text"]
            else:
                call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
                message.setdefault("tool_calls", []).append(call)
        if message["content"] is None and not message.get("tool_calls"):
            message["content"] = ""
        return message


@dataclasses.dataclass
class _Turn:
    """One response being made: the request, its chat form, and what the response object echoes."""

    request: ResponsesRequest
    chat: ChatCompletionRequest
    conversation: list[dict]  # history + this input's messages (no instructions)
    meta: dict

    def response(self, status: str, output: list[dict], usage: dict | None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {**self.meta, "status": status, "output": output, "usage": usage, "incomplete_details": incomplete,
                "completed_at": int(time.time()) if status in ("completed", "incomplete") else None}  # fmt: skip


class _Detached:
    """A background response's stand-in for its HTTP request: the client leaves with the queued answer, the run
    goes on (RequestRun aborts a run whose client disconnects)."""

    async def receive(self):
        await asyncio.Event().wait()


class ResponsesServing:
    def __init__(self, serving: Serving, max_stored: int = MAX_STORED_RESPONSES):
        self.serving = serving
        self.store = ResponseStore(max_stored)
        self._running: dict[str, tuple[asyncio.Task, RequestRun]] = {}  # background responses being made

    async def _turn(self, http_request: Request) -> _Turn:
        raw_bytes = await http_request.body()
        try:
            request = ResponsesRequest.model_validate_json(raw_bytes)
        except ValidationError as exc:
            raise errors.from_validation_error(exc) from None
        serving = self.serving
        if request.model is not None and request.model not in serving.all_model_names:
            raise errors.model_not_found(request.model, serving.all_model_names)
        history = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id, param="previous_response_id")
            if previous.pending or previous.body["status"] in ("cancelled", "failed"):
                raise errors.bad_request(f"previous_response_id: response {request.previous_response_id!r} is "
                                         f"{previous.body['status']}, not a finished turn", param="previous_response_id")
            history = previous.conversation
        chat_json = {}

        def build() -> dict:
            chat_json.update(request.chat_body(history, json.loads(raw_bytes)), model=request.model or serving.model_name)
            return chat_json

        chat = chat_request(build, renamed)
        conversation = chat_json["messages"][1 if request.instructions else 0 :]  # as sent (chat parses call arguments)
        meta = {
            "id": _item_id("resp"), "object": "response", "created_at": int(time.time()),
            "model": serving.response_model(request.model or serving.model_name), "error": None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {}, "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id, "reasoning": request.reasoning,
            "store": bool(request.store), "text": {"format": request.text_format()},
            "tool_choice": request.tool_choice or "auto", "tools": request.tools or [], "top_logprobs": request.top_logprobs,
            "truncation": "disabled", "user": request.user, "background": bool(request.background),
        }  # fmt: skip
        return _Turn(request, chat, conversation, meta)

    async def create(self, http_request: Request):
        turn = await self._turn(http_request)
        background = bool(turn.request.background)
        watched = _Detached() if background else http_request  # a background run outlives its HTTP request
        params, run, prompt_text = await submit(self.serving, watched, turn.chat, "resp", turn.request.model, renamed)
        turn.meta |= {"temperature": params.temperature, "top_p": params.top_p}
        if turn.request.stream:
            return StreamingResponse(self._stream(turn, run, prompt_text), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        if background:
            body = turn.response("queued", [], None)
            self.store.put(StoredResponse(body, [], pending=True))
            task = asyncio.create_task(self._background(turn, run, prompt_text))
            self._running[body["id"]] = (task, run)
            task.add_done_callback(lambda _: self._running.pop(body["id"], None))
            return JSONResponse(body)
        done = await final_message(self.serving, turn.chat, run, prompt_text)
        if done is None:  # nobody reads this answer
            return JSONResponse({}, status_code=499)
        return JSONResponse(self._finished(turn, run, *done))

    def _finished(self, turn: _Turn, run: RequestRun, final, deltas: list[dict]) -> dict:
        """The response of a finished run (stored when asked)."""
        c = final.outputs[0]
        items = OutputItems(turn.request.logprobs, turn.request.max_calls)
        top = turn.chat.top_logprobs or 0
        logprobs = chat_logprobs(c, 0, len(c.token_ids), top, self.serving.token_bytes) if turn.request.logprobs else None
        for delta in deltas:
            items.feed(delta, logprobs if "content" in delta else None)
        status = _status(c.finish_reason)
        items.finish(status)
        body = turn.response(status, items.items, self._usage(run, final, items))
        self._keep(turn, body, items)
        return body

    async def _background(self, turn: _Turn, run: RequestRun, prompt_text: str) -> None:
        """A background response's run: in_progress, then completed (or incomplete, failed, cancelled) in the store."""
        self.store.put(StoredResponse(turn.response("in_progress", [], None), [], pending=True))
        try:
            self._finished(turn, run, *await final_message(self.serving, turn.chat, run, prompt_text))
        except asyncio.CancelledError:
            run.abort()  # (cancel() records the status: a task cancelled before it began never gets here)
        except errors.APIError as exc:  # the engine died
            failed = turn.response("failed", [], None) | {"error": {"code": "server_error", "message": exc.message}}
            self.store.put(StoredResponse(failed, []))

    async def cancel(self, response_id: str) -> dict:
        """vLLM's and OpenAI's cancel: a background response still running stops (status cancelled); one that has
        finished comes back as it is."""
        stored = self.store.get(response_id)
        if not stored.body.get("background"):
            raise errors.bad_request("Only background responses can be cancelled", param="response_id")
        running = self._running.get(response_id)
        if running is not None:
            task, run = running
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            run.abort()
            stored = self.store.get(response_id)
            if stored.pending:
                self.store.put(StoredResponse({**stored.body, "status": "cancelled"}, []))
        return self.store.get(response_id).body

    async def _stream(self, turn: _Turn, run: RequestRun, prompt_text: str) -> AsyncIterator[str]:
        seq = iter(range(1 << 62))

        def event(e: dict) -> str:
            e = {**e, "sequence_number": next(seq)}
            return f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False, separators=(',', ':'))}\n\n"

        shown = turn.response("in_progress", [], None)
        yield event({"type": "response.created", "response": shown})
        yield event({"type": "response.in_progress", "response": shown})
        items = OutputItems(turn.request.logprobs, turn.request.max_calls)
        top, last = turn.chat.top_logprobs or 0, None
        try:
            async for last, new, start, end in message_deltas(self.serving, turn.chat, run, prompt_text):
                c = last.outputs[0]
                logprobs = chat_logprobs(c, start, end, top, self.serving.token_bytes) if turn.request.logprobs else None
                for delta in new:
                    for e in items.feed(delta, logprobs if "content" in delta else None):
                        yield event(e)
                    if "content" in delta:
                        logprobs = None  # (one delta carries a step's tokens)
        except EngineDeadError as exc:
            yield event({"type": "error", "code": "engine_dead", "message": str(exc), "param": None})
            return
        if run.disconnected or last is None:
            return
        status = _status(last.outputs[0].finish_reason)
        for e in items.finish(status):
            yield event(e)
        body = turn.response(status, items.items, self._usage(run, last, items))
        self._keep(turn, body, items)
        yield event({"type": f"response.{status}", "response": body})

    def _usage(self, run: RequestRun, final, items: OutputItems) -> dict:
        generated = len(final.outputs[0].token_ids)
        reasoning = "".join(i["content"][0]["text"] for i in items.items if i["type"] == "reasoning")
        tokenizer = self.serving.tokenizer
        thinking = len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning and tokenizer is not None else 0
        return {
            "input_tokens": run.prompt_tokens, "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": min(thinking, generated)},
            "total_tokens": run.prompt_tokens + generated,
        }  # fmt: skip

    def _keep(self, turn: _Turn, body: dict, items: OutputItems) -> None:
        if turn.request.store:
            self.store.put(StoredResponse(body, [*turn.conversation, items.message()]))


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def add_routes(app: FastAPI, serving: Serving, refuse_unless_served) -> ResponsesServing:
    responses = ResponsesServing(serving)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        refuse_unless_served(serving, "/v1/responses")
        return await responses.create(request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return JSONResponse(responses.store.get(response_id).body)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        responses.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return JSONResponse(await responses.cancel(response_id))

    return responses

"""POST /v1/messages (Anthropic's Messages API, as vLLM and SGLang serve it for clients such as Claude Code) and
POST /v1/messages/count_tokens.

A message runs as a chat completion (anthropic_protocol.py reads the request into one; chat.prepare makes the
sampling params and prompt); its output is the chat message cut into content blocks: `thinking` (the reasoning
parser's reasoning), `text`, and a `tool_use` block per call. A stream sends the same blocks as Anthropic's events
(message_start, content_block_start/delta/stop, message_delta, message_stop), built by the same ContentBlocks from
chat's message deltas. Errors come back in Anthropic's shape ({"type": "error", "error": {"type", "message"}}).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.requests import Request

from jaxpaged.engine.async_engine import EngineDeadError
from jaxpaged.entrypoints.openai import errors
from jaxpaged.entrypoints.openai.anthropic_protocol import MessagesRequest, renamed
from jaxpaged.entrypoints.openai.chat import prepare
from jaxpaged.entrypoints.openai.chat_turn import chat_request, final_message, message_deltas, submit
from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest
from jaxpaged.entrypoints.openai.serving import Serving
from jaxpaged.entrypoints.openai.streaming import RequestRun

# an HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip


def error_response(exc: errors.APIError) -> JSONResponse:
    kind = ERROR_TYPES.get(exc.status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": exc.message}}, status_code=exc.status,
                        headers=exc.headers)  # fmt: skip


class ContentBlocks:
    """A message's content blocks built from chat's message deltas, with the stream events that build them: a
    delta of another kind than the open block's closes it and opens the next."""

    def __init__(self, max_calls: int | None):
        self.blocks: list[dict] = []
        self.max_calls = max_calls
        self._open: dict | None = None
        self._calls = 0

    def feed(self, delta: dict) -> list[dict]:
        events: list[dict] = []
        for key, kind, field, delta_type in (("reasoning_content", "thinking", "thinking", "thinking_delta"),
                                             ("content", "text", "text", "text_delta")):  # fmt: skip
            piece = delta.get(key)
            if piece:
                if self._open is None or self._open["type"] != kind:
                    events += self._close()
                    events += self._start({"type": kind, field: "", **({"signature": ""} if kind == "thinking" else {})})
                self._open[field] += piece
                events.append(self._delta({"type": delta_type, field: piece}))
        for call in delta.get("tool_calls") or ():
            if "id" in call:  # a new call: its id and name
                events += self._close()
                if self.max_calls is not None and self._calls >= self.max_calls:
                    continue  # disable_parallel_tool_use: the first call only
                self._calls += 1
                block_id = "toolu_" + call["id"].removeprefix("call_")
                events += self._start({"type": "tool_use", "id": block_id, "name": call["function"]["name"], "input": {}})
                self._open["_json"] = ""
            pieces = (call.get("function") or {}).get("arguments")
            if pieces and self._open is not None and self._open["type"] == "tool_use":
                self._open["_json"] += pieces
                events.append(self._delta({"type": "input_json_delta", "partial_json": pieces}))
        return events

    def finish(self) -> list[dict]:
        events = [] if self.blocks else self._start({"type": "text", "text": ""})  # an empty answer: one empty text block
        return events + self._close()

    @property
    def has_tool_use(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    def _start(self, block: dict) -> list[dict]:
        self.blocks.append(block)
        self._open = block
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[dict]:
        block, self._open = self._open, None
        if block is None:
            return []
        if block["type"] == "tool_use":  # the arguments as an object (a call cut short, or not JSON: empty)
            try:
                parsed = json.loads(block.pop("_json") or "{}")
            except ValueError:
                parsed = {}
            block["input"] = parsed if isinstance(parsed, dict) else {}
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def _stop(blocks: ContentBlocks, c, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if blocks.has_tool_use:
        return "tool_use", None
    if isinstance(c.stop_reason, str) and c.stop_reason in (stop_sequences or ()):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _usage(run: RequestRun, final) -> dict:
    cached = final.num_cached_tokens
    return {"input_tokens": run.prompt_tokens - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": len(final.outputs[0].token_ids)}  # fmt: skip


class MessagesServing:
    def __init__(self, serving: Serving):
        self.serving = serving

    async def _parse(self, http_request: Request, model=MessagesRequest) -> tuple[MessagesRequest, ChatCompletionRequest]:
        raw_bytes = await http_request.body()
        try:
            request = model.model_validate_json(raw_bytes)
        except ValidationError as exc:
            raise errors.from_validation_error(exc) from None
        if request.model not in self.serving.all_model_names:
            raise errors.model_not_found(request.model, self.serving.all_model_names)
        chat = chat_request(lambda: request.chat_body(json.loads(raw_bytes)), renamed)
        return request, chat

    async def create(self, http_request: Request):
        request, chat = await self._parse(http_request)
        serving = self.serving
        _, run, prompt_text = await submit(serving, http_request, chat, "msg", request.model, renamed)
        meta = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                "model": serving.response_model(request.model)}  # fmt: skip
        if request.stream:
            return StreamingResponse(self._stream(request, chat, run, meta, prompt_text), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        done = await final_message(serving, chat, run, prompt_text)
        if done is None:  # nobody reads this answer
            return JSONResponse({}, status_code=499)
        final, deltas = done
        blocks = ContentBlocks(request.max_calls)
        for delta in deltas:
            blocks.feed(delta)
        blocks.finish()
        stop_reason, stop_sequence = _stop(blocks, final.outputs[0], request.stop_sequences)
        return JSONResponse({**meta, "content": blocks.blocks, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                             "usage": _usage(run, final)})  # fmt: skip

    async def _stream(self, request: MessagesRequest, chat, run: RequestRun, meta: dict, prompt_text: str) -> AsyncIterator[str]:
        def event(e: dict) -> str:
            return f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False, separators=(',', ':'))}\n\n"

        start_usage = {"input_tokens": run.prompt_tokens, "output_tokens": 0}
        yield event({"type": "message_start", "message": {**meta, "content": [], "stop_reason": None, "stop_sequence": None,
                                                          "usage": start_usage}})  # fmt: skip
        blocks = ContentBlocks(request.max_calls)
        last = None
        try:
            async for last, new, _, _ in message_deltas(self.serving, chat, run, prompt_text):
                for delta in new:
                    for e in blocks.feed(delta):
                        yield event(e)
        except EngineDeadError as exc:
            yield event({"type": "error", "error": {"type": "overloaded_error", "message": str(exc)}})
            return
        if run.disconnected or last is None:
            return
        for e in blocks.finish():
            yield event(e)
        stop_reason, stop_sequence = _stop(blocks, last.outputs[0], request.stop_sequences)
        usage = _usage(run, last)
        yield event({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                     "usage": usage})  # fmt: skip
        yield event({"type": "message_stop"})

    async def count_tokens(self, http_request: Request) -> dict:
        _, chat = await self._parse(http_request, CountTokensRequest)
        _, prompt, _ = prepare(self.serving, chat)
        if any(isinstance(m.content, list) for m in chat.messages):
            raise errors.bad_request("count_tokens takes text messages only (no images)", param="messages")
        try:
            _, ids = self.serving.engine.engine._prompt_ids(prompt)  # rendered as /v1/messages renders it
        except ValueError as exc:
            raise errors.bad_request(str(exc), param="messages") from None
        return {"input_tokens": len(ids)}


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1  # (count_tokens takes none)


def add_routes(app: FastAPI, serving: Serving, refuse_unless_served) -> None:
    messages = MessagesServing(serving)

    @app.post("/v1/messages")
    async def create_message(request: Request):
        try:
            refuse_unless_served(serving, "/v1/messages")
            return await messages.create(request)
        except errors.APIError as exc:
            return error_response(exc)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            return JSONResponse(await messages.count_tokens(request))
        except errors.APIError as exc:
            return error_response(exc)

"""POST /v1/chat/completions: the conversation through the model's chat template, n choices."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from jaxpaged.engine.async_engine import ChatPrompt, EngineDeadError
from jaxpaged.entrypoints.openai import errors
from jaxpaged.entrypoints.openai.logprobs import chat_logprobs
from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest
from jaxpaged.entrypoints.openai.serving import SAMPLING_FIELDS, Serving, stream_choices, usage
from jaxpaged.entrypoints.openai.streaming import Deltas, RequestRun, sse


def _fields(body: ChatCompletionRequest) -> dict[str, str]:
    return {
        **SAMPLING_FIELDS, "prompt": "messages", "prompt_token_ids": "messages", "messages": "messages",
        "max_tokens": body.max_tokens_field, "logprobs": "top_logprobs",
        "structured_outputs": body.constraint_field,
    }


async def create_chat_completion(serving: Serving, http_request: Request):
    body: ChatCompletionRequest = await serving.parse(http_request, ChatCompletionRequest)
    fields = _fields(body)
    params = serving.sampling_params(body, fields)
    prompt = ChatPrompt(body.conversation(), add_generation_prompt=body.add_generation_prompt)
    request_id, run = await serving.submit(http_request, "chatcmpl", [prompt], params, fields, "messages")
    meta = {"id": request_id, "created": int(time.time()), "model": serving.model_name}
    if body.stream:
        return StreamingResponse(
            _stream(serving, run, body, meta), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    try:
        (final,) = await run.final()
    except EngineDeadError as exc:
        raise errors.engine_dead(str(exc)) from None
    if run.disconnected:  # nobody reads this answer
        return JSONResponse({}, status_code=499)
    top = body.top_logprobs or 0
    choices = []
    for c in final.outputs:
        logprobs = {"content": chat_logprobs(c, 0, len(c.token_ids), top, serving.token_bytes)} if body.logprobs else None
        message, finish = _message(body, c.text, c.finish_reason)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish})
    generated = sum(len(c.token_ids) for c in final.outputs)
    return JSONResponse({**meta, "object": "chat.completion", "choices": choices, "usage": usage(run.prompt_tokens, generated)})


def _message(body: ChatCompletionRequest, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The assistant message and finish reason; under a tool choice, a finished output's calls as tool_calls."""
    if body.tool_mode is None:
        return {"role": "assistant", "content": text}, finish_reason
    calls = body.tool_calls(text) if finish_reason == "stop" else None
    if calls is None:  # cut short (length, abort): the partial text, as it is
        return {"role": "assistant", "content": text, "tool_calls": None}, finish_reason
    return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"


async def _stream(serving: Serving, run: RequestRun, body: ChatCompletionRequest, meta: dict) -> AsyncIterator[str]:
    meta = {**meta, "object": "chat.completion.chunk"}
    extra = {"usage": usage(run.prompt_tokens, 0) if body.continuous_usage else None} if body.include_usage else {}
    deltas = Deltas(body.n)
    top = body.top_logprobs or 0
    for index in range(body.n):  # OpenAI opens every choice with the role
        delta = {"role": "assistant", "content": ""}
        yield sse({**meta, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}], **extra})

    def chunk_for(_i, _out, c) -> dict | None:
        text, start, end = deltas.advance(c.index, c.text, len(c.token_ids))
        if body.tool_mode is not None:  # the calls are sent whole, once the output is finished
            if c.finish_reason is None:
                return None
            message, finish = _message(body, c.text, c.finish_reason)
            logprobs = {"content": chat_logprobs(c, 0, end, top, serving.token_bytes)} if body.logprobs else None
            if message["tool_calls"] is None:
                return {"index": c.index, "delta": {"content": c.text}, "logprobs": logprobs, "finish_reason": finish}
            calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            return {"index": c.index, "delta": {"tool_calls": calls}, "logprobs": logprobs, "finish_reason": finish}
        if not text and c.finish_reason is None and (not body.logprobs or start == end):
            return None
        logprobs = {"content": chat_logprobs(c, start, end, top, serving.token_bytes)} if body.logprobs else None
        delta = {"content": text} if text else {}
        return {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": c.finish_reason}

    async for chunk in stream_choices(run, meta, body, chunk_for):
        yield chunk

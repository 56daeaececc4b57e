"""One assistant turn run as a chat completion, for the APIs that are chat in another shape (the Responses API,
Anthropic's Messages API): their request read into chat's, submitted, and its message read back whole or as
deltas, every error named with the other API's fields (`renamed` maps a chat field and message to them)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from pydantic import ValidationError
from starlette.requests import Request

from jaxpaged.engine.async_engine import EngineDeadError
from jaxpaged.entrypoints.openai import errors
from jaxpaged.entrypoints.openai.chat import MessageDeltas, assistant_message, choice_readers, prepare
from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest
from jaxpaged.entrypoints.openai.serving import Serving
from jaxpaged.entrypoints.openai.streaming import RequestRun
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams

Renamer = Callable[[str | None, str], tuple[str | None, str]]


def _renamed(exc: errors.APIError, renamed: Renamer) -> errors.APIError:
    exc.param, exc.message = renamed(exc.param, exc.message)
    return exc


def chat_request(build: Callable[[], dict], renamed: Renamer) -> ChatCompletionRequest:
    """The chat request `build()` writes (its JSON), with chat's checks; a 400 naming the other API's field."""
    try:
        return ChatCompletionRequest.model_validate_json(json.dumps(build()))
    except errors.FieldError as exc:
        raise errors.bad_request(str(exc), param=exc.param) from None
    except ValidationError as exc:
        raise _renamed(errors.from_validation_error(exc), renamed) from None


async def submit(
    serving: Serving, http_request: Request, chat: ChatCompletionRequest, prefix: str, model: str | None, renamed: Renamer
) -> tuple[SamplingParams, RequestRun, str]:
    """Queue the turn: (its sampling params, run, and the prompt's text where a reasoning reader looks)."""
    try:
        params, prompt, fields = prepare(serving, chat)
        _, run = await serving.submit(http_request, prefix, [prompt], params, fields, "messages", model=model,
                                      priority=chat.priority)  # fmt: skip
    except errors.APIError as exc:
        raise _renamed(exc, renamed) from None
    return params, run, serving.prompt_text(run) if serving.reasoning_parser else ""


async def final_message(
    serving: Serving, chat: ChatCompletionRequest, run: RequestRun, prompt_text: str
) -> tuple[RequestOutput, list[dict]] | None:
    """The finished output and its message as the deltas a stream of it sends (reasoning, content, each call);
    None when the client has gone."""
    try:
        (final,) = await run.final()
    except EngineDeadError as exc:
        raise errors.engine_dead(str(exc)) from None
    if run.disconnected:
        return None
    c = final.outputs[0]
    message, _ = assistant_message(*choice_readers(serving, chat, prompt_text), c.text, c.finish_reason)
    deltas = [{"reasoning_content": message.get("reasoning_content")}, {"content": message.get("content")}]
    return final, deltas + [{"tool_calls": [call]} for call in message.get("tool_calls") or ()]


async def message_deltas(
    serving: Serving, chat: ChatCompletionRequest, run: RequestRun, prompt_text: str
) -> AsyncIterator[tuple[RequestOutput, list[dict], int, int]]:
    """Each update: (the output so far, its new deltas, first new token, end of new tokens). EngineDeadError if the
    loop dies."""
    deltas = MessageDeltas(serving, chat, prompt_text, 1)
    async for batch in run.updates():
        for _, out in batch:
            new, start, end = deltas.step(out.outputs[0])
            yield out, new, start, end

"""POST /v1/completions: one engine request per prompt, choices numbered prompt-major (as OpenAI)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from jaxpaged.async_engine import EngineDeadError
from jaxpaged.outputs import CompletionOutput
from jaxpaged.server import errors
from jaxpaged.server.logprobs import completion_logprobs
from jaxpaged.server.protocol import CompletionRequest
from jaxpaged.server.serving import SAMPLING_FIELDS, Serving, stream_choices, usage
from jaxpaged.server.streaming import Deltas, RequestRun

FIELDS = {**SAMPLING_FIELDS, "prompt": "prompt", "prompt_token_ids": "prompt"}


async def create_completion(serving: Serving, http_request: Request):
    body: CompletionRequest = await serving.parse(http_request, CompletionRequest)
    params = serving.sampling_params(body, FIELDS)
    prompts = body.prompts()
    engine_prompts = [p if isinstance(p, str) else {"prompt_token_ids": p, "prompt": None} for p in prompts]
    request_id, run = await serving.submit(http_request, "cmpl", engine_prompts, params, FIELDS, "prompt")
    meta = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": serving.model_name}
    echoes = [_echo(serving, p) for p in prompts] if body.echo else None  # after submit: token ids are validated
    if body.stream:
        return StreamingResponse(_stream(run, body, meta, echoes), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        finals = await run.final()
    except EngineDeadError as exc:
        raise errors.engine_dead(str(exc)) from None
    choices, generated = [], 0
    if run.disconnected:  # nobody reads this answer
        return JSONResponse({}, status_code=499)
    for i, out in enumerate(finals):
        for c in out.outputs:
            generated += len(c.token_ids)
            prefix = echoes[i] if echoes else ""
            logprobs = None
            if body.logprobs is not None:
                logprobs, _ = completion_logprobs(c, 0, len(c.token_ids), body.logprobs, 0)
            choices.append({"index": i * body.n + c.index, "text": prefix + c.text, "logprobs": logprobs, "finish_reason": c.finish_reason})
    return JSONResponse({**meta, "choices": choices, "usage": usage(run.prompt_tokens, generated)})


def _echo(serving: Serving, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else serving.decode(prompt)


def _stream(run: RequestRun, body: CompletionRequest, meta: dict, echoes: list[str] | None) -> AsyncIterator[str]:
    n = body.n
    deltas = Deltas(len(run.streams) * n)
    return stream_choices(
        run, meta, body.include_usage,
        lambda i, c: _choice_chunk(deltas, i * n + c.index, c, body, echoes[i] if echoes else ""),
    )  # fmt: skip


def _choice_chunk(deltas: Deltas, index: int, c: CompletionOutput, body: CompletionRequest, echo: str) -> dict | None:
    first = not deltas.started[index]
    deltas.started[index] = True
    text, start, end = deltas.advance(index, c.text, len(c.token_ids))
    if first and echo:
        text = echo + text
    if not text and c.finish_reason is None and (body.logprobs is None or start == end):
        return None
    logprobs = None
    if body.logprobs is not None:
        logprobs, deltas.offsets[index] = completion_logprobs(c, start, end, body.logprobs, deltas.offsets[index])
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}

"""POST /v1/completions: one engine request per prompt, choices numbered prompt-major (as OpenAI)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from jaxpaged.engine.async_engine import EngineDeadError
from jaxpaged.entrypoints.openai import errors
from jaxpaged.entrypoints.openai.logprobs import (
    completion_logprobs, join_logprobs, prompt_completion_logprobs, vllm_prompt_logprobs,
)  # fmt: skip
from jaxpaged.entrypoints.openai.protocol import CompletionRequest
from jaxpaged.entrypoints.openai.serving import SAMPLING_FIELDS, Serving, stream_choices, usage
from jaxpaged.entrypoints.openai.streaming import Deltas, RequestRun
from jaxpaged.outputs import CompletionOutput, RequestOutput

FIELDS = {**SAMPLING_FIELDS, "prompt": "prompt", "prompt_token_ids": "prompt", "prompt_embeds": "prompt_embeds"}


async def create_completion(serving: Serving, http_request: Request):
    body: CompletionRequest = await serving.parse(http_request, CompletionRequest)
    # best_of: the engine's word for the beam width, which is n unless best_of was given
    fields = {**FIELDS, "structured_outputs": body.constraint_field, "best_of": "best_of" if body.best_of is not None else "n"}
    params = serving.sampling_params(body, fields)
    prompts = body.prompts()
    engine_prompts = [p if isinstance(p, str) else {"prompt_token_ids": p, "prompt": None} for p in prompts]
    if body.prompt_embeds is not None:  # vLLM's order: the embeddings' prompts first, then prompt's
        engine_prompts = [*await _embeds_prompts(serving, body), *engine_prompts]
    request_id, run = await serving.submit(http_request, "cmpl", engine_prompts, params, fields, "prompt", model=body.model,
                                           priority=body.priority)  # fmt: skip
    meta = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": serving.response_model(body.model)}
    echoes = [_echo(serving, p) for p in prompts] if body.echo else None  # after submit: token ids are validated
    if body.stream:
        stream = _stream(serving, run, body, meta, echoes)
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        finals = await run.final()
    except EngineDeadError as exc:
        raise errors.engine_dead(str(exc)) from None
    choices, generated = [], 0
    if run.disconnected:  # nobody reads this answer
        return JSONResponse({}, status_code=499)
    for i, out in enumerate(finals):
        for c in _shown(out, body):
            generated += len(c.token_ids)
            prefix = echoes[i] if echoes else ""
            logprobs = None
            if body.logprobs is not None:
                logprobs, _ = _logprobs(serving, body, out, c, 0, len(c.token_ids), 0, first=True)
            choices.append({"index": i * body.n + c.index, "text": prefix + c.text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})  # fmt: skip
            if body.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs, body.prompt_logprobs)
    return JSONResponse({**meta, "choices": choices, "usage": usage(run.prompt_tokens, generated)})


async def _embeds_prompts(serving: Serving, body: CompletionRequest) -> list[dict]:
    """The prompt_embeds field's tensors as engine prompts: a 400 naming prompt_embeds unless the server was started
    with --enable-prompt-embeds (checked before any bytes are read), for bytes torch.load cannot read as a tensor
    (weights_only: no pickled code runs), or without torch; echo has no prompt text to repeat (vLLM refuses it too)."""
    config = getattr(serving.engine.engine, "config", None)
    if not getattr(config, "enable_prompt_embeds", False):
        raise errors.bad_request("prompt_embeds needs a server started with --enable-prompt-embeds", param="prompt_embeds")
    if body.echo:
        raise errors.bad_request("echo is not supported with prompt_embeds", param="echo")
    from jaxpaged.engine.prompt_embeds import load_prompt_embeds

    try:  # (off the event loop: a long prompt's tensor takes a while to decode)
        return [{"prompt_embeds": t} for t in await asyncio.to_thread(lambda: [load_prompt_embeds(e) for e in body.prompt_embeds])]
    except ValueError as exc:
        raise errors.bad_request(str(exc), param="prompt_embeds") from None


def _echo(serving: Serving, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else serving.decode(prompt)


def _shown(out: RequestOutput, body: CompletionRequest) -> list[CompletionOutput]:
    """The choices as the client sees them: with echo and max_tokens 0, the one generated token is dropped."""
    if not body.prompt_only:
        return out.outputs
    return [
        dataclasses.replace(
            c, text="", token_ids=[], cumulative_logprob=None, logprobs=[] if c.logprobs is not None else None,
            finish_reason="length" if c.finish_reason is not None else None, stop_reason=None,
        )
        for c in out.outputs
    ]


def _logprobs(
    serving: Serving, body: CompletionRequest, out: RequestOutput, c: CompletionOutput, start: int, end: int, offset: int,
    first: bool,
) -> tuple[dict, int]:
    """Logprobs of tokens [start, end) of a choice; its first piece, with echo, starts with the prompt's."""
    if not (first and body.echo and out.prompt_logprobs):
        return completion_logprobs(c, start, end, body.logprobs, offset)
    ids = out.prompt_token_ids
    head, offset = prompt_completion_logprobs(ids, out.prompt_logprobs, body.logprobs, serving.decode(ids[:1]))
    tail, offset = completion_logprobs(c, start, end, body.logprobs, offset)
    return join_logprobs(head, tail), offset


def _stream(
    serving: Serving, run: RequestRun, body: CompletionRequest, meta: dict, echoes: list[str] | None
) -> AsyncIterator[str]:
    n = body.n
    deltas = Deltas(len(run.streams) * n)

    def chunk_for(i: int, out: RequestOutput, c: CompletionOutput) -> dict | None:
        index = i * n + c.index
        first = not deltas.started[index]
        deltas.started[index] = True
        text, start, end = deltas.advance(index, c.text, len(c.token_ids))
        if first and echoes:
            text = echoes[i] + text
        if not text and c.finish_reason is None and (body.logprobs is None or start == end):
            return None
        logprobs = None
        if body.logprobs is not None:
            logprobs, deltas.offsets[index] = _logprobs(serving, body, out, c, start, end, deltas.offsets[index], first)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason if c.finish_reason is not None else None}

    return stream_choices(run, meta, body, chunk_for, lambda out: _shown(out, body))

"""POST /v1/chat/completions: the conversation through the model's chat template (GPT-OSS's through openai-harmony,
with the request's reasoning_effort: utils/harmony.py), n choices."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from jaxpaged.engine.async_engine import ChatPrompt, EngineDeadError
from jaxpaged.entrypoints.openai import errors
from jaxpaged.entrypoints.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest
from jaxpaged.entrypoints.openai.reasoning import MARKERS, SPECIAL_MARKERS as SPECIAL_THINKING
from jaxpaged.entrypoints.openai.reasoning import HarmonyReader, ReasoningReader, reasoning_reader
from jaxpaged.entrypoints.openai.serving import SAMPLING_FIELDS, Serving, stream_choices, usage
from jaxpaged.entrypoints.openai.streaming import Deltas, RequestRun, sse
from jaxpaged.entrypoints.openai.tool_parsers import SPECIAL_MARKERS, ToolCallReader, tool_reader
from jaxpaged.sampling_params import SamplingParams


def _fields(body: ChatCompletionRequest) -> dict[str, str]:
    return {
        **SAMPLING_FIELDS, "prompt": "messages", "prompt_token_ids": "messages", "messages": "messages",
        "max_tokens": body.max_tokens_field, "logprobs": "top_logprobs",
        "structured_outputs": body.constraint_field, "best_of": "n",  # (the engine's word for the beam width)
    }


def prepare(serving: Serving, body: ChatCompletionRequest) -> tuple[SamplingParams, ChatPrompt, dict[str, str]]:
    """(sampling params, prompt, the engine's words -> request fields) of a chat request; a 400 for bad input.
    The Responses API runs its requests through this too."""
    fields = _fields(body)
    if body.tool_mode == "auto" and serving.tool_parser is None:  # vLLM refuses it too
        raise errors.bad_request(
            "tool_choice 'auto' (the default with tools) needs a tool-call parser: this model's chat template shows "
            "no tool-call format the server can read and no --tool-call-parser was given; set tool_choice 'required', "
            "a named function or 'none'",
            param="tool_choice",
        )
    parser = serving.reasoning_parser
    if parser in SPECIAL_THINKING or (body.tool_mode == "auto" and serving.tool_parser in SPECIAL_MARKERS):
        body.skip_special_tokens = False  # the markers are special tokens (harmony's, tool calls'): readers need them
    params = serving.sampling_params(body, fields, reasoning=MARKERS[parser] if parser else None)
    exclude = body.tool_choice == "none" and serving.settings.exclude_tools_when_tool_choice_none
    tools = None if exclude else body.tools or None
    prompt = ChatPrompt(body.conversation(), body.add_generation_prompt, tools, body.chat_template_kwargs, body.reasoning_effort,
                        body.continue_final_message, serving.template_for(body.chat_template), body.mm_processor_kwargs)  # fmt: skip
    return params, prompt, fields


async def create_chat_completion(serving: Serving, http_request: Request):
    body: ChatCompletionRequest = await serving.parse(http_request, ChatCompletionRequest)
    params, prompt, fields = prepare(serving, body)
    parser = serving.reasoning_parser
    request_id, run = await serving.submit(http_request, "chatcmpl", [prompt], params, fields, "messages", model=body.model,
                                           priority=body.priority)  # fmt: skip
    prompt_text = serving.prompt_text(run) if parser else ""
    meta = {"id": request_id, "created": int(time.time()), "model": serving.response_model(body.model)}
    if body.stream:
        return StreamingResponse(
            _stream(serving, run, body, meta, prompt_text), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
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
        reader, thinking = choice_readers(serving, body, prompt_text)
        message, finish = assistant_message(reader, thinking, c.text, c.finish_reason)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish,
                        "stop_reason": c.stop_reason})  # fmt: skip
    generated = sum(len(c.token_ids) for c in final.outputs)
    response = {**meta, "object": "chat.completion", "choices": choices, "usage": usage(run.prompt_tokens, generated)}
    if body.prompt_logprobs is not None:  # vLLM's, beside the choices
        response["prompt_logprobs"] = vllm_prompt_logprobs(final.prompt_logprobs, body.prompt_logprobs)
    return JSONResponse(response)


def _reader(serving: Serving, body: ChatCompletionRequest) -> ToolCallReader | None:
    """What reads a choice's tool calls: the model's own format under "auto", the grammar's otherwise."""
    return None if body.tool_mode is None else tool_reader(body.tool_mode, serving.tool_parser, body.tools)


def choice_readers(serving: Serving, body: ChatCompletionRequest, prompt_text: str):
    """(tool-call reader, reasoning reader) of one choice. Under "auto" with the openai parser, harmony's reader is
    both: openai-harmony reads the reasoning, the answer and the calls (`to=functions.NAME`) from the messages."""
    if body.tool_mode == "auto" and serving.tool_parser == "openai":
        harmony = HarmonyReader(tools=True)
        return harmony, harmony
    parser = serving.reasoning_parser
    return _reader(serving, body), reasoning_reader(parser, prompt_text) if parser else None


def choice_finish(reader: ToolCallReader | HarmonyReader | None, finish_reason: str | None) -> str | None:
    """"tool_calls" when the output ended by itself with calls in it; one cut short keeps its reason."""
    return "tool_calls" if reader is not None and reader.calls and finish_reason == "stop" else finish_reason


def assistant_message(
    reader: ToolCallReader | HarmonyReader | None, thinking: ReasoningReader | None, text: str, finish_reason: str | None
) -> tuple[dict, str | None]:
    """The assistant message and finish reason; with a reasoning parser the thinking as reasoning_content (and only
    the answer read for calls); under tools, the calls as tool_calls and the rest as content."""
    message: dict = {"role": "assistant"}
    if thinking is not None:
        message["reasoning_content"], text = thinking.parse(text)
    if reader is None:
        return {**message, "content": text}, finish_reason
    content, calls = (text, reader.calls) if reader is thinking else reader.parse(text or "")
    if not calls:
        content = content or ("" if thinking is None else None)
    return {**message, "content": content, "tool_calls": [c.openai() for c in calls]}, choice_finish(reader, finish_reason)


class MessageDeltas:
    """The n choices of one streamed answer: each update's cumulative output in, OpenAI message deltas out
    ({"reasoning_content"}, {"content"} or {"tool_calls"}), the thinking split off and the calls read from the
    answer alone. Chat's chunks and the Responses API's events are both built from these."""

    def __init__(self, serving: Serving, body: ChatCompletionRequest, prompt_text: str, n: int):
        self.deltas = Deltas(n)
        self.readers, self.thinkers = map(list, zip(*(choice_readers(serving, body, prompt_text) for _ in range(n))))
        self.answers = [""] * n  # each choice's answer so far (its text but the thinking), which the tool reader reads

    def step(self, c) -> tuple[list[dict], int, int]:
        """(new deltas, first new token, end of new tokens) of choice c's latest output."""
        text, start, end = self.deltas.advance(c.index, c.text, len(c.token_ids))
        reader, thinker, done = self.readers[c.index], self.thinkers[c.index], c.finish_reason is not None
        new = [{"content": text}] if text else []
        if thinker is not None:
            new = thinker.feed(c.text) + (thinker.finish(c.text) if done else [])
        if reader is not None and reader is not thinker:  # (harmony's reader sends its calls itself)
            answer = c.text if thinker is None else self.answers[c.index] + "".join(d.get("content", "") for d in new)
            self.answers[c.index] = answer
            new = [d for d in new if "reasoning_content" in d] + reader.feed(answer) + (reader.finish() if done else [])
        return new, start, end

    def finish_reason(self, c) -> str | None:
        return choice_finish(self.readers[c.index], c.finish_reason)


async def _stream(
    serving: Serving, run: RequestRun, body: ChatCompletionRequest, meta: dict, prompt_text: str
) -> AsyncIterator[str]:
    meta = {**meta, "object": "chat.completion.chunk"}
    extra = {"usage": usage(run.prompt_tokens, 0) if body.continuous_usage else None} if body.include_usage else {}
    messages = MessageDeltas(serving, body, prompt_text, body.n)
    top = body.top_logprobs or 0
    for index in range(body.n):  # OpenAI opens every choice with the role
        delta = {"role": "assistant", "content": ""}
        yield sse({**meta, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}], **extra})

    def chunk_for(_i, _out, c) -> list[dict] | None:
        """A chunk per delta: content, or under tools a call's opening (id, name) and then its arguments' pieces."""
        new, start, end = messages.step(c)
        if not new:
            if c.finish_reason is None and (not body.logprobs or start == end):
                return None
            new = [{}]
        choices = [{"index": c.index, "delta": d, "logprobs": None, "finish_reason": None} for d in new]
        if body.logprobs:
            choices[0]["logprobs"] = {"content": chat_logprobs(c, start, end, top, serving.token_bytes)}
        choices[-1]["finish_reason"] = messages.finish_reason(c)
        if c.finish_reason is not None:
            choices[-1]["stop_reason"] = c.stop_reason  # (vLLM's: the stop string or token id that ended it)
        return choices

    async for chunk in stream_choices(run, meta, body, chunk_for):
        yield chunk

"""The Responses API's request (POST /v1/responses), read into the chat request it amounts to.

A response is one assistant turn of a conversation, so the server runs it as a chat completion: `input` items
become chat messages (function calls an assistant's tool_calls, their outputs tool messages, reasoning items the
next assistant turn's reasoning_content), `instructions` a system message, `tools` chat's nested function form,
`text.format` a response_format, `max_output_tokens` max_completion_tokens, `reasoning.effort` reasoning_effort.
vLLM's sampling extras (top_k, seed, stop, ...) pass through under their chat names. Every check chat makes is
made once, by ChatCompletionRequest; its errors are renamed to the Responses field (`RENAMED`).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import field_validator, model_validator

from jaxpaged.entrypoints.openai.errors import FieldError, rename_field
from jaxpaged.entrypoints.openai.protocol import _Strict, check_template_kwargs

# vLLM's extras a Responses request may carry, passed to the chat request as they are
PASSTHROUGH = (
    "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
    "ignore_eos", "min_tokens", "logit_bias", "skip_special_tokens", "include_stop_str_in_output", "allowed_token_ids",
    "bad_words", "truncate_prompt_tokens", "spaces_between_special_tokens", "priority", "structured_outputs",
)  # fmt: skip
# chat's field (or its head) -> the Responses field it came from, for error messages and params
RENAMED = {
    "messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
    "response_format": "text.format", "reasoning_effort": "reasoning.effort", "logprobs": "top_logprobs",
}  # fmt: skip
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(_Strict):
    model: str | None = None  # None: the first served name (vLLM lets it be left out too)
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict | None = None  # {"effort": ..., "summary": ...}
    include: list[str] | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's, as in chat
    # OpenAI's fields that need what this server does not have (hosted state, background jobs, prompt templates),
    # with the value that asks for nothing: another value is refused, not dropped
    background: bool | None = False  # run on after the answer (status "queued"), read back with GET, cancellable
    UNSUPPORTED: ClassVar[dict[str, Any]] = {"conversation": None, "prompt": None, "max_tool_calls": None,
                                             "context_management": None}  # fmt: skip

    _template_kwargs = field_validator("chat_template_kwargs")(classmethod(check_template_kwargs))

    @field_validator("input")
    @classmethod
    def _input(cls, value):
        if not value:
            raise ValueError("must not be empty")
        return value

    @field_validator("truncation")
    @classmethod
    def _truncation(cls, value):
        if value not in (None, "disabled"):
            raise ValueError("only 'disabled' is supported: a prompt longer than the model's context is a 400")
        return value

    @model_validator(mode="after")
    def _background(self):
        if self.background and self.store is False:
            raise ValueError("background needs store: a background response is read back with GET /v1/responses/{id}")
        if self.background and self.stream:
            raise ValueError("background with stream is not supported by this server (poll GET /v1/responses/{id})")
        return self

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or self.top_logprobs is not None

    @property
    def max_calls(self) -> int | None:
        """parallel_tool_calls false: at most one function call a response."""
        return 1 if self.parallel_tool_calls is False else None

    def text_format(self) -> dict:
        return (self.text or {}).get("format") or {"type": "text"}

    def chat_body(self, history: list[dict], raw: dict) -> dict:
        """The chat request's JSON this response amounts to; `history` the earlier turns' messages
        (previous_response_id), `raw` the request's own JSON (for vLLM's extras)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + history
        messages += input_messages(self.input)
        body = {k: raw[k] for k in PASSTHROUGH if k in raw}
        body |= {"model": self.model or "", "messages": messages, "temperature": self.temperature, "top_p": self.top_p}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.logprobs:
            body |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        response_format = _response_format(self.text)
        if response_format is not None:
            body["response_format"] = response_format
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            body["reasoning_effort"] = effort
        if self.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        return {k: v for k, v in body.items() if v is not None}


def input_messages(value: str | list[Any]) -> list[dict]:
    """`input` as chat messages: a string is one user turn; items in order, consecutive assistant pieces (text,
    function calls, reasoning) joined into one assistant message as a chat template expects them."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn that follows it

    def assistant() -> dict:
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or last.get("_closed"):
            last = {"role": "assistant", "content": None}
            messages.append(last)
        if reasoning is not None:
            last["reasoning_content"], reasoning = reasoning, None
        return last

    for i, item in enumerate(value):
        if isinstance(item, str):  # (lenient, as vLLM: a bare string is a user turn)
            item = {"role": "user", "content": item}
        if not isinstance(item, dict):
            raise FieldError(f"input.{i} must be an object (an input item)", f"input.{i}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            content = _content(item.get("content"), i)
            if role == "assistant":
                message = assistant()
                message["content"] = (message["content"] or "") + content if isinstance(content, str) else content
            else:
                messages.append({"role": role, "content": content})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(x, str) for x in (name, arguments, call_id)):
                raise FieldError(f"input.{i} (a function_call) must have string name, arguments and call_id", f"input.{i}")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            message = assistant()
            message["tool_calls"] = [*(message.get("tool_calls") or []), call]
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise FieldError(f"input.{i}.call_id must be a string", f"input.{i}.call_id")
            text = output if isinstance(output, str) else _parts_text(output, f"input.{i}.output")
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["_closed"] = True
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []  # its text, else its summary
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict)) or None
        else:
            raise FieldError(
                f"input.{i}.type {kind!r} is not supported (message, function_call, function_call_output or reasoning)",
                f"input.{i}.type",
            )
    for m in messages:
        m.pop("_closed", None)
    return messages


def _content(content: Any, i: int) -> str | list[dict]:
    """A message's content as chat's: text, or its parts (input_image as chat's image_url part)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(f"input.{i}.content must be a string or a list of content parts", f"input.{i}.content")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise FieldError(
                f"input.{i}.content parts must be input_text, output_text or input_image (with an image_url); "
                f"{kind!r} is not supported", f"input.{i}.content",
            )  # fmt: skip
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _parts_text(parts: Any, param: str) -> str:
    if isinstance(parts, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        return "".join(p["text"] for p in parts)
    raise FieldError(f"{param} must be a string or a list of input_text parts", param)


def _chat_tool(tool: Any, i: int) -> dict:
    """A Responses function tool ({"type": "function", "name", "parameters"}) in chat's nested form."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise FieldError(f"tools.{i}.type {kind!r} is not supported: this server runs function tools only", f"tools.{i}.type")
    if "function" in tool:  # already chat's form (lenient)
        return tool
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise FieldError(f"tools.{i}.name must be a non-empty string", f"tools.{i}.name")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise FieldError(
        f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'name': str}} (got {json.dumps(choice)})",
        "tool_choice",
    )


def _response_format(text: dict | None) -> dict | None:
    """text.format as chat's response_format (None for plain text)."""
    text = text or {}
    if text.get("verbosity") not in (None, "medium"):
        raise FieldError("text.verbosity is not supported by this server (leave it 'medium')", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise FieldError(f"text.format.type must be one of text, json_object, json_schema (got {kind!r})", "text.format.type")


def renamed(param: str | None, message: str) -> tuple[str | None, str]:
    """A chat field (and a message that starts with it) as the Responses field it came from."""
    if not param:
        return param, message
    head, dot, rest = param.partition(".")
    if head == "response_format":  # response_format.json_schema.schema -> text.format.schema
        rest = rest.removeprefix("json_schema").lstrip(".")
    elif head == "messages":
        rest = ""  # the chat message's index is not the input item's
    new = RENAMED.get(head)
    if new is None:
        return param, message
    full = f"{new}.{rest}" if rest else new
    return full, rename_field(rename_field(message, param, full), head, new)

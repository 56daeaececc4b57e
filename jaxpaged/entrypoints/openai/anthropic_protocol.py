"""Anthropic's Messages API request (POST /v1/messages, as vLLM and SGLang serve it), read into the chat request it
amounts to, as the Responses API's is (responses_protocol.py): content blocks become chat messages (`tool_use`
blocks an assistant's tool_calls, `tool_result` blocks tool messages, `thinking` blocks reasoning_content, images
image_url parts), `system` a system message, `tools` chat's function form, `tool_choice` chat's, `stop_sequences`
stop. The chat request then makes every check once; its errors are renamed to the Anthropic field (`RENAMED`).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import field_validator

from jaxpaged.entrypoints.openai.errors import FieldError, rename_field
from jaxpaged.entrypoints.openai.protocol import _Strict, check_template_kwargs
from jaxpaged.entrypoints.openai.responses_protocol import PASSTHROUGH

RENAMED = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config.format",
           "reasoning_effort": "output_config.effort"}


class MessagesRequest(_Strict):
    model: str
    messages: list[Any]
    max_tokens: int
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    tools: list[Any] | None = None
    tool_choice: dict | None = None
    # {"type": "enabled", "budget_tokens": N}: N is the thinking_token_budget (whether a model thinks at all is its
    # chat template's: chat_template_kwargs); {"type": "disabled"} is accepted
    thinking: dict | None = None
    output_config: dict | None = None  # {"format": {"type": "json_schema", "schema"}, "effort": ...}
    metadata: dict | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's, as in chat
    UNSUPPORTED: ClassVar[dict[str, Any]] = {"mcp_servers": [], "container": None}

    _template_kwargs = field_validator("chat_template_kwargs")(classmethod(check_template_kwargs))

    @field_validator("messages")
    @classmethod
    def _messages(cls, value):
        if not value:
            raise ValueError("must not be empty")
        return value

    @property
    def max_calls(self) -> int | None:
        return 1 if (self.tool_choice or {}).get("disable_parallel_tool_use") else None

    def chat_body(self, raw: dict) -> dict:
        """The chat request's JSON; `raw` the request's own JSON (for vLLM's extras)."""
        messages = _system(self.system) + [m for i, message in enumerate(self.messages) for m in _messages(message, i)]
        body = {k: raw[k] for k in PASSTHROUGH if k in raw}
        body |= {"model": self.model, "messages": messages, "max_completion_tokens": self.max_tokens,
                 "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "stop": self.stop_sequences}  # fmt: skip
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        body |= _output_config(self.output_config)
        body |= _thinking(self.thinking)
        return {k: v for k, v in body.items() if v is not None}


def _thinking(thinking: dict | None) -> dict:
    """thinking's budget_tokens as chat's thinking_token_budget (enforced: the end marker is forced there)."""
    if thinking is None or thinking.get("type") in ("disabled", "adaptive"):
        return {}
    if thinking.get("type") != "enabled":
        raise FieldError("thinking.type must be 'enabled' or 'disabled'", "thinking.type")
    budget = thinking.get("budget_tokens")
    if budget is None:
        return {}
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise FieldError(f"thinking.budget_tokens must be a non-negative integer (got {budget!r})", "thinking.budget_tokens")
    return {"thinking_token_budget": budget}


def _output_config(config: dict | None) -> dict:
    """output_config's format (a JSON schema the answer follows: chat's response_format) and effort (chat's
    reasoning_effort; xhigh and max are harmony's high, its largest)."""
    out: dict = {}
    fmt = (config or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise FieldError("output_config.format must be {'type': 'json_schema', 'schema': {...}}", "output_config.format")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    effort = (config or {}).get("effort")
    if effort is not None:
        out["reasoning_effort"] = {"xhigh": "high", "max": "high"}.get(effort, effort)
    return out


def _system(system: str | list | None) -> list[dict]:
    if system is None or system == "" or system == []:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in system):
        return [{"role": "system", "content": "\n".join(b["text"] for b in system)}]
    raise FieldError("system must be a string or a list of text blocks", "system")


def _messages(message: Any, i: int) -> list[dict]:
    """One Anthropic message as chat messages: a user turn's tool_result blocks are tool messages (before its
    other content), an assistant turn's tool_use blocks its tool_calls and thinking blocks its reasoning."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise FieldError(f"messages.{i} must be an object with role 'user' or 'assistant'", f"messages.{i}.role")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise FieldError(f"messages.{i}.content must be a string or a list of content blocks", f"messages.{i}.content")
    parts, calls, tools, thinking = [], [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"messages.{i}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append(_image(block, where))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise FieldError(f"{where}: a tool_use block needs a string id and name", where)
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append({"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise FieldError(f"{where}: a tool_result block needs a string tool_use_id", where)
            tools.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": _result_text(block.get("content"), where)})
        elif kind == "thinking" and role == "assistant":
            thinking.append(str(block.get("thinking") or ""))
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted by another provider: nothing this model can read
        else:
            raise FieldError(f"{where}.type {kind!r} is not supported in a {role} message", f"{where}.type")
    out = list(tools)
    if role == "assistant":
        text = "".join(p["text"] for p in parts)
        message = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        return out + [message]
    if parts:
        texts_only = all(p["type"] == "text" for p in parts)
        out.append({"role": "user", "content": "\n".join(p["text"] for p in parts) if texts_only else parts})
    return out


def _image(block: dict, where: str) -> dict:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return {"type": "image_url", "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise FieldError(f"{where}.source must be {{'type': 'base64', 'media_type', 'data'}} or {{'type': 'url', 'url'}}", f"{where}.source")


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise FieldError(f"{where}.content must be a string or text blocks (images in tool results are not supported)", f"{where}.content")


def _chat_tool(tool: Any, i: int) -> dict:
    """An Anthropic client tool ({"name", "description", "input_schema"}) in chat's function form; server tools
    (web search, code execution: a `type` other than "custom") are refused."""
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise FieldError(f"tools.{i}.type {kind!r} is not supported: this server runs client tools only", f"tools.{i}.type")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise FieldError(f"tools.{i}.name must be a non-empty string", f"tools.{i}.name")
    fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}
    if tool.get("description"):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: dict) -> str | dict:
    """auto, any (chat's required), none, or {"type": "tool", "name"} (a named function)."""
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise FieldError("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': str}", "tool_choice")


def renamed(param: str | None, message: str) -> tuple[str | None, str]:
    """A chat field as the Anthropic field it came from (chat's message indices are not the request's)."""
    if not param:
        return param, message
    head = param.partition(".")[0]
    new = "messages" if head == "messages" else RENAMED.get(head)  # (tools, tool_choice: the same names)
    if new is None or new == param:
        return param, message
    return new, rename_field(rename_field(message, param, new), head, new)

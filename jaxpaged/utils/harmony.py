"""GPT-OSS's chat prompts in OpenAI's harmony format, rendered by the `openai-harmony` package (as vLLM does for
gpt-oss), not by the checkpoint's Jinja template.

A conversation becomes harmony messages: a system message (the model identity, the reasoning effort, the knowledge
cutoff and today's date, the valid channels: `commentary` only when there are tools); a developer message with the
request's system and developer messages as its instructions and the tools as the `functions` namespace; the user
messages; earlier assistant turns, their reasoning (`reasoning_content` or `reasoning`) on the analysis channel,
their answer on the final channel and each tool call as a commentary message to `functions.NAME`; tool results as
messages from `functions.NAME` to the assistant on the commentary channel. openai-harmony renders that for the
assistant's completion (`<|start|>assistant` last); the ids are harmony's vocabulary, which is GPT-OSS's (o200k_harmony),
so they go to the engine as they are. `stop_token_ids()` (harmony's `<|return|>` and `<|call|>`) end generation.

harmony's vocabulary (o200k_base.tiktoken) is read from an installed litellm wheel's copy when there is one (checked
by its SHA-256, as openai-harmony checks it too), so nothing is downloaded; otherwise openai-harmony downloads it
once, or reads it from $TIKTOKEN_ENCODINGS_BASE. This module needs neither the server nor its packages: the engine
renders GPT-OSS's chat prompts (LLM.chat, the server, the generate CLI) through it, and the server's gpt_oss
reasoning parser (entrypoints/openai/reasoning.py) reads the outputs with the same encoding.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

from jaxpaged.utils.extras import require

_ENCODING = None
# o200k_base.tiktoken, the vocabulary of harmony's encoding: its SHA-256, which openai-harmony checks too
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# litellm's wheel ships the file as a tiktoken cache entry, named by the SHA-1 of its public address: the name
# openai-harmony's own cache gives it, so pointing TIKTOKEN_RS_CACHE_DIR at its folder loads it without a download
BUNDLED_O200K = ("litellm", "litellm/litellm_core_utils/tokenizers/fb374d419588a4632f3f557e76b4b70aebbca790")


def bundled_vocabulary() -> Path | None:
    """The folder of an installed copy of o200k_base.tiktoken with harmony's SHA-256 (litellm's), or None."""
    package, file = BUNDLED_O200K
    try:
        path = Path(importlib.metadata.distribution(package).locate_file(file))  # found, not imported
    except importlib.metadata.PackageNotFoundError:
        return None
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != O200K_SHA256:
        return None
    return path.parent


@contextlib.contextmanager
def _environment(**values: str):
    """os.environ with `values` set, as it was afterwards."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def harmony_encoding(purpose: str = "the gpt_oss reasoning parser"):
    """openai-harmony's gpt-oss encoding, loaded once; a clear error (naming `purpose`) when the package or its
    vocabulary is missing. The vocabulary: the folder in $TIKTOKEN_ENCODINGS_BASE when set, else an installed
    litellm's copy (no download), else openai-harmony's cache or download."""
    global _ENCODING
    if _ENCODING is None:
        harmony = require("openai_harmony", purpose)
        folder = None if "TIKTOKEN_ENCODINGS_BASE" in os.environ else bundled_vocabulary()
        try:
            with _environment(**({"TIKTOKEN_RS_CACHE_DIR": str(folder)} if folder else {})):
                _ENCODING = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
        except Exception as exc:  # noqa: BLE001 - HarmonyError: it downloads o200k_base.tiktoken on first use
            raise ValueError(
                f"{purpose} could not load openai-harmony's vocabulary ({exc}); it is downloaded "
                "on first use, read from the folder in TIKTOKEN_ENCODINGS_BASE, or from an installed litellm's "
                "copy (pip install --no-deps litellm) when offline"
            ) from None
    return _ENCODING


CHAT_FORMAT = "GPT-OSS's harmony chat format"  # what needs openai-harmony, in its errors
REASONING_EFFORTS = ("low", "medium", "high")
HARMONY_ARCHITECTURES = ("GptOssForCausalLM",)


def uses_harmony(architecture: str | None) -> bool:
    """Whether a model of this architecture takes its chat prompts in harmony (GPT-OSS)."""
    return architecture in HARMONY_ARCHITECTURES


def check_reasoning_effort(value: Any) -> str | None:
    """`value` when it is None or one of REASONING_EFFORTS; ValueError naming reasoning_effort otherwise."""
    if value is not None and value not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)} (got {value!r})")
    return value


def stop_token_ids() -> list[int]:
    """The tokens that end an assistant's turn in harmony: `<|return|>` (an answer) and `<|call|>` (a tool call)."""
    return list(harmony_encoding(CHAT_FORMAT).stop_tokens_for_assistant_actions())


def _text(content: Any) -> str:
    """A message's content as text: a string, or a list of OpenAI text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    return str(content)


def _arguments(arguments: Any) -> str:
    """A tool call's arguments as JSON text (the server's protocol parses them into an object)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def system_message(reasoning_effort: str | None = None, tools: bool = False, start_date: str | None = None):
    """harmony's system message: its default identity and knowledge cutoff, the effort (medium unless given), the
    conversation's start date (today unless given), and `commentary` among the channels only with tools."""
    h = require("openai_harmony", CHAT_FORMAT)
    effort = {"low": h.ReasoningEffort.LOW, "medium": h.ReasoningEffort.MEDIUM, "high": h.ReasoningEffort.HIGH}
    content = (
        h.SystemContent.new()
        .with_reasoning_effort(effort[check_reasoning_effort(reasoning_effort) or "medium"])
        .with_conversation_start_date(start_date or datetime.date.today().isoformat())
    )
    if not tools:
        channels = [c for c in content.channel_config.valid_channels if c != "commentary"]
        content = content.with_channel_config(h.ChannelConfig.require_channels(channels))
    return h.Message.from_role_and_content(h.Role.SYSTEM, content)


def developer_message(instructions: str | None, tools: list[dict] | None):
    """The developer message: the request's instructions and its function tools, or None when it has neither."""
    h = require("openai_harmony", CHAT_FORMAT)
    if not instructions and not tools:
        return None
    content = h.DeveloperContent.new()
    if instructions:
        content = content.with_instructions(instructions)
    if tools:
        functions = [t.get("function", t) for t in tools]
        content = content.with_function_tools([
            h.ToolDescription.new(f["name"], f.get("description") or "", parameters=f.get("parameters") or None)
            for f in functions
        ])  # fmt: skip
    return h.Message.from_role_and_content(h.Role.DEVELOPER, content)


def conversation_messages(messages: list[dict]) -> list:
    """The harmony messages of an OpenAI conversation's user, assistant and tool turns (system and developer
    messages go to the developer message: `instructions()`)."""
    h = require("openai_harmony", CHAT_FORMAT)
    out = []
    names: dict[str, str] = {}  # tool_call_id -> the function it called, for the tool results that answer it
    for m in messages:
        role = m.get("role")
        if role in ("system", "developer"):
            continue
        if role == "user":
            out.append(h.Message.from_role_and_content(h.Role.USER, _text(m.get("content"))))
        elif role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if reasoning:
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, reasoning).with_channel("analysis"))
            for call in m.get("tool_calls") or ():
                fn = call.get("function", {})
                if call.get("id"):
                    names[call["id"]] = fn["name"]
                out.append(
                    h.Message.from_role_and_content(h.Role.ASSISTANT, _arguments(fn.get("arguments", {})))
                    .with_channel("commentary").with_recipient(f"functions.{fn['name']}")
                    .with_content_type("<|constrain|>json")
                )  # fmt: skip
            content = _text(m.get("content"))
            if content or not (reasoning or m.get("tool_calls")):
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, content).with_channel("final"))
        elif role == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id") or "")
            if not name:
                raise ValueError(
                    "messages: a tool message must answer an earlier tool call (its tool_call_id) or name it"
                )
            author = h.Author.new(h.Role.TOOL, f"functions.{name}")
            out.append(
                h.Message.from_author_and_content(author, _text(m.get("content")))
                .with_recipient("assistant").with_channel("commentary")
            )  # fmt: skip
        else:
            raise ValueError(f"messages: role {role!r} has no harmony form")
    return out


def instructions(messages: list[dict]) -> str | None:
    """The text of the conversation's system and developer messages, for the developer message."""
    texts = [_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")]
    return "\n\n".join(t for t in texts if t) or None


def harmony_conversation(
    messages: list[dict],
    tools: list[dict] | None = None,
    reasoning_effort: str | None = None,
    start_date: str | None = None,
):
    """The openai-harmony Conversation of an OpenAI chat request."""
    h = require("openai_harmony", CHAT_FORMAT)
    head = [system_message(reasoning_effort, tools=bool(tools), start_date=start_date)]
    developer = developer_message(instructions(messages), tools)
    head += [developer] if developer is not None else []
    return h.Conversation.from_messages(head + conversation_messages(messages))


def render_harmony_prompt(
    messages: list[dict],
    tools: list[dict] | None = None,
    reasoning_effort: str | None = None,
    add_generation_prompt: bool = True,
    start_date: str | None = None,
) -> list[int]:
    """The prompt's token ids: the conversation rendered by openai-harmony for the assistant's completion (or as it
    is, without `<|start|>assistant`, when add_generation_prompt is false). ValueError for a conversation harmony
    cannot render."""
    h = require("openai_harmony", CHAT_FORMAT)
    conversation = harmony_conversation(messages, tools, reasoning_effort, start_date)
    encoding = harmony_encoding(CHAT_FORMAT)
    try:
        if add_generation_prompt:
            return list(encoding.render_conversation_for_completion(conversation, h.Role.ASSISTANT))
        return list(encoding.render_conversation(conversation))
    except Exception as exc:  # HarmonyError: a message it cannot render
        raise ValueError(f"messages could not be rendered in the harmony format: {exc}") from exc


def render_harmony_chat(prompt) -> list[int]:
    """A ChatPrompt (utils/text.py) rendered in harmony: its reasoning_effort, else the one its template_kwargs give
    (the variable gpt-oss's own chat template reads)."""
    effort = prompt.reasoning_effort or (prompt.template_kwargs or {}).get("reasoning_effort")
    return render_harmony_prompt(
        prompt.messages, prompt.tools, check_reasoning_effort(effort), prompt.add_generation_prompt
    )

"""A conversation as prompt token ids, through the tokenizer's chat template (GPT-OSS's through openai-harmony:
utils/harmony.py, which the engine picks by the model's architecture)."""

from __future__ import annotations

import dataclasses

NO_TEMPLATE = ("this model's tokenizer has no chat template (a base model?): give one with --chat-template (the server, "
               "generate --chat), chat_template= (LLM.chat) or, on a server started with --trust-request-chat-template, "
               "the request's chat_template")

def chat_prompt_ids(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
    template_kwargs: dict | None = None, continue_final_message: bool = False, chat_template: str | None = None,
) -> list[int]:
    """`tools` (OpenAI tool dicts) reach the template as transformers' `tools`; templates without tool support
    ignore them. `template_kwargs` are more template variables (e.g. enable_thinking). continue_final_message: the
    prompt ends inside the last (assistant) message, which the model then continues (vLLM's, transformers').
    chat_template: a template's Jinja text used instead of the tokenizer's (vLLM's --chat-template)."""
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(NO_TEMPLATE)
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    if continue_final_message:
        extra["continue_final_message"] = True
    if chat_template:
        extra["chat_template"] = chat_template
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **extra)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def join_text_parts(messages: list[dict]) -> list[dict]:
    """The messages, each whose content is a list of OpenAI text parts only ([{"type": "text", "text": ...}]) with
    that text as one string, the parts joined by newlines, as vLLM's LLM.chat gives a template that reads a string
    (most do: SmolLM2's concatenates it). Other messages, those with images among them, are left as they are."""
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
        ):
            message = {**message, "content": "\n".join(p["text"] for p in content)}
        out.append(message)
    return out


@dataclasses.dataclass
class ChatPrompt:
    """A conversation as a prompt: the engine renders it through the chat template when it adds the request
    (on the thread that owns the tokenizer)."""

    messages: list[dict]
    add_generation_prompt: bool = True
    tools: list[dict] | None = None  # OpenAI tool dicts, for templates that describe tools to the model
    template_kwargs: dict | None = None  # more variables for the template (a request's chat_template_kwargs)
    reasoning_effort: str | None = None  # "low", "medium" or "high": GPT-OSS's harmony system message (a template's variable otherwise)
    continue_final_message: bool = False  # the prompt ends inside the last message, not after it (vLLM's LLM.chat)
    chat_template: str | None = None  # Jinja text used instead of the tokenizer's template (vLLM's --chat-template)
    mm_processor_kwargs: dict | None = None  # image processor settings for this conversation's images (vLLM's)


def render_chat_prompt(tokenizer, prompt: ChatPrompt) -> list[int]:
    """The conversation's token ids; ValueError naming `messages` when there is no template or it fails."""
    if tokenizer is None:
        raise ValueError("messages: this model has no tokenizer, so it has no chat template")
    try:
        kwargs = {**(prompt.template_kwargs or {}), **({"reasoning_effort": prompt.reasoning_effort} if prompt.reasoning_effort else {})}
        return chat_prompt_ids(tokenizer, prompt.messages, prompt.add_generation_prompt, prompt.tools, kwargs or None,
                               prompt.continue_final_message, prompt.chat_template)  # fmt: skip
    except ValueError:
        raise
    except Exception as exc:  # a template's own raise_exception(), or a message it cannot render
        raise ValueError(f"messages could not be rendered by the chat template: {exc}") from exc

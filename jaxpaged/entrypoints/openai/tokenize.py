"""vLLM's POST /tokenize and /detokenize: a prompt (or a conversation, through the chat template, as /v1/chat/completions
renders it) to token ids, and token ids back to text, with the served model's tokenizer."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import field_validator, model_validator
from starlette.requests import Request

from jaxpaged.entrypoints.openai import errors
from jaxpaged.entrypoints.openai.protocol import ChatMessage, _Strict, check_template_kwargs, conversation
from jaxpaged.entrypoints.openai.serving import Serving
from jaxpaged.utils.text import ChatPrompt


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # a prompt's (the chat template places a conversation's itself)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: the request's own template (--trust-request-chat-template)
    return_token_strs: bool = False

    _template_kwargs = field_validator("chat_template_kwargs")(classmethod(check_template_kwargs))

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt or messages must be given (one of them)")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


async def _parse(serving: Serving, request: Request, model):
    body = await serving.parse(request, model)
    if serving.tokenizer is None:
        raise errors.bad_request("this model has no tokenizer")
    return body


def add_routes(app: FastAPI, serving: Serving) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request):
        body: TokenizeRequest = await _parse(serving, request, TokenizeRequest)
        tokenizer = serving.tokenizer
        if body.prompt is not None:
            ids = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        else:
            if any(isinstance(m.content, list) for m in body.messages):
                raise errors.bad_request("/tokenize takes text messages only (no image parts)", param="messages")
            prompt = ChatPrompt(conversation(body.messages), body.add_generation_prompt, body.tools or None, body.chat_template_kwargs,
                                continue_final_message=body.continue_final_message,
                                chat_template=serving.template_for(body.chat_template))  # fmt: skip
            try:
                _, ids = serving.engine.engine._prompt_ids(prompt)  # rendered as /v1/chat/completions renders it
            except ValueError as exc:
                raise errors.bad_request(str(exc), param="messages") from None
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": serving.engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body: DetokenizeRequest = await _parse(serving, request, DetokenizeRequest)
        vocab = len(serving.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise errors.bad_request(f"tokens must lie in [0, {vocab}) (got {bad[0]})", param="tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens)}

"""Request bodies of the pooling endpoints, as vLLM's: /v1/embeddings (OpenAI's, with vLLM's extras and chat form),
/pooling, /classify, /score and /rerank. Strict as the generation requests (protocol.py); PoolingParams checks the values."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator, model_validator

from jaxpaged.entrypoints.openai.protocol import ChatMessage, _Strict, check_template_kwargs, conversation, prompt_input
from jaxpaged.pooling_params import PoolingParams
from jaxpaged.utils.text import ChatPrompt

MAX_INPUTS = 2048  # OpenAI's cap on one embeddings request's inputs


def _texts(value) -> list[str]:
    """A non-empty string or a non-empty list of them (pydantic names the field)."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise ValueError("must be a non-empty string or a non-empty list of non-empty strings")
    if len(texts) > MAX_INPUTS:
        raise ValueError(f"may hold at most {MAX_INPUTS} texts (got {len(texts)})")
    return texts


class _PoolingRequest(_Strict):
    model: str | None = None  # vLLM's: optional, the served model
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    activation: bool | None = None  # a classifier's softmax or sigmoid (vLLM's older name)
    use_activation: bool | None = None  # vLLM's newer name
    priority: int = 0  # vLLM's: lower is served first under scheduling_policy "priority"

    def params(self, **kwargs) -> PoolingParams:
        """PoolingParams for this request; its ValueError names the field."""
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens, activation=self.activation,
                             use_activation=self.use_activation, **kwargs)  # fmt: skip


class _InputRequest(_PoolingRequest):
    input: Any = None
    add_special_tokens: bool | None = None  # None: True for input, False for messages (the template places them)

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value):
        return None if value is None else prompt_input(value, MAX_INPUTS)

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return list(self.input)


class EmbeddingRequest(_InputRequest):
    """OpenAI's (input, encoding_format, dimensions, user), vLLM's extras, and vLLM's chat form (messages)."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: the request's own template (--trust-request-chat-template)

    _template_kwargs = field_validator("chat_template_kwargs")(classmethod(check_template_kwargs))

    @model_validator(mode="after")
    def _one_input(self):
        if (self.input is None) == (self.messages is None):
            raise ValueError("input or messages must be given (one of them)")
        if self.messages is not None:
            if not self.messages:
                raise ValueError("messages must not be empty")
            if self.add_special_tokens:
                raise ValueError("add_special_tokens is not supported with messages (the chat template places them)")
            if self.continue_final_message and self.add_generation_prompt:
                raise ValueError("continue_final_message needs add_generation_prompt false")
        return self

    def chat_prompt(self, chat_template: str | None = None) -> ChatPrompt:
        """chat_template: the one the server chose (Serving.template_for), None the model's."""
        return ChatPrompt(conversation(self.messages), self.add_generation_prompt, None, self.chat_template_kwargs,
                          continue_final_message=self.continue_final_message, chat_template=chat_template)  # fmt: skip

    def params(self) -> PoolingParams:
        """use_activation is vLLM's newer name for an embedding's normalize."""
        normalize = self.normalize
        if self.use_activation is not None:
            if normalize is not None and normalize != self.use_activation:
                raise ValueError("normalize and use_activation disagree; pass one")
            normalize = self.use_activation
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens, dimensions=self.dimensions,
                             normalize=normalize, activation=self.activation, task="embed")  # fmt: skip


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: any task the model serves (task; none: the model's own), input or messages as /v1/embeddings',
    the embedding fields for an embedding task, activation for a classifier's, step_tag_id and returned_token_ids
    for STEP pooling."""

    task: str | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None

    def params(self, default_task: str) -> PoolingParams:
        """use_activation: an embedding's normalize, a classifier's activation (vLLM's one name for both)."""
        task = self.task or default_task
        embeds = task in ("embed", "token_embed")
        normalize, activation = self.normalize, self.activation
        if self.use_activation is not None:
            current = normalize if embeds else activation
            if current is not None and current != self.use_activation:
                raise ValueError(f"{'normalize' if embeds else 'activation'} and use_activation disagree; pass one")
            normalize, activation = (self.use_activation, activation) if embeds else (normalize, self.use_activation)
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens, dimensions=self.dimensions,
                             normalize=normalize, activation=activation, task=task, step_tag_id=self.step_tag_id,
                             returned_token_ids=self.returned_token_ids)  # fmt: skip


class ClassificationRequest(_InputRequest):
    @model_validator(mode="after")
    def _has_input(self):
        if self.input is None:
            raise ValueError("input must be given")
        return self

    def params(self) -> PoolingParams:
        return super().params(task="classify")


class ScoreRequest(_PoolingRequest):
    text_1: Any
    text_2: Any

    @field_validator("text_1", "text_2", mode="before")
    @classmethod
    def _text(cls, value):
        return _texts(value)

    @model_validator(mode="after")
    def _pairs(self):
        if len(self.text_1) not in (1, len(self.text_2)):
            raise ValueError(f"text_1 must hold one text or as many as text_2 (got {len(self.text_1)} and {len(self.text_2)})")
        return self


class RerankRequest(_PoolingRequest):
    query: str
    documents: Any
    top_n: int | None = None  # 0 or None: every document

    @field_validator("documents", mode="before")
    @classmethod
    def _documents(cls, value):
        if isinstance(value, str):
            raise ValueError("must be a list of strings")
        return _texts(value)

    @field_validator("query")
    @classmethod
    def _query(cls, value):
        if not value:
            raise ValueError("must not be empty")
        return value

    @field_validator("top_n")
    @classmethod
    def _top_n(cls, value):
        if value is not None and value < 0:
            raise ValueError(f"must be >= 0 (got {value})")
        return value

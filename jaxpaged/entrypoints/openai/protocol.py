"""Request bodies of the OpenAI API, as pydantic models.

Types are strict (a string is not a number, 2.0 is not an int) because a silently coerced
field is a request the client did not mean. Value ranges are not checked here: `SamplingParams`
owns them, and the server turns its ValueErrors into 400s. Fields OpenAI has but this engine
does not implement are refused when set, rather than ignored; unknown fields are ignored, as
vLLM does, so clients that send extras keep working.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from jaxpaged.entrypoints.openai.errors import FieldError, rename_constraint
from jaxpaged.sampling_params import STRUCTURED_OUTPUT_KINDS, STRUCTURED_OUTPUT_OPTIONS, SamplingParams, StructuredOutputsParams
from jaxpaged.utils.harmony import check_reasoning_effort

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_PROMPTS = 128  # prompts in one completions request
# apply_chat_template's own arguments, which the request's fields set
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "documents", "add_generation_prompt", "tokenize",
                            "chat_template", "continue_final_message", "return_dict", "return_tensors")


def check_template_kwargs(cls, value):
    """chat_template_kwargs may not set what the request sets itself."""
    taken = sorted(set(value or ()) & set(RESERVED_TEMPLATE_KWARGS))
    if taken:
        raise ValueError(f"{taken[0]!r} is set by the request itself, not through chat_template_kwargs")
    return value


def _null_is_default(cls, value, info: ValidationInfo):
    """A before-validator for fields OpenAI's spec lets be null (n, echo, chat's logprobs; the openai client sends
    null for a None argument): null means the default, as in vLLM."""
    return cls.model_fields[info.field_name].default if value is None else value


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    # request fields this server does not implement, with the value that asks for nothing: another value is refused
    # (dropped as an unknown field, it would change the output without a word)
    UNSUPPORTED: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name, inert in cls.UNSUPPORTED.items():
                if data.get(name) not in (None, inert):
                    raise ValueError(f"{name} is not supported by this server")
        return data


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_Strict):
    """Fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Any = None  # SamplingParams checks its type, count and lengths
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Any = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    spaces_between_special_tokens: bool = True
    thinking_token_budget: int | None = None  # vLLM's: a reasoning model's thinking capped, its end marker forced
    prompt_logprobs: int | None = None  # vLLM's: non-streaming responses carry them
    priority: int = 0  # vLLM's: lower is served first under --scheduling-policy priority (else only 0 is accepted)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs object and its older guided_* fields
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM's beam search: the n best of n beams (width best_of on completions), sent whole when the search ends
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Any = False  # older vLLM's (transformers'): True, False or "never"; SamplingParams checks it

    _null_n = field_validator("n", mode="before")(classmethod(_null_is_default))

    @model_validator(mode="after")
    def _check(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream: true (as in vLLM)")
        if not self.use_beam_search:
            for name, inert in (("length_penalty", 1.0), ("early_stopping", False)):
                if getattr(self, name) != inert:  # (it would change nothing: refused, not ignored)
                    raise ValueError(f"{name} is only used by beam search: set use_beam_search true, or leave it out")
        return self

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's token-id strings as ints, each bias clamped to [-100, 100] (as vLLM's server does)."""
        if not self.logit_bias:
            return None
        bias = {}
        for token, value in self.logit_bias.items():
            try:
                bias[int(token)] = min(100.0, max(-100.0, value))
            except ValueError:
                raise FieldError(f"logit_bias's keys must be token ids (got {token!r})", "logit_bias") from None
        return bias

    def sampling_kwargs(self, defaults: dict | None = None) -> dict[str, Any]:
        """SamplingParams' arguments; None means the default: the model's (`defaults`, its generation config's, as
        vLLM's server takes them), else SamplingParams'."""
        values = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "seed": self.seed, "stop": self.stop,
            "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens, "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": self._logit_bias(), "allowed_token_ids": self.allowed_token_ids, "bad_words": self.bad_words,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "thinking_token_budget": self.thinking_token_budget,
        }
        chosen = {k: v for k, v in (defaults or {}).items() if k != "max_tokens"}
        if self.use_beam_search:  # beams rank by the model's logprobs: the model's sampling defaults do not apply
            if self.temperature not in (None, 0):
                raise FieldError(f"temperature must be 0 or unset with use_beam_search (beams are ranked by the model's "
                                 f"logprobs; got {self.temperature!r})", "temperature")  # fmt: skip
            chosen = {"temperature": 0.0, "use_beam_search": True, "length_penalty": self.length_penalty,
                      "early_stopping": self.early_stopping}  # fmt: skip
        return chosen | {k: v for k, v in values.items() if v is not None}

    def _constraints(self) -> list[tuple[str, dict[str, Any]]]:
        """(request field, StructuredOutputsParams' arguments) for each constraint the body sets; a malformed
        response_format or structured_outputs raises FieldError naming the field."""
        found = []
        rf = self.response_format
        if rf is not None:
            if not isinstance(rf, dict):
                raise FieldError("response_format must be an object with a 'type'", "response_format")
            kind = rf.get("type")
            if kind == "json_object" and rf.get("schema") is not None:  # as Together's API (and older instructors) send it
                if not isinstance(rf["schema"], dict):
                    raise FieldError(
                        f"response_format.schema must be a JSON schema object (got {type(rf['schema']).__name__})",
                        "response_format.schema",
                    )
                found.append(("response_format.schema", {"json": rf["schema"]}))
            elif kind == "json_object":
                found.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict):
                    raise FieldError("response_format.json_schema must be an object with a 'schema'", "response_format.json_schema")
                schema = spec.get("schema")
                if not isinstance(schema, dict):
                    raise FieldError(
                        f"response_format.json_schema.schema must be a JSON schema object (got {type(schema).__name__})",
                        "response_format.json_schema.schema",
                    )
                found.append(("response_format.json_schema.schema", {"json": schema}))
            elif kind != "text":
                raise FieldError(
                    f"response_format.type must be one of text, json_object, json_schema (got {kind!r})", "response_format.type"
                )
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, dict):
                raise FieldError("structured_outputs must be an object", "structured_outputs")
            unknown = sorted(set(so) - set(STRUCTURED_OUTPUT_KINDS) - set(STRUCTURED_OUTPUT_OPTIONS))
            if unknown:
                raise FieldError(
                    f"structured_outputs.{unknown[0]} is not supported (set one of {', '.join(STRUCTURED_OUTPUT_KINDS)})",
                    f"structured_outputs.{unknown[0]}",
                )
            given = [k for k in STRUCTURED_OUTPUT_KINDS if so.get(k) not in (None, False)]
            found.append((f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs", dict(so)))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):  # fmt: skip
            if getattr(self, name) is not None:
                found.append((name, {kind: getattr(self, name)}))
        if len(found) > 1:
            raise FieldError(
                f"{found[1][0]} cannot be combined with {found[0][0]}: set one output constraint", found[1][0].split(".")[0]
            )
        return found

    @property
    def constraint_field(self) -> str | None:
        """The request field the output constraint came from, to name it in errors."""
        try:
            found = self._constraints()
        except FieldError:  # reported by structured_outputs_params, when the sampling params are built
            return None
        return found[0][0] if found else None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        found = self._constraints()
        if not found:
            return None
        field, kwargs = found[0]
        try:
            return StructuredOutputsParams(**kwargs)
        except ValueError as exc:
            raise FieldError(rename_constraint(str(exc), field), field) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: every chunk carries the usage so far (with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest):
    prompt: Any = None  # required unless prompt_embeds is given
    # vLLM's: base64 of torch.save'd [T, hidden] tensors, one or a list (servers started with --enable-prompt-embeds)
    prompt_embeds: Any = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    _null_echo = field_validator("echo", mode="before")(classmethod(_null_is_default))

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value):
        return None if value is None else prompt_input(value, MAX_PROMPTS)

    @field_validator("prompt_embeds", mode="before")
    @classmethod
    def _prompt_embeds(cls, value):
        if value is None:
            return None
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise ValueError("must be a base64 string or a non-empty list of them")
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"may hold at most {MAX_PROMPTS} prompts (got {len(value)})")
        return value

    @model_validator(mode="after")
    def _unsupported(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.prompt is None and self.prompt_embeds is None:
            raise ValueError("prompt is required (or prompt_embeds, on a server started with --enable-prompt-embeds)")
        return self

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0 scores the prompt (as vLLM allows): one token is generated and dropped."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The text and token-id prompts (none where only prompt_embeds is given)."""
        if self.prompt is None:
            return []
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """defaults: the model's generation config defaults (vLLM's), its max_new_tokens a cap on max_tokens."""
        prompt_logprobs = self.logprobs if self.echo else None  # echo lists the prompt tokens' logprobs too
        if self.prompt_logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.prompt_logprobs)
        max_tokens = 1 if self.prompt_only else capped_max_tokens(self.max_tokens, defaults)
        return SamplingParams(
            max_tokens=max_tokens, logprobs=self.logprobs, prompt_logprobs=prompt_logprobs,
            best_of=self.best_of, structured_outputs=self.structured_outputs_params(), **self.sampling_kwargs(defaults),
        )


def capped_max_tokens(max_tokens: int | None, defaults: dict | None) -> int | None:
    """A request's max_tokens under the model's max_new_tokens, as vLLM's server takes the smaller of the two."""
    cap = (defaults or {}).get("max_tokens")
    return cap if max_tokens is None else (max_tokens if cap is None else min(max_tokens, cap))


def prompt_input(value, limit: int):
    """A string, a list of strings, a list of token ids or a list of token-id lists (OpenAI's prompt and input), with
    at most `limit` prompts; ValueError (pydantic's, on the field) otherwise."""
    err = ValueError
    if isinstance(value, str):
        if not value:
            raise err("must not be empty")
        return value
    if not isinstance(value, list) or not value:
        raise err("must be a non-empty string, list of strings, list of token ids, or list of token-id lists")
    if len(value) > limit and not all(_is_token(t) for t in value):
        raise err(f"may hold at most {limit} prompts (got {len(value)})")
    if all(_is_token(t) for t in value):
        return [int(t) for t in value]
    if all(isinstance(p, str) for p in value):
        if not all(value):
            raise err("strings must not be empty")
        return list(value)
    if all(isinstance(p, list) for p in value):
        for p in value:
            if not p or not all(_is_token(t) for t in p):
                raise err("token-id lists must be non-empty lists of integers")
        return [[int(t) for t in p] for p in value]
    raise err("must be a string, a list of strings, a list of token ids, or a list of token-id lists")


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ChatMessage(_Strict):
    role: str
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call
    reasoning_content: str | None = None  # an assistant's earlier thinking (GPT-OSS: its analysis message)
    reasoning: str | None = None  # the same, by the name newer clients send
    content: str | list[dict] | None = Field(None, validate_default=True)  # last: its check reads the fields above

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        if value not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)} (got {value!r})")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, value):
        """As the templates want them: `arguments` parsed into an object (vLLM does the same)."""
        if value is None:
            return None
        calls = []
        for call in value:
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
                raise ValueError("tool_calls must be [{'id': str, 'type': 'function', 'function': {'name': str, 'arguments': str}}]")
            try:
                arguments = json.loads(fn["arguments"])
            except ValueError:
                raise ValueError(f"tool_calls: the arguments of {fn['name']!r} are not JSON") from None
            calls.append({**call, "function": {**fn, "arguments": arguments}})
        return calls

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value, info: ValidationInfo):
        if value is None:
            if info.data.get("role") == "assistant" and info.data.get("tool_calls"):
                return None
            raise ValueError("content must be a string or a list of text parts")
        if isinstance(value, list):
            texts, media = [], False
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image_url", "video_url"):  # OpenAI's image part, vLLM's video part: {kind: {"url": ...}}
                    url = part.get(kind)
                    url = url.get("url") if isinstance(url, dict) else url
                    if not isinstance(url, str) or not url:
                        raise ValueError(f"{kind} parts must be {{'type': '{kind}', '{kind}': {{'url': str}}}}")
                    media = True
                elif kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("content parts must be {'type': 'text', 'text': str}, {'type': 'image_url', "
                                     "'image_url': {'url': str}} or {'type': 'video_url', 'video_url': {'url': str}}; "
                                     "other kinds are not supported")  # fmt: skip
                else:
                    texts.append(part["text"])
            # with images or videos the parts stay as they are, for the model's processor (jaxpaged/multimodal/);
            # else one text, the parts joined by newlines as vLLM's server joins them
            return value if media else "\n".join(texts)
        return value


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the prompt ends inside the last (assistant) message, continued
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the template (enable_thinking)
    reasoning_effort: str | None = None  # OpenAI's: "low", "medium" or "high" (GPT-OSS's harmony system message)
    chat_template: str | None = None  # vLLM's: the request's own template, on a --trust-request-chat-template server
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's: image processor settings for this request's images
    UNSUPPORTED: ClassVar[dict[str, Any]] = {**_SamplingRequest.UNSUPPORTED, "echo": False}  # and vLLM's chat echo

    _null_logprobs = field_validator("logprobs", mode="before")(classmethod(_null_is_default))

    @field_validator("messages")
    @classmethod
    def _messages(cls, value):
        if not value:
            raise ValueError("messages must not be empty")
        return value

    @field_validator("reasoning_effort")
    @classmethod
    def _reasoning_effort(cls, value):
        return check_reasoning_effort(value)

    _template_kwargs = field_validator("chat_template_kwargs")(classmethod(check_template_kwargs))

    @model_validator(mode="after")
    def _unsupported(self):
        self._check_tools()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false (the prompt ends inside the last "
                             "message, not with a new one)")  # fmt: skip
        return self

    def _check_tools(self) -> None:
        """tools: OpenAI's function list; tool_choice: "none", "auto" (the default with tools), "required", or a
        named function. Whether "auto" can be served depends on the model (the server checks that)."""
        names = []
        for i, tool in enumerate(self.tools or []):
            fn = tool.get("function")
            if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tools.{i} must be {{'type': 'function', 'function': {{'name': str, 'parameters': object}}}}")
            if not isinstance(fn.get("parameters", {}), dict):
                raise ValueError(f"tools.{i}.function.parameters must be a JSON schema object")
            names.append(fn["name"])
        choice = self.tool_choice
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
            if not isinstance(name, str):
                raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': str}}")
            if name not in names:
                raise ValueError(f"tool_choice names the function {name!r}, which tools does not hold")
        elif choice not in (None, "none", "auto", "required"):
            raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function (got {choice!r})")
        elif choice in ("auto", "required") and not names:
            raise ValueError(f"tool_choice {choice!r} needs tools")

    @property
    def tool_mode(self) -> str | None:
        """None (no tool calls), "auto" (read from the text), "required", or the name of the function that must
        be called."""
        if not self.tools or self.tool_choice == "none":
            return None
        if self.tool_choice in (None, "auto", "required"):
            return self.tool_choice or "auto"
        return self.tool_choice["function"]["name"]

    def _functions(self) -> dict[str, dict]:
        """Each function's name and its parameters' schema (no parameters: an empty object)."""
        empty = {"type": "object", "properties": {}, "additionalProperties": False}
        return {t["function"]["name"]: t["function"].get("parameters") or empty for t in self.tools or []}

    def tool_schema(self) -> dict | None:
        """The JSON schema the output must follow: a named function's parameters, or for "required" a non-empty
        array of {"name", "parameters"} calls (as vLLM)."""
        mode = self.tool_mode
        if mode in (None, "auto"):
            return None
        functions = self._functions()
        if mode != "required":
            return functions[mode]
        calls = [
            {"type": "object", "properties": {"name": {"const": name}, "parameters": params},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, params in functions.items()
        ]  # fmt: skip
        return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}

    def _constraints(self) -> list[tuple[str, dict[str, Any]]]:
        found = super()._constraints()
        schema = self.tool_schema()
        if schema is None:
            return found
        if found:
            raise FieldError(f"{found[0][0]} cannot be combined with tool_choice {self.tool_choice!r}", found[0][0].split(".")[0])
        return [("tools", {"json": schema})]

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def conversation(self) -> list[dict]:
        return conversation(self.messages)

    def sampling_params(self, reasoning: tuple[str, str] | None = None, defaults: dict | None = None) -> SamplingParams:
        """`reasoning`: the reasoning parser's (start, end) markers, behind which an output constraint waits;
        `defaults`: the model's generation config defaults (vLLM's), its max_new_tokens a cap on max_tokens."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        max_tokens = capped_max_tokens(max_tokens, defaults)
        if self.use_beam_search and self.logprobs:
            raise FieldError("logprobs is not supported with use_beam_search", "logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        constraint = self.structured_outputs_params()
        if constraint is not None and reasoning is not None:
            constraint = dataclasses.replace(constraint, reasoning_start=reasoning[0], reasoning_end=reasoning[1])
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, structured_outputs=constraint,
                              prompt_logprobs=self.prompt_logprobs, **self.sampling_kwargs(defaults))  # fmt: skip


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template (or openai-harmony) gets them."""
    out = []
    for m in messages:
        # an assistant's tool-call turn without content reaches the template as "" (as vLLM): templates that
        # concatenate message['content'] (SmolLM2's) fail on a missing one
        msg = {"role": "system" if m.role == "developer" else m.role, "content": "" if m.content is None else m.content}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning"):
            if getattr(m, key):
                msg[key] = getattr(m, key)
        out.append(msg)
    return out

"""What both generation endpoints share: settings, body parsing, sampling params, submission."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from jaxpaged.engine.async_engine import AsyncLLMEngine, ChatPrompt, EngineDeadError, QueueFullError
from jaxpaged.engine.weight_sync import EngineAsleepError
from jaxpaged.engine.llm_engine import PromptType
from jaxpaged.entrypoints.openai import errors
from jaxpaged.entrypoints.openai.logprobs import TokenBytes
from jaxpaged.entrypoints.openai.reasoning import check_reasoning_parser, detect_reasoning_parser
from jaxpaged.entrypoints.openai.streaming import SSE_DONE, RequestRun, sse
from jaxpaged.entrypoints.openai.tool_parsers import PARSERS, detect_parser
from jaxpaged.sampling_params import MAX_N, SamplingParams
from jaxpaged.utils.chat_template import load_chat_template

logger = logging.getLogger("jaxpaged.server")


@dataclasses.dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    max_n: int = MAX_N  # cap on n (SamplingParams' own cap is the ceiling)
    max_request_bytes: int = 4 << 20
    retry_after_seconds: int = 1
    tool_call_parser: str | None = None  # tool_choice "auto"'s format; None: detected from the chat template
    enable_auto_tool_choice: bool = False  # vLLM's flag: insist that "auto" can be served
    exclude_tools_when_tool_choice_none: bool = False
    lora_modules: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (name, path) served from the start
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    allow_weight_updates: bool = False  # POST /update_weights, /sleep, /wake_up; GET /is_sleeping (rollout.py)
    enable_dev_endpoints: bool = False  # POST /reset_prefix_cache (dev.py; vLLM's VLLM_SERVER_DEV_MODE)
    reasoning_parser: str | None = None  # reasoning.REASONING_PARSERS; None: detected from the chat template; "none": off
    chat_template: str | None = None  # --chat-template: a file or Jinja text, used instead of the model's template
    trust_request_chat_template: bool = False  # accept a request's own chat_template (vLLM's flag)

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if not 1 <= self.max_n <= MAX_N:
            raise ValueError(f"max_n must be in [1, {MAX_N}] (got {self.max_n})")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024 (got {self.max_request_bytes})")
        if self.tool_call_parser not in (None, *PARSERS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)} (got {self.tool_call_parser!r})")
        if self.reasoning_parser != "none":
            check_reasoning_parser(self.reasoning_parser)  # an unknown name, or gpt_oss without openai-harmony
        self.chat_template = load_chat_template(self.chat_template)  # a file's text (read once, at start), or the Jinja


class Serving:
    def __init__(self, engine: AsyncLLMEngine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        self.tokenizer = engine.tokenizer
        self.token_bytes = TokenBytes(self.tokenizer)
        self.harmony = bool(getattr(engine, "harmony", False))  # GPT-OSS: prompts rendered by openai-harmony
        if settings.chat_template and self.harmony:  # vLLM would render harmony and drop the template without a word
            raise ValueError("--chat-template: GPT-OSS's prompts are rendered by openai-harmony (as vLLM renders them), "
                             "which reads no chat template; drop the flag")  # fmt: skip
        self.chat_template = settings.chat_template  # None: the model's own (the engine's tokenizer renders it)
        template = settings.chat_template or getattr(self.tokenizer, "chat_template", None)  # what the parsers read
        self.tool_parser = settings.tool_call_parser or ("openai" if self.harmony else detect_parser(template))
        self.reasoning_parser = self._reasoning_parser(template)
        if self.tool_parser == "openai" and self.reasoning_parser != "gpt_oss":  # harmony's calls are its messages
            if settings.tool_call_parser == "openai":
                raise ValueError("--tool-call-parser openai reads gpt-oss's harmony messages with the gpt_oss reasoning "
                                 f"parser, which this server does not use (reasoning parser: {self.reasoning_parser})")
            logger.warning("the chat template is gpt-oss's harmony, but without the gpt_oss reasoning parser "
                           "tool_choice 'auto' has no tool-call parser")
            self.tool_parser = None
        if settings.enable_auto_tool_choice and self.tool_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser: this model's chat template shows no tool-call "
                f"format this server can read ({', '.join(PARSERS)})"
            )
        if self.tool_parser:
            logger.info("tool_choice 'auto' reads calls with the %s parser", self.tool_parser)
        if self.reasoning_parser:
            logger.info("reasoning_content is read with the %s reasoning parser", self.reasoning_parser)
        from jaxpaged.entrypoints.openai.lora import ServedLoRAs

        self.loras = ServedLoRAs(engine, settings.served_model_names)
        for name, path in settings.lora_modules:  # loaded and checked now: a bad one stops the start
            self.loras.add(name, path)

    def _reasoning_parser(self, template) -> str | None:
        """The flag's parser; gpt_oss for a model whose prompts openai-harmony renders (GPT-OSS); or the one the chat
        template shows (a detected gpt_oss without openai-harmony's vocabulary is left off, with a warning: the flag
        makes that an error)."""
        if self.settings.reasoning_parser is not None:
            return None if self.settings.reasoning_parser == "none" else self.settings.reasoning_parser
        if self.harmony:  # the engine renders harmony, so the output is harmony (its encoding is loaded already)
            return "gpt_oss"
        generation_prompt = None
        with contextlib.suppress(Exception):  # a template that wants more than one user turn: judged on its text alone
            extra = {"chat_template": template} if self.chat_template else {}
            generation_prompt = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False, **extra
            )
        name = detect_reasoning_parser(template, generation_prompt if isinstance(generation_prompt, str) else None)
        if name == "gpt_oss":
            try:
                check_reasoning_parser(name)
            except (ValueError, ImportError) as exc:
                logger.warning("the chat template is gpt-oss's harmony, but reasoning stays in content: %s", exc)
                return None
        return name

    def template_for(self, requested: str | None) -> str | None:
        """The template a conversation renders with: a request's own chat_template (vLLM's field; only on a server
        started with --trust-request-chat-template, else a 400 naming it), else --chat-template's, else None (the
        model's). The parsers stay those the server's template showed."""
        if requested is None:
            return self.chat_template
        if self.harmony:
            raise errors.bad_request("chat_template: GPT-OSS's prompts are rendered by openai-harmony (as vLLM renders "
                                     "them), which reads no chat template", param="chat_template")  # fmt: skip
        if not self.settings.trust_request_chat_template:
            raise errors.bad_request("chat_template is refused: the server was not started with "
                                     "--trust-request-chat-template", param="chat_template")  # fmt: skip
        if not requested.strip():
            raise errors.bad_request("chat_template must be a template's Jinja text", param="chat_template")
        return requested

    def prompt_text(self, run: RequestRun) -> str:
        """The first prompt's text with special tokens kept, where a reasoning reader looks for thinking markers."""
        return self.tokenizer.decode(run.streams[0].prompt_token_ids, skip_special_tokens=False) if self.tokenizer else ""

    @property
    def all_model_names(self) -> list[str]:
        """The base model's names, then the adapters' (a request's `model` may be any of them)."""
        return [*self.settings.served_model_names, *self.loras.by_name]

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def response_model(self, model: str) -> str:
        """The `model` a response names: the adapter's when one was asked for, else the first served name."""
        return model if model in self.loras.by_name else self.model_name

    async def parse(self, request: Request, model: type[BaseModel]) -> BaseModel:
        """The body as `model`: a 400 on a bad field, a 404 on a `model` this server does not serve (None, where the
        body may leave it out, is the base model)."""
        body = await request.body()
        try:
            parsed = model.model_validate_json(body)
        except ValidationError as exc:
            raise errors.from_validation_error(exc) from None
        if parsed.model is not None and parsed.model not in self.all_model_names:
            raise errors.model_not_found(parsed.model, self.all_model_names)
        return parsed

    def sampling_params(self, body, fields: dict[str, str], **kwargs) -> SamplingParams:
        """SamplingParams from the body (`kwargs` for its sampling_params()); its ValueError (naming the field)
        becomes a 400 on that field."""
        if isinstance(body.n, int) and not 1 <= body.n <= self.settings.max_n:
            raise errors.bad_request(f"n must be in [1, {self.settings.max_n}] (got {body.n})", param="n")
        try:
            return body.sampling_params(defaults=self.engine.default_sampling_kwargs, **kwargs)
        except errors.FieldError as exc:
            raise errors.bad_request(str(exc), param=exc.param) from None
        except (ValueError, NotImplementedError) as exc:
            raise errors.from_value_error(exc, fields) from None

    async def submit(
        self, http_request: Request, prefix: str, prompts: list[PromptType | ChatPrompt], params: SamplingParams,
        fields: dict[str, str], prompt_field: str, model: str | None = None, priority: int = 0,
    ) -> tuple[str, RequestRun]:
        """Queue one engine request per prompt (all or none) and return the HTTP request's id and run; `model` an
        adapter's name runs them with that LoRA adapter; `priority` (vLLM's field) goes to every one."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        lora = self.loras.by_name.get(model) if model is not None else None
        batch = [(f"{request_id}-{i}", p, params, lora, priority) for i, p in enumerate(prompts)]
        try:
            streams = await self.engine.add_requests(batch)
        except QueueFullError as exc:
            raise errors.queue_full(str(exc), self.settings.retry_after_seconds) from None
        except EngineDeadError as exc:
            raise errors.engine_dead(str(exc)) from None
        except EngineAsleepError as exc:
            raise errors.engine_asleep(str(exc), self.settings.retry_after_seconds) from None
        except ValueError as exc:
            raise errors.from_value_error(exc, fields, default=prompt_field) from None
        return request_id, RequestRun(self.engine, streams, http_request)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


async def stream_choices(run: RequestRun, meta: dict, body, chunk_for, shown=lambda out: out.outputs) -> AsyncIterator[str]:
    """The SSE both endpoints send after their openers: chunk_for(prompt index, RequestOutput, CompletionOutput)
    -> a choice, a list of them (a chunk each) or None, for each of `shown(RequestOutput)` per update; then the
    usage chunk when asked and [DONE]. A dead engine ends the stream with its error."""
    tokens: dict[tuple[int, int], int] = {}  # (prompt, choice) -> tokens generated so far
    finished: set[tuple[int, int]] = set()  # choices whose finish_reason was sent: later updates still list them

    def extra() -> dict:
        if body.continuous_usage:
            return {"usage": usage(run.prompt_tokens, sum(tokens.values()))}
        return {"usage": None} if body.include_usage else {}

    try:
        async for batch in run.updates():
            for i, out in batch:
                for c in shown(out):
                    if (i, c.index) in finished:
                        continue
                    if c.finish_reason is not None:
                        finished.add((i, c.index))
                    tokens[i, c.index] = len(c.token_ids)
                    choices = chunk_for(i, out, c)
                    for choice in [choices] if isinstance(choices, dict) else choices or ():
                        yield sse({**meta, "choices": [choice], **extra()})
    except EngineDeadError as exc:
        yield sse(errors.engine_dead(str(exc)).body())
        yield SSE_DONE
        return
    if run.disconnected:
        return
    if body.include_usage:
        yield sse({**meta, "choices": [], "usage": usage(run.prompt_tokens, sum(tokens.values()))})
    yield SSE_DONE


SAMPLING_FIELDS = {
    name: name
    for name in (
        "n", "best_of", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
        "skip_special_tokens", "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "bad_words",
        "truncate_prompt_tokens", "spaces_between_special_tokens", "prompt_logprobs", "priority", "use_beam_search",
        "length_penalty", "early_stopping", "thinking_token_budget",
    )
}

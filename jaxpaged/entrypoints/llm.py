"""The offline API, as in vLLM: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from jaxpaged.config import EngineConfig
from jaxpaged.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxpaged.engine.data_parallel import make_engine
from jaxpaged.engine.llm_engine import PromptType
from jaxpaged.engine.metrics import EngineMetrics, Metric, RequestTimer
from jaxpaged.engine.pooling_score import score_params, score_plan
from jaxpaged.lora import LoRARequest
from jaxpaged.outputs import (
    ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput,
    ScoringRequestOutput,
)  # fmt: skip
from jaxpaged.pooling_params import PoolingParams
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.utils.logging_utils import setup_logging
from jaxpaged.utils.text import ChatPrompt, join_text_parts


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        """kwargs: `log_level` and any EngineConfig field by name (an unknown one is a TypeError); the engine loads
        the model and, with `precompile` (the default), compiles every step shape before this returns;
        data_parallel_size > 1 starts that many replicas behind a router (engine/data_parallel.py)."""
        setup_logging(kwargs.pop("log_level", "INFO"))
        self.engine = make_engine(EngineConfig(model=model, **kwargs))
        self._start_metrics()
        if self.is_follower:  # another process of a group: run process 0's steps until it closes (docs/distributed.md)
            self.engine.runner.follow()

    @classmethod
    def from_engine(cls, engine) -> LLM:
        """An LLM over an engine already built (an LLMEngine or DataParallelEngine: a trainer's rollout class, which
        makes its model from the trainer's, builds its own)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._start_metrics()
        return llm

    def _start_metrics(self) -> None:
        # generate() sees an output only when its request ends: no first-token or inter-token times to measure
        self._metrics, self._timer = EngineMetrics(streaming=False), RequestTimer(streaming=False)

    @property
    def is_follower(self) -> bool:
        """This process executes for process 0 of its group and takes no requests."""
        return self.engine.is_follower

    def close(self) -> None:
        """Release a process group's followers (done at exit too); nothing otherwise."""
        self.engine.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the SamplingParams a call without any uses: the model's generation_config.json defaults
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), unless generation_config='vllm'."""
        return self.engine.get_default_sampling_params()

    def get_stats(self) -> dict[str, Any]:
        return self.engine.get_stats()

    def get_metrics(self) -> list[Metric]:
        """vLLM's: every metric now, as vllm.v1.metrics.reader's objects (jaxpaged.engine.metrics' Counter, Gauge,
        Histogram, Vector), under the names and values the server's /metrics serves: the gauges and the engine's own
        totals from get_stats(), and the prompt and generated tokens, finish reasons and end-to-end latencies of this
        LLM's requests. No time-to-first-token or inter-token histograms: generate sees an output only at its end."""
        return self._metrics.snapshot(self.engine.get_stats())

    # -- a trainer's rollouts (engine/weight_sync.py, docs/rl.md) ------------------------------------

    def update_weights(self, weights, *, mapping=None, in_flight: str = "finish", lora_request: LoRARequest | None = None,
                       copy: bool = False) -> dict[str, Any]:  # fmt: skip
        """Replace the weights in place, without a restart or a recompile: `weights` a pytree of arrays on the devices
        (an NNX State of the port, a dict by HF name, or a trainer's names through `mapping`), some or all of them,
        or a folder of safetensors; lora_request: some of that adapter's tensors. Unknown names or wrong shapes: a
        ValueError naming them, the weights unchanged. Requests in flight: `in_flight="finish"` or `"abort"`.
        copy=True: the engine keeps none of the given arrays (else those it needs as they are, it takes as they are)."""
        return self.engine.update_weights(weights, mapping=mapping, in_flight=in_flight, lora_request=lora_request, copy=copy)

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Free the KV pool and move the weights to host memory (level 1) or drop them (level 2, for new weights
        through update_weights); generate refuses until wake_up. -> device bytes in use before and asleep."""
        return self.engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """Bring back "weights" and/or "kv_cache" (default both), in either order; nothing is recompiled."""
        return self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prompt prefix, so later prompts are computed afresh (a benchmark's cold
        start). False, forgetting nothing, while requests hold KV blocks (none do between generate calls)."""
        return self.engine.reset_prefix_cache()

    def start_profile(self, profile_prefix: str | None = None) -> str:
        """vLLM's: a JAX profiler trace of everything run until stop_profile(), written under the profiler_dir given
        to LLM(...) (in its profile_prefix subfolder, if given); -> that folder. ProfilerError (a RuntimeError)
        without profiler_dir or while a profile runs."""
        return self.engine.start_profile(profile_prefix)

    def stop_profile(self) -> str:
        """End the trace and write it (TensorBoard's profile plugin or XProf read it); -> its run's folder."""
        return self.engine.stop_profile()

    def get_per_token_logps(self, prompt_tokens, completion_tokens, *, pad_id: int | None = None,
                            lora_request: LoRARequest | None = None, use_tqdm: bool = False):  # fmt: skip
        """Each completion token's logprob after its prompt and the completion before it, by the engine's own steps
        (prompt logprobs over prompt + completion, all rows in one batch): float32 [B, C] (numpy). The rows are
        token lists, or [B, P] / [B, C] arrays padded with pad_id (prompts left, completions right, as Tunix pads
        them; a pad is not text, a trailing one gets the pad token's logprob): engine/scoring.py."""
        from jaxpaged.engine.scoring import per_token_logps

        return per_token_logps(self.generate, prompt_tokens, completion_tokens, pad_id, use_tqdm=use_tqdm,
                               lora_request=lora_request)  # fmt: skip

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; outputs come back in input order.
        lora_request: one adapter for every prompt, or a list with one (or None: the base model) per prompt;
        the engine needs enable_lora=True. priority (vLLM's): one int per prompt, lower served first, with
        scheduling_policy="priority"."""
        if self.is_follower:
            raise RuntimeError("this process follows process 0 of its group, which takes the requests")
        prompts = self._prompt_list(prompts)
        if sampling_params is None:  # the model's generation config defaults, as vLLM's
            sampling_params = self.get_default_sampling_params()
        params_list = self._per_prompt_params(sampling_params, len(prompts), "sampling_params", SamplingParams)
        loras = self._per_prompt_loras(lora_request, len(prompts))
        priorities = self._per_prompt_priorities(priority, len(prompts))
        # nobody sees a request's output before it ends: the engine builds it (and decodes its text) only then
        final = {}
        for i, params in enumerate(params_list):
            if isinstance(params, SamplingParams) and params.output_kind != RequestOutputKind.FINAL_ONLY:
                if id(params) not in final:
                    final[id(params)] = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                params_list[i] = final[id(params)]
        return self._run(self._add_all(prompts, params_list, loras, priorities), use_tqdm)

    @staticmethod
    def _prompt_list(prompts) -> list:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    @staticmethod
    def _per_prompt_params(params, count: int, name: str, kind: type) -> list:
        """One `kind` for every prompt, or a list with one per prompt; anything else is a ValueError naming `name`."""
        if isinstance(params, kind):
            return [params] * count
        if not isinstance(params, Sequence) or isinstance(params, (str, bytes)):
            raise ValueError(f"{name} must be a {kind.__name__} or a list of them, one per prompt (got "
                             f"{type(params).__name__}: e.g. {kind.__name__}(**that_dict))")  # fmt: skip
        params = list(params)
        if len(params) != count:
            raise ValueError(f"{name} has {len(params)} entries for {count} prompts; pass one or one per prompt")
        return params

    @staticmethod
    def _per_prompt_loras(lora_request, count: int) -> list:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * count
        loras = list(lora_request)
        if len(loras) != count:
            raise ValueError(f"lora_request has {len(loras)} entries for {count} prompts; pass one or one per prompt")
        return loras

    @staticmethod
    def _per_prompt_priorities(priority, count: int) -> list:
        """None: no priority passed (so an engine without the argument works); else one per prompt."""
        if priority is None:
            return [None] * count
        if isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence):
            raise ValueError(f"priority must be a list of ints, one per prompt (got {type(priority).__name__})")
        if len(priority) != count:
            raise ValueError(f"priority has {len(priority)} entries for {count} prompts; pass one per prompt")
        return list(priority)

    def _add_all(self, prompts: list, params_list: list, loras: list, priorities: list) -> list[str]:
        """Queue every prompt; a bad one refuses the whole batch, leaving nothing queued."""
        ids = []
        try:
            for prompt, params, adapter, rank in zip(prompts, params_list, loras, priorities):
                kwargs = {} if adapter is None else {"lora_request": adapter}
                if rank is not None:
                    kwargs["priority"] = rank
                ids.append(self.engine.add_request(None, prompt, params, **kwargs))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        now = time.monotonic()
        for rid in ids:
            self._timer.added(rid, len(self.engine.get_prompt_token_ids(rid)), now)
        return ids

    # -- pooling models (runner="pooling": engine/pooling.py) ------------------------------------------

    def encode(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               *, truncate_prompt_tokens: int | None = None, use_tqdm: bool | Callable = True,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:  # fmt: skip
        """vLLM's LLM.encode: each prompt's pooled output (`outputs.data`, numpy float32), in input order.
        pooling_task: "embed", "classify", "token_embed" ([prompt tokens, D]) or "token_classify" ([prompt tokens,
        labels]); None: the model's own (its first: embed, classify, or a token classifier's token_classify)."""
        if self.is_follower:
            raise RuntimeError("this process follows process 0 of its group, which takes the requests")
        prompts = self._prompt_list(prompts)
        params_list = self._per_prompt_params(pooling_params or PoolingParams(), len(prompts), "pooling_params", PoolingParams)
        for i, params in enumerate(params_list):
            if not isinstance(params, PoolingParams):
                raise ValueError(f"pooling_params must be PoolingParams (got {type(params).__name__})")
            changes = {"task": pooling_task} if pooling_task is not None else {}
            if truncate_prompt_tokens is not None:
                changes["truncate_prompt_tokens"] = truncate_prompt_tokens
            if changes:
                params_list[i] = dataclasses.replace(params, **changes)
        ids = self._add_all(prompts, params_list, self._per_prompt_loras(lora_request, len(prompts)),
                            self._per_prompt_priorities(None, len(prompts)))  # fmt: skip
        return self._run(ids, use_tqdm, desc="Pooling")

    def embed(self, prompts: PromptType | Sequence[PromptType], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | Callable = True, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[EmbeddingRequestOutput]:  # fmt: skip
        """Each prompt's embedding (`outputs.embedding`): an embedding model's pooled, normalized hidden state."""
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           lora_request=lora_request, pooling_task="embed")  # fmt: skip
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool | Callable = True,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[ClassificationRequestOutput]:  # fmt: skip
        """Each prompt's class probabilities (`outputs.probs`): a *ForSequenceClassification checkpoint's head."""
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def reward(self, prompts: PromptType | Sequence[PromptType], /, *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool | Callable = True, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[PoolingRequestOutput]:  # fmt: skip
        """vLLM's: a reward or token classification model's per-token outputs (the token_classify task):
        `outputs.data` is [prompt tokens, labels] (STEP pooling: the step_tag_id positions' rows)."""
        return self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           lora_request=lora_request, pooling_task="token_classify")  # fmt: skip

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | Callable = True, pooling_params: PoolingParams | None = None,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:  # fmt: skip
        """vLLM's: one text against many (1 -> N) or pair by pair (N -> N). An embedding model scores by the cosine
        similarity of the two embeddings; a one-label classifier (a cross-encoder) by its sigmoid over the pair,
        encoded together as its tokenizer pairs texts."""
        plan = score_plan(self.engine.pooler, self.engine.tokenizer, data_1, data_2)
        params = score_params(pooling_params, truncate_prompt_tokens)
        return plan.results(self.encode(plan.prompts, params, use_tqdm=use_tqdm, lora_request=lora_request))

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, use_tqdm: bool = True
    ) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: every prompt's beam_width hypotheses, best first (transformers' semantics)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams (got {type(params).__name__})")
        sampling = SamplingParams(
            n=params.beam_width, best_of=params.beam_width, use_beam_search=True, temperature=0.0,
            max_tokens=params.max_tokens, ignore_eos=params.ignore_eos, length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
        )  # fmt: skip
        results = []
        for out in self.generate(prompts, sampling, use_tqdm=use_tqdm):
            sequences = [
                BeamSearchSequence(
                    tokens=out.prompt_token_ids + c.token_ids, output_token_ids=list(c.token_ids),
                    cum_logprob=c.cumulative_logprob,
                    score=c.cumulative_logprob / len(c.token_ids) ** params.length_penalty,
                    text=c.text, finish_reason=c.finish_reason,
                )
                for c in out.outputs
            ]  # fmt: skip
            results.append(BeamSearchOutput(sequences))
        return results

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        continue_final_message: bool = False,
        priority: Sequence[int] | None = None,
        chat_template: str | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Each conversation through the tokenizer's chat template (or `chat_template`, vLLM's: a template's Jinja
        text used instead, e.g. for a base model that has none), then generate. `tools` (OpenAI tool dicts, as
        vLLM's LLM.chat) go to the template, which describes them to the model; the calls are left in the text.
        `chat_template_kwargs` are more template variables (vLLM's), e.g. {"enable_thinking": False}. GPT-OSS's
        conversations are rendered by openai-harmony instead (utils/harmony.py), its reasoning effort from
        chat_template_kwargs' "reasoning_effort" (the variable gpt-oss's own template reads).
        continue_final_message (vLLM's): the prompt ends inside the last message, an assistant's, which the output
        continues; it needs add_generation_prompt=False. Each output's `prompt` is its conversation's rendered text.
        priority: as generate's, one per conversation. mm_processor_kwargs (vLLM's): image processor settings for the
        conversations' images, over the engine's (e.g. {"max_soft_tokens": 560} for Gemma 4)."""
        if self.engine.tokenizer is None and not getattr(self.engine, "harmony", False):
            raise ValueError("this model has no tokenizer, so it has no chat template")
        if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
            raise ValueError(f"chat_template must be a template's Jinja text (got {chat_template!r})")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False (the prompt ends inside "
                             "the last message, not with a new one)")  # fmt: skip
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [ChatPrompt(join_text_parts(c), add_generation_prompt, tools, chat_template_kwargs,
                              continue_final_message=continue_final_message, chat_template=chat_template,
                              mm_processor_kwargs=mm_processor_kwargs)
                   for c in conversations]  # fmt: skip
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, priority=priority)

    def _run(self, ids: list[str], use_tqdm: bool | Callable, desc: str = "Generating") -> list:
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        # use_tqdm may also be a tqdm-like class (vLLM's: e.g. tqdm.notebook.tqdm), called as tqdm is
        progress = use_tqdm if callable(use_tqdm) else tqdm
        bar = progress(total=len(ids), desc=desc, unit="req", disable=not use_tqdm)
        try:
            while pending:
                outputs, now = self.engine.step(), time.monotonic()
                for out in outputs:
                    self._timer.output(out, now)
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
                        bar.update(1)
                self._metrics.observe(self._timer.take())
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
                self._timer.forget(rid)
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in ids]

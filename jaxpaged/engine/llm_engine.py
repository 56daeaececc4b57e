"""LLMEngine.step(): schedule -> execute -> update, then the callers' outputs.

The scheduler forms the step (and alone touches the KV cache manager), the runner builds its
padded inputs from that and runs the jitted step, the scheduler takes the sampled tokens and
checks stops, and the output processor turns them into text, logprobs and RequestOutputs.

Requests are validated at the door (a request that could never fit is refused at once, with a
ValueError naming the parameter), so a bad one never reaches the step loop and everyone else
keeps being served.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxpaged import distributed, platforms
from jaxpaged.config import EngineConfig
from jaxpaged.core.block_pool import BlockPool
from jaxpaged.core.kv_cache_coordinator import KVCacheCoordinator
from jaxpaged.core.kv_cache_manager import KVCacheManager, freeing_window, max_blocks_held
from jaxpaged.core.state_slots import HybridKVCacheManager, spare_state_slots
from jaxpaged.core.request import ParentRequest, Request, RequestStatus
from jaxpaged.core.rope_regime import LengthDependentRope
from jaxpaged.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from jaxpaged.engine.beam_search import BeamSearch
from jaxpaged.engine.generation_defaults import default_sampling_kwargs
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.engine.profiler import Profiler
from jaxpaged.engine.prompt_embeds import PLACEHOLDER_ID, check_prompt_embeds_engine, prompt_embeds_of
from jaxpaged.engine.pooling import POOLING_RUN, Pooler, wants_pooling_runner
from jaxpaged.engine.structured_output import StructuredOutputManager
from jaxpaged.engine.token_controls import token_controls
from jaxpaged.engine.weight_sync import WeightSync
from jaxpaged.lora import LoRARequest
from jaxpaged.models.convert_cache import cache_root
from jaxpaged.models.loader import LoadedModel, load_model
from jaxpaged.outputs import RequestOutput
from jaxpaged.pooling_params import PoolingParams
from jaxpaged.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxpaged.utils import compile_monitor
from jaxpaged.utils.text import ChatPrompt, render_chat_prompt
from jaxpaged.worker.model_runner import ModelRunner
from jaxpaged.worker.step_output import DispatchedStep, StepResult
from jaxpaged.worker.pipeline_runner import PipelineRunner

logger = logging.getLogger("jaxpaged.engine")

PromptType = str | Sequence[int] | dict | ChatPrompt


@dataclasses.dataclass
class InFlightStep:
    """A step dispatched to the device whose results the host has not read yet."""

    scheduler_output: SchedulerOutput
    dispatched: DispatchedStep
    sample_later: bool = False  # only its forward is dispatched: sampled once the previous step's tokens are in

    @property
    def sampled_rows(self) -> dict[Request, int]:
        return self.scheduler_output.sampled_rows


def _enable_compilation_cache(config: EngineConfig) -> None:
    """JAX's persistent cache, for tensor parallel engines only: one device stores whole executables instead
    (executable_cache.py), and the two together store broken ones."""
    if jax.config.jax_compilation_cache_dir or config.tensor_parallel_size == 1:  # the user chose one, or none needed
        return
    path = config.compilation_cache_dir or str(cache_root(config.cache_dir) / "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _check_hybrid(loaded: LoadedModel, config: EngineConfig) -> None:
    """What a hybrid model (linear layers with a state per sequence: models/hybrid.py) cannot do yet: a ValueError
    naming the option."""
    if not hasattr(loaded.model, "state_spec"):
        return
    if config.pipeline_parallel_size > 1:
        raise ValueError(f"pipeline_parallel_size: pipeline parallelism is not supported for {loaded.config.architecture} "
                         "(a hybrid model with a state cache)")  # fmt: skip


def _loading_place(config: EngineConfig):
    """Where weights are read to before the runner places them: host memory when the engine spans several devices
    (a model split over them need not fit the first one), else the default device."""
    if config.devices_per_replica * config.data_parallel_size == 1 and not distributed.is_multiprocess():
        return contextlib.nullcontext()
    return jax.default_device(jax.local_devices(backend="cpu")[0])


def _token_ids(ids) -> list[int]:
    """A prompt's token ids as ints: a float, a bool or anything else is a ValueError naming prompt_token_ids."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
        raise ValueError(f"prompt_token_ids must be a list of ints (got {type(ids).__name__})")
    for t in ids:
        if not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_)):
            raise ValueError(f"prompt_token_ids must hold ints only (got {t!r})")
    return [int(t) for t in ids]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, devices=None):
        """devices: where this engine runs (default: JAX's devices, of which it takes what its parallelism needs)."""
        compile_monitor.install()
        self.config = config
        _enable_compilation_cache(config)
        t0 = time.perf_counter()
        jax.devices()  # the backend's start (on a GPU, its libraries and context: seconds), timed apart from loading
        backend_seconds = time.perf_counter() - t0
        platform = platforms.get(config.platform)
        platform.prepare(config)
        t0 = time.perf_counter()
        with _loading_place(config):
            self.loaded = loaded or load_model(
                config.model, dtype=config.dtype, attention_backend=config.attention_backend, cache_dir=config.cache_dir,
                batch_invariant=config.batch_invariant, revision=config.revision, platform=platform,
                quantization=config.quantization, hf_config=config.hf_config, checkpoint_mapping=config.checkpoint_mapping,
                devices=devices, tensor_parallel_size=config.tensor_parallel_size, moe_kernel=config.moe_kernel,
                hf_overrides=config.hf_overrides,
            )
        load_seconds = time.perf_counter() - t0
        self.tokenizer = self.loaded.tokenizer
        model_len = self.loaded.config.max_position_embeddings
        limit = self.loaded.config.option("context_limit")  # why a port caps the context below the checkpoint's
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's context ({model_len})"
                             + (f": {limit}" if limit else ""))  # fmt: skip
        if config.max_model_len is None and limit:
            logger.info("max_model_len is %d: %s", model_len, limit)
        self.max_model_len = config.max_model_len or model_len
        self.bidirectional = bool(self.loaded.config.option("bidirectional", False))  # is_causal=false pooling models
        if self.bidirectional:
            self.max_model_len = self._whole_prompts(config)
        # the model's generation_config.json defaults for what a request leaves unset (vLLM's generation_config auto)
        self.default_sampling_kwargs = default_sampling_kwargs(config.generation_config, config.override_generation_config,
                                                               self.loaded.source)  # fmt: skip
        self.harmony = self._uses_harmony()  # GPT-OSS: chat prompts rendered by openai-harmony, not the template
        self._renderer = None  # render_prompt's, made on first use
        self.eos_token_ids = self._eos_ids()
        executables = cache_root(config.cache_dir) / "executables"
        draft = None  # speculative_config's draft_model: placed before the target's KV pool, which is sized from what is left
        spec_config = config.speculative_config
        _check_hybrid(self.loaded, config)
        self.pooler = self._pooler(config)
        if config.enable_prompt_embeds:
            check_prompt_embeds_engine(self.loaded, self.pooler is not None)
        if spec_config is not None and spec_config.method == "draft_model":
            from jaxpaged.spec_decode.draft_model import DraftModelProposer

            with _loading_place(config):
                draft = DraftModelProposer.load(config, spec_config, self.loaded, self.max_model_len, platform, devices=devices,
                                                executable_dir=executables)  # fmt: skip
        runner = PipelineRunner if config.pipeline_parallel_size > 1 else ModelRunner
        mtp = spec_config is not None and spec_config.method in ("mtp", "eagle3")
        extra = {}
        if mtp:  # the MTP layer or EAGLE-3 head: placed first, its cache counted where the pool is sized (spec_decode/mtp.py)
            from jaxpaged.spec_decode.mtp import MtpProposer

            mtp_weights = MtpProposer.load(self.loaded, config, spec_config, platform, (devices or jax.devices())[0])
            extra = {"keep_hidden": True, "aux_layers": mtp_weights.aux_layers,
                     "mirrored_kv": MtpProposer.mirrored_kv(config, spec_config)}  # fmt: skip
        self.runner = runner(
            self.loaded, config, self.max_model_len, eos_token_ids=self.eos_token_ids, executable_dir=executables,
            devices=devices, pooling=self.pooler is not None, **extra,
        )
        if mtp:  # a shadow step after each of the runner's
            draft = self.runner.mtp = MtpProposer(mtp_weights, self.runner, config, spec_config, self.loaded.source)
        hybrid = getattr(self.runner, "state_spec", None) is not None  # linear layers' states (core/state_slots.py)
        if hybrid and config.enable_prefix_caching:
            logger.info("prefix caching is off for %s: a cached block holds no linear layer's state at its boundary",
                        self.loaded.config.architecture)  # fmt: skip
        if self.bidirectional and config.enable_prefix_caching:
            logger.info("prefix caching is off: a bidirectional model's K/V of a prefix depend on what follows it")
        pool = BlockPool(self.runner.num_blocks, enable_caching=config.enable_prefix_caching and not hybrid and not self.bidirectional)
        groups = self.runner.kv_groups
        if hybrid:
            kv = HybridKVCacheManager(pool, config.block_size, config.max_num_seqs, spare_state_slots(config))
        elif groups is None:
            kv = KVCacheManager(pool, config.block_size, freeing_window(self.loaded.config.sliding_windows))
        else:
            kv = KVCacheCoordinator(pool, config.block_size, groups.windows)
        self.scheduler = Scheduler(
            kv,
            config.max_num_seqs, config.max_num_batched_tokens,
            self.eos_token_ids, self.max_model_len, LengthDependentRope.of(self.loaded.config),
            decode_lanes=config.speculative_config is None,  # proposals read every sequence's tokens every step
            policy=config.scheduling_policy,
        )  # fmt: skip
        self.scheduler.whole_prompts = self.bidirectional  # a prompt in one step: its tokens see each other
        if mtp:
            draft.kv = self.scheduler.kv  # its chained guesses write where the sequences' blocks are
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.pooler)
        self.mm = None  # vision-language models: prompts with images, the scheduler's encoder part (multimodal/engine.py)
        if getattr(self.runner, "mm", None) is not None:
            from jaxpaged.multimodal.engine import MultimodalFrontend

            self.mm = MultimodalFrontend(self)
        self.lora = None  # with enable_lora: the adapters in host memory and the device's slots
        if config.enable_lora:
            from jaxpaged.lora.manager import LoRAManager

            self.lora = LoRAManager(self.runner, self.loaded.config, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        self._lora_waiting: collections.deque = collections.deque()  # (parent, sequences) until a slot is free
        self._lora_held: dict[str, ParentRequest] = {}  # request id -> an unfinished request holding a slot
        self.structured_outputs = StructuredOutputManager(self.tokenizer, self.eos_token_ids, self.loaded.config.vocab_size)
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(config.seed)
        logger.info("memory plan: %s; max_model_len %d", self.runner.memory_plan(), self.max_model_len)
        # a follower of a process group compiles as the leader's warm-up steps reach it (follow())
        self.is_follower = distributed.is_multiprocess() and not distributed.is_leader()
        self.warmup_seconds = 0.0 if self.is_follower else self.runner.warmup()
        if draft is not None:
            self.warmup_seconds += draft.warmup()
        self.startup_seconds = {
            "backend": backend_seconds, "load": load_seconds, "weights": self.loaded.weights_seconds, **self.loaded.load_seconds,
            **self.runner.startup_seconds, "warmup": self.warmup_seconds,
        }  # "weights" (reading the weights onto the device), "config", "build" and "tokenizer" (an HF folder's) are parts of "load"
        self.num_compiles_after_warmup = 0  # compiles during step(); anything but 0 is a bug
        self._beam_count = 0
        self._in_flight: InFlightStep | None = None  # async scheduling: the step the device is running
        self.spec = None  # speculative decoding (jaxpaged/spec_decode/): proposals, and verified steps' results
        if config.speculative_config is not None:
            from jaxpaged.spec_decode.decoder import SpecDecoder

            self.spec = SpecDecoder(config.speculative_config, self.max_model_len, draft, rope=self.scheduler.rope,
                                    states=self.scheduler.kv if hybrid else None)  # fmt: skip
            if mtp:  # its shadow step writes K/V only while speculation is off for the batch size
                draft.guessing = functools.partial(self.spec.active, self.scheduler)
        self.num_overlapped_steps = 0  # steps dispatched before the previous step's results were read
        self.weight_sync = WeightSync(self)  # update_weights, sleep and wake_up (engine/weight_sync.py)
        self.profiler = Profiler(config.profiler_dir)  # start_profile / stop_profile (engine/profiler.py)

    def _pooler(self, config: EngineConfig) -> Pooler | None:
        """runner "pooling" (or "auto" with an embedding or classifier checkpoint): what it pools; what it cannot do is
        a ValueError naming the option."""
        info = getattr(self.loaded, "pooling", None)
        if not wants_pooling_runner(config.runner, info):
            if config.pooler_config is not None:
                raise ValueError(f"pooler_config needs runner 'pooling': {self.loaded.config.architecture} generates")
            return None
        for name, value in (("speculative_config", config.speculative_config is not None),
                            ("pipeline_parallel_size", config.pipeline_parallel_size > 1)):  # fmt: skip
            if value:
                raise ValueError(f"{name}: not supported with runner 'pooling' (a pooling model runs its prompts only)")
        return Pooler(info, config.pooler_config, self.loaded.config.hidden_size, self.loaded.hf_config)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model's generation config defaults (SamplingParams() without any)."""
        return SamplingParams(**self.default_sampling_kwargs)

    def _eos_ids(self) -> list[int]:
        """The config's and the tokenizer's EOS, and under harmony its `<|return|>` and `<|call|>` (GPT-OSS's
        config.json may name only the first: its generation_config.json names both)."""
        ids = set(self.loaded.config.eos_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.add(int(eos))
        if self.harmony:
            from jaxpaged.utils.harmony import stop_token_ids

            ids.update(t for t in stop_token_ids() if t < self.loaded.config.vocab_size)
        return sorted(ids)

    def _uses_harmony(self) -> bool:
        """GPT-OSS renders its chat prompts with openai-harmony (the `harmony` extra); without the package or its
        vocabulary the chat template does, with a warning."""
        from jaxpaged.utils.harmony import CHAT_FORMAT, harmony_encoding, stop_token_ids, uses_harmony

        if not uses_harmony(self.loaded.config.architecture):
            return False
        try:
            harmony_encoding(CHAT_FORMAT)
        except (ImportError, ValueError) as exc:
            logger.warning("GPT-OSS's chat prompts go through the checkpoint's chat template, not openai-harmony: %s", exc)
            return False
        if max(stop_token_ids()) >= self.loaded.config.vocab_size:  # a cut-down vocabulary (a test model) lacks them
            logger.warning("GPT-OSS's chat prompts go through the checkpoint's chat template: its %d-token vocabulary "
                           "lacks harmony's tokens", self.loaded.config.vocab_size)  # fmt: skip
            return False
        return True

    # -- requests ------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, ChatPrompt):
            if self.harmony:
                if prompt.chat_template:  # vLLM renders harmony anyway; a template it would drop is refused instead
                    raise ValueError("chat_template: GPT-OSS's conversations are rendered by openai-harmony (as vLLM "
                                     "renders them), which reads no chat template")  # fmt: skip
                if prompt.continue_final_message:
                    raise ValueError("continue_final_message is not supported for GPT-OSS's harmony conversations")
                from jaxpaged.utils.harmony import render_harmony_chat

                return None, render_harmony_chat(prompt)
            ids = render_chat_prompt(self.tokenizer, prompt)
            return self.tokenizer.decode(ids, skip_special_tokens=False), ids  # the rendered text, as vLLM reports
        if isinstance(prompt, dict):
            if "prompt_embeds" in prompt:  # (a generating engine's add_request takes them before this)
                raise ValueError("prompt_embeds: only a generating engine takes prompts given as embeddings")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict must have 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt_token_ids")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, Sequence) and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"prompt must be a string, a list of token ids or a dict (got {type(prompt).__name__})")

    def render_prompt(self, prompt: PromptType) -> PromptType:
        """A text prompt or a text-only conversation templated and tokenized with a tokenizer copy of its own
        (engine/prompt_renderer.py): safe on another thread, so AsyncLLMEngine does it off the engine's; other
        prompts (and GPT-OSS's harmony conversations, a pooling engine's prompts) come back as they are."""
        if self.tokenizer is None or self.harmony or self.pooler is not None:
            return prompt
        if self._renderer is None:
            from jaxpaged.engine.prompt_renderer import PromptRenderer

            self._renderer = PromptRenderer(self.tokenizer)
        return self._renderer.render(prompt)

    def load_media(self, prompt: PromptType) -> PromptType:
        """`prompt` with the images and video files it names fetched and decoded (multimodal/engine.py): safe on any
        thread, so AsyncLLMEngine does it before the engine's thread takes the request; add_request does it too."""
        return prompt if self.mm is None else self.mm.load_media(prompt)

    def _prompt_inputs(self, prompt: PromptType) -> tuple[str | None, list[int], Any]:
        """(text, token ids, its images or None): a prompt with multi_modal_data, or a conversation with image parts,
        goes through the model's processor (jaxpaged/multimodal/); a text-only model refuses images."""
        from jaxpaged.multimodal.engine import has_image_parts, text_only_refusal

        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            if self.mm is None:
                raise text_only_refusal("multi_modal_data", self.loaded.model, getattr(self.runner, "images_off", None))
            return self.mm.prompt(prompt)
        if isinstance(prompt, ChatPrompt) and has_image_parts(prompt.messages):
            if self.mm is None:
                raise text_only_refusal("messages", self.loaded.model, getattr(self.runner, "images_off", None))
            if prompt.continue_final_message:
                raise ValueError("continue_final_message is not supported for conversations with images")
            return self.mm.chat(prompt)
        return (*self._prompt_ids(prompt), None)

    def _whole_prompts(self, config) -> int:
        """max_model_len for a bidirectional (is_causal=false) pooling model, whose prompts run whole, in one step:
        at most max_num_batched_tokens; ValueError naming the fields otherwise, or for a generating runner."""
        if not wants_pooling_runner(config.runner, getattr(self.loaded, "pooling", None)):
            raise ValueError("is_causal=false (a bidirectional model) serves embeddings and scores only: runner='pooling'")
        if config.max_model_len is not None and config.max_model_len > config.max_num_batched_tokens:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds max_num_batched_tokens "
                             f"({config.max_num_batched_tokens}): a bidirectional model computes a prompt in one step")  # fmt: skip
        if self.max_model_len > config.max_num_batched_tokens:
            logger.info("max_model_len is %d (max_num_batched_tokens): a bidirectional model computes a prompt in one "
                        "step", config.max_num_batched_tokens)  # fmt: skip
        return min(self.max_model_len, config.max_num_batched_tokens)

    @functools.cached_property
    def _vocabulary_thinking_markers(self) -> tuple[str | None, str] | None:
        """(start, end): the vocabulary's own `<think>`/`</think>` (Magistral's `[THINK]`), or None; read once (a
        large vocabulary's dict costs milliseconds)."""
        vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
        for start, end in (("<think>", "</think>"), ("[THINK]", "[/THINK]")):
            if end in vocab:
                return (start if start in vocab else None, end)
        return None

    def _thinking_budget(self, params: SamplingParams, prompt_ids: list[int]):
        """inner -> a sequence's ThinkingBudget around its grammar (or None), for one request: its markers the
        structured outputs' (the server's reasoning parser) or the vocabulary's; ValueError naming
        thinking_token_budget for a model without such markers."""
        from jaxpaged.engine.thinking_budget import ThinkingBudget

        structured = params.structured_outputs
        markers = (structured.reasoning_start, structured.reasoning_end) if structured and structured.reasoning_end else None
        markers = markers or self._vocabulary_thinking_markers
        if markers is None:
            raise ValueError("thinking_token_budget: this model has no thinking markers (<think> ... </think>) the "
                             "budget could close")  # fmt: skip
        start, end = markers
        forced = self.tokenizer.encode(end, add_special_tokens=False)
        text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False) if prompt_ids else ""
        return lambda inner: ThinkingBudget.for_prompt(params.thinking_token_budget, start, end, forced,
                                                       self.structured_outputs.token_text, text, inner)  # fmt: skip

    def _max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """max_tokens, or when None as many as fit: what both the context and the whole KV pool leave after the
        prompt (one rule for LLM, the CLI and the server). Raises ValueError naming the parameter if none fit."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens, which leaves no room in max_model_len ({self.max_model_len})"
            )
        max_tokens = params.max_tokens
        if params.min_tokens > self.max_model_len:  # with max_tokens None nothing bounded it; the sampler packs it as int32
            raise ValueError(f"min_tokens must be <= max_model_len ({self.max_model_len}) (got {params.min_tokens})")
        if max_tokens is None:
            capacity = min(self.max_model_len, self.runner.num_blocks * self.config.block_size) - num_prompt_tokens
            if self._blocks_held(self.max_model_len) <= self.runner.num_blocks:  # a window's blocks go back
                capacity = self.max_model_len - num_prompt_tokens
            max_tokens = capacity if capacity >= 1 else room  # none fit in the pool: refused just below
        if max_tokens > room:
            raise ValueError(
                f"max_tokens ({max_tokens}) plus the prompt's {num_prompt_tokens} tokens exceeds max_model_len ({self.max_model_len})"
            )
        need = self._blocks_held(num_prompt_tokens + max_tokens)
        if need > self.runner.num_blocks:
            raise ValueError(
                f"prompt plus max_tokens needs {need} KV blocks but the whole pool has {self.runner.num_blocks}; "
                "raise num_kv_blocks or lower max_tokens"
            )
        return max_tokens

    def _truncated(self, ids: list[int], keep: int, images) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: the last max_model_len)."""
        if images is not None:
            raise ValueError("truncate_prompt_tokens cannot cut a prompt with images (it could cut one in two)")
        keep = self.max_model_len if keep == -1 else keep
        return ids[-keep:] if len(ids) > keep else ids

    def _blocks_held(self, num_tokens: int) -> int:
        """The most KV blocks a sequence of num_tokens holds at once (with a freeing window, about the window's)."""
        kv, step = self.scheduler.kv, self.config.max_num_batched_tokens
        if self.runner.kv_groups is not None:
            return self.runner.kv_groups.blocks_held(num_tokens, kv.block_size, step)
        return max_blocks_held(num_tokens, kv.block_size, kv.sliding_window, step)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | PoolingParams | None = None,
                    lora_request: LoRARequest | None = None, priority: int = 0) -> str:  # fmt: skip
        """Queue a request (a string, token ids, a dict with either, or a ChatPrompt); returns its id. A pooling
        engine (runner="pooling") takes PoolingParams instead of SamplingParams. priority: with scheduling_policy
        "priority", lower is served first (vLLM's).
        Raises ValueError naming the parameter for one that could never run (a bad LoRA adapter too)."""
        priority = self._priority(priority)
        if params is None:
            params = PoolingParams() if self.pooler is not None else self.get_default_sampling_params()
        self.weight_sync.admit()  # asleep: refused (EngineAsleepError), or queued until wake_up
        if lora_request is not None:
            if self.lora is None:
                raise ValueError("lora_request needs an engine started with enable_lora=True")
            self.lora.load(lora_request)  # read and checked now: a bad adapter queues nothing
        if isinstance(params, PoolingParams) or self.pooler is not None:
            return self._add_pooling_request(request_id, prompt, params, lora_request, priority)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams (got {type(params).__name__})")
        request_id = self._new_request_id(request_id)
        embeds = prompt_embeds_of(prompt, params, self)  # a prompt given as embeddings, or None
        if embeds is None:
            text, ids, images = self._checked_prompt(prompt, params)
        else:  # a placeholder id per row: the scheduler and the KV cache see a prompt of that many tokens
            text, ids, images = None, [PLACEHOLDER_ID] * len(embeds), None
        vocab = self.loaded.config.vocab_size
        max_tokens = self._max_tokens(params, len(ids))
        grammars = None
        if params.structured_outputs is not None:  # compiled (or found in the cache) here: a bad one is refused now
            count = 1 if params.use_beam_search else params.n  # beams copy the root's as they fork
            shown = ids if embeds is None else []
            grammars = [self.structured_outputs.new_state(params.structured_outputs, shown) for _ in range(count)]
        if params.thinking_token_budget is not None:  # the budget rides on the grammar path (engine/thinking_budget.py)
            count = 1 if params.use_beam_search else params.n
            budget = self._thinking_budget(params, ids if embeds is None else [])
            grammars = [budget(inner) for inner in grammars or [None] * count]
        controls = token_controls(params, vocab, self.tokenizer)
        parent = ParentRequest(request_id, text, ids, params, priority=priority)
        parent.mm, parent.prompt_embeds = images, embeds
        if lora_request is not None:
            parent.lora_request, parent.cache_salt = lora_request, lora_request.cache_salt
        if params.use_beam_search:
            self._add_beam_search(parent, max_tokens, grammars[0] if grammars else None)
            return request_id
        base_seed = params.seed if params.seed is not None else int(self._seeds.integers(0, 2**63 - 1))
        # n > 1: the first sample computes the prompt but its last token, then the others fork from it and
        # share those blocks; each computes the last token itself (copying the shared partial block on write).
        fork = params.n > 1 and len(ids) > 1
        if images is not None and images.end >= len(ids):  # (a span attended both ways must not be cut for the fork)
            fork = False
        sequences = []
        for index in range(params.n):
            seq = Request(
                seq_id=f"{request_id}#{index}", parent=parent, index=index, prompt_token_ids=ids, params=params,
                max_tokens=max_tokens, seed=(base_seed + index) % 2**63,
            )  # fmt: skip
            seq.grammar = grammars[index] if grammars else None
            seq.controls = controls
            parent.sequences.append(seq)
            self.output_processor.add_sequence(seq)  # may refuse the stop strings: before anything is queued
            sequences.append(seq)
        self.output_processor.add_request(parent)
        admitted = []
        for seq in sequences:
            if fork and seq.index > 0:
                parent.unforked.append(seq)
            else:
                seq.hold_at = len(ids) - 1 if fork else None
                admitted.append(seq)
        self._admit(parent, admitted)
        return request_id

    def _priority(self, priority) -> int:
        """An int; other than 0 only under scheduling_policy "priority" (vLLM refuses it under fcfs too)."""
        if isinstance(priority, (bool, np.bool_)) or not isinstance(priority, (int, np.integer)):
            raise ValueError(f"priority must be an int (got {type(priority).__name__})")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs scheduling_policy 'priority' (this engine's is "
                             f"{self.config.scheduling_policy!r})")  # fmt: skip
        return int(priority)

    def _checked_prompt(self, prompt: PromptType, params) -> tuple[str | None, list[int], Any]:
        """(text, token ids cut as params' truncate_prompt_tokens asks, images); an empty prompt or an id outside the
        vocabulary is a ValueError."""
        text, ids, images = self._prompt_inputs(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = self._truncated(ids, params.truncate_prompt_tokens, images)
        vocab = self.loaded.config.vocab_size
        if not ids:
            raise ValueError("prompt must not be empty")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt_token_ids must lie in [0, {vocab})")
        return text, ids, images

    def _new_request_id(self, request_id: str | None) -> str:
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return request_id

    def _add_pooling_request(self, request_id: str | None, prompt: PromptType, params, lora_request, priority: int = 0) -> str:
        """A pooling engine's request: its prompt, run as one greedy token that is dropped (engine/pooling.py)."""
        if self.pooler is None:
            raise ValueError("pooling_params need an engine with runner='pooling' (this model generates: pass a "
                             "SamplingParams)")  # fmt: skip
        if isinstance(params, SamplingParams):
            raise ValueError("this engine runs a pooling model (runner='pooling'): it embeds or classifies prompts "
                             "(LLM.embed, LLM.classify, LLM.reward, LLM.encode) and does not generate")  # fmt: skip
        params = self.pooler.check(params)
        request_id = self._new_request_id(request_id)
        text, ids, images = self._checked_prompt(prompt, params)
        if images is not None:
            raise ValueError("prompt: a pooling engine takes text prompts only")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len ({self.max_model_len}); "
                             "truncate_prompt_tokens=-1 keeps its last max_model_len")  # fmt: skip
        if self._blocks_held(len(ids)) > self.runner.num_blocks:
            raise ValueError(f"prompt needs {self._blocks_held(len(ids))} KV blocks but the whole pool has "
                             f"{self.runner.num_blocks}; raise num_kv_blocks")  # fmt: skip
        parent = ParentRequest(request_id, text, ids, POOLING_RUN, priority=priority)
        parent.pooling, parent.pool_code = params, self.pooler.code_for(params)
        if lora_request is not None:
            parent.lora_request, parent.cache_salt = lora_request, lora_request.cache_salt
        seq = Request(seq_id=f"{request_id}#0", parent=parent, index=0, prompt_token_ids=ids, params=POOLING_RUN,
                      max_tokens=1, seed=0)  # fmt: skip
        parent.sequences.append(seq)
        self.output_processor.add_sequence(seq)
        self.output_processor.add_request(parent)
        self._admit(parent, [seq])
        return request_id

    def _admit(self, parent: ParentRequest, sequences: list[Request]) -> None:
        """Into the scheduler; a LoRA request once its adapter holds a device slot (it waits while all are held)."""
        if parent.lora_request is not None:
            if self._lora_waiting or not self._take_lora_slot(parent):  # first come, first served
                self._lora_waiting.append((parent, sequences))
                return
        for seq in sequences:
            self.scheduler.add(seq)

    def _take_lora_slot(self, parent: ParentRequest) -> bool:
        slot = self.lora.acquire(parent.lora_request)
        if slot is None:
            return False
        parent.lora_slot = slot
        self._lora_held[parent.request_id] = parent
        return True

    def _lora_bookkeeping(self, outputs: list[RequestOutput]) -> None:
        """Finished requests give their adapter slots back; waiting LoRA requests take free ones."""
        if self._lora_held:
            for out in outputs:
                if out.finished and out.request_id in self._lora_held:
                    self.lora.release(self._lora_held.pop(out.request_id).lora_slot)
        while self._lora_waiting:
            parent = self._lora_waiting[0][0]
            try:
                if not self._take_lora_slot(parent):
                    break
            except ValueError as exc:  # its adapter, read again, is gone (removed, its folder deleted): it alone ends
                logger.warning("request %s aborted: its LoRA adapter could not be loaded (%s)", parent.request_id, exc)
                aborted = self.abort_request_with_output(parent.request_id)  # (takes it off the waiting list)
                if aborted is not None:
                    outputs.append(aborted)
                continue
            for seq in self._lora_waiting.popleft()[1]:
                self.scheduler.add(seq)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into host memory ahead of its requests (ValueError for a bad one)."""
        if self.lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True")
        self.lora.load(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests still running with it finish with it); False if it is not loaded."""
        return self.lora is not None and self.lora.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else self.lora.list()

    def _add_beam_search(self, parent: ParentRequest, max_tokens: int, grammar) -> None:
        params = parent.params
        eos = [] if params.ignore_eos else self.eos_token_ids
        search = BeamSearch(params.best_of, max_tokens, eos, params.length_penalty, params.early_stopping)
        if search.num_candidates > MAX_LOGPROBS:
            raise ValueError(
                f"best_of (the beam width) must be at most {MAX_LOGPROBS // max(2, 1 + len(eos))} for this model: "
                f"beam search ranks max(2, 1 + {len(eos)} EOS ids) x width candidates per beam (got {params.best_of})"
            )
        root = self._beam_sequence(parent, search, 0, [])
        root.grammar = grammar
        search.running = parent.sequences = [root]
        self.output_processor.add_beam_search(parent, search)
        self._admit(parent, [root])

    def _beam_sequence(self, parent: ParentRequest, search: BeamSearch, number: int, outputs: list[int]) -> Request:
        """A running beam: a plain sequence asking for its next position's top candidates, never sampled from."""
        row_params = SamplingParams(temperature=0.0, max_tokens=search.max_tokens, logprobs=search.num_candidates,
                                    ignore_eos=True)  # fmt: skip
        return Request(
            seq_id=f"{parent.request_id}#beam{number}", parent=parent, index=0, prompt_token_ids=parent.prompt_token_ids,
            params=row_params, max_tokens=search.max_tokens, seed=0, output_token_ids=outputs,
        )  # fmt: skip

    def _update_beams(self, live: list[ScheduledSequence], result: StepResult) -> list[str]:
        """Record each computed beam's candidates; where every beam of a search has them, take the next beams
        (forked from their parents, which are freed). Returns the searches that ended."""
        if not self.output_processor.beams:
            return []
        moved: dict[str, BeamSearch] = {}
        for item in live:
            req = item.request
            if item.samples and req.is_beam:
                search = self.output_processor.beams[req.parent.request_id]
                k = search.num_candidates
                search.tops[req] = (result.top_ids[item.row, :k], result.top_logprobs[item.row, :k])
                moved[req.parent.request_id] = search
        ended = []
        for request_id, search in moved.items():
            if all(seq in search.tops for seq in search.running):
                self._advance_beams(self.output_processor.parents[request_id], search)
                if search.done:
                    ended.append(request_id)
        return ended

    def _advance_beams(self, parent: ParentRequest, search: BeamSearch) -> None:
        beams = search.running
        constrained = beams[0].grammar is not None
        ends = (lambda b, token: beams[b].grammar.ends_after(token)) if constrained else None
        chosen = search.advance([search.tops[b] for b in beams], [b.output_token_ids for b in beams], ends)
        children = []
        for beam_index, token in chosen:
            beam = beams[beam_index]
            self._beam_count += 1
            child = self._beam_sequence(parent, search, self._beam_count, [*beam.output_token_ids, token])
            if constrained:  # the child's grammar: its parent's, advanced by the chosen token
                child.grammar = beam.grammar.copy()
                child.grammar.accept(token)
            self.scheduler.fork(beam, child)  # before the parents let go of the shared blocks
            children.append(child)
        for beam in beams:
            self.scheduler.finish(beam, RequestStatus.FINISHED_STOPPED)
        search.tops.clear()
        search.running = parent.sequences = children
        self.scheduler.add_forked(children)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks at once; False if it is unknown or already finished."""
        return self.abort_request_with_output(request_id) is not None

    def abort_request_with_output(self, request_id: str) -> RequestOutput | None:
        """abort_request, returning the aborted request's final output (None if it is unknown or finished)."""
        parent = self.output_processor.parents.get(str(request_id))
        if parent is None:
            return None
        search = self.output_processor.beams.get(parent.request_id)
        if search is not None:
            search.done = True
        for seq in parent.sequences:
            if not seq.finished:
                self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
        if self.spec is not None:
            self.spec.release_stopped(self.scheduler)
        if parent.lora_request is not None:
            self._lora_waiting = collections.deque(w for w in self._lora_waiting if w[0] is not parent)
            if self._lora_held.pop(parent.request_id, None) is not None:
                self.lora.release(parent.lora_slot)
        return self.output_processor.abort(parent.request_id)

    def get_prompt_token_ids(self, request_id: str) -> list[int]:
        """The token ids of an unfinished request's prompt (as rendered and tokenized by add_request)."""
        return list(self.output_processor.parents[str(request_id)].prompt_token_ids)

    def has_request(self, request_id: str) -> bool:
        """Whether the request is queued or running."""
        return str(request_id) in self.output_processor.parents

    def num_waiting_requests(self) -> int:
        """User requests with a sequence waiting to be admitted."""
        return len({seq.parent.request_id for seq in self.scheduler.waiting})

    def has_unfinished_requests(self) -> bool:
        if self.weight_sync.paused:  # asleep: requests queued meanwhile wait for wake_up
            return False
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._lora_waiting)

    # -- a trainer's rollouts: weights replaced in place, memory given back (engine/weight_sync.py) ------

    def update_weights(self, weights, *, mapping=None, in_flight: str = "finish", lora_request: LoRARequest | None = None,
                       copy: bool = False) -> dict[str, Any]:  # fmt: skip
        """Replace the model's weights (all or some) in place with `weights`: a pytree of arrays on the devices (an
        NNX State of the port, a dict by HF name or parameter path, or a trainer's names through `mapping`), or a
        folder of safetensors; with lora_request, some of that adapter's tensors. Requests in flight are finished
        first or aborted (`in_flight`); the prefix cache is dropped. ValueError naming every unknown or misshapen
        tensor, the weights unchanged. copy: keep none of the given arrays (a caller that donates them later).
        -> counts, seconds, and the outputs of the requests settled."""
        return self.weight_sync.update_weights(weights, mapping, in_flight, lora_request, copy)

    def sleep(self, level: int = 1, *, in_flight: str = "finish", queue_requests: bool = False) -> dict[str, Any]:
        """Give device memory back: the KV pool freed and the weights moved to host memory (level 1) or dropped
        (level 2: new ones come through update_weights). Requests meanwhile are refused (EngineAsleepError) or, with
        queue_requests, queued until wake_up. -> device bytes in use before and asleep."""
        return self.weight_sync.sleep(level, in_flight, queue_requests)

    def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """Bring back "weights" and/or "kv_cache" (default both), in either order; nothing compiles."""
        return self.weight_sync.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.weight_sync.sleeper.asleep

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prompt prefix (a benchmark's cold start, or K/V a caller no longer trusts).
        False, and nothing forgotten, while sequences hold KV blocks: their blocks are their context, not a cache."""
        pool = self.scheduler.kv.pool
        if pool.num_used:
            logger.warning("reset_prefix_cache refused: %d KV blocks are still held by sequences", pool.num_used)
            return False
        dropped = pool.reset_prefix_cache()
        logger.info("prefix cache reset: %d cached blocks forgotten", dropped)
        return True

    def start_profile(self, profile_prefix: str | None = None) -> str:
        """vLLM's: trace everything the process runs until stop_profile, under config.profiler_dir; -> the folder."""
        return self.profiler.start(profile_prefix)

    def stop_profile(self) -> str:
        """End the trace begun by start_profile and write it; -> its run's folder."""
        return self.profiler.stop()

    def close(self) -> None:
        """Release a process group's followers (done at exit too); nothing otherwise."""
        self.runner.close()

    @property
    def compile_seconds(self) -> float:
        """Time spent compiling (or loading) executables, at warm-up or on first use."""
        return self.runner.compile_seconds

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: returns the outputs of every request that progressed or finished."""
        if self.weight_sync.paused:
            return []
        compiles_before = compile_monitor.unexpected_in_this_thread()
        try:
            outputs = self._step()
            if self.lora is not None:
                self._lora_bookkeeping(outputs)
            return outputs
        finally:
            self.num_compiles_after_warmup += compile_monitor.unexpected_in_this_thread() - compiles_before

    def _step(self) -> list[RequestOutput]:
        """schedule -> execute -> update. With async scheduling the host schedules and dispatches step N+1
        before it reads step N's tokens: the inputs N+1 takes from N never leave the device (PLACEHOLDER on
        the host until read). Sequences that end in step N cost N+1 one wasted row, whose results are dropped.
        Where N+1's sampling needs N's tokens on the host (a grammar's mask, a penalty's history), only its
        forward is dispatched, and its sampler once N is read and processed (docs/design.md, "Structured outputs").
        """
        step, self._in_flight = self._in_flight, None
        if step is None:
            step = self._schedule_and_dispatch(None)
            if step is None:
                return []
        if self.config.async_scheduling and self._can_overlap(step):
            self._in_flight = self._schedule_and_dispatch(step)
            self.num_overlapped_steps += self._in_flight is not None
        try:
            return self._update(step.scheduler_output, step.dispatched.fetch())
        finally:
            following = self._in_flight
            if following is not None and following.sample_later:
                self.runner.sample_later(following.scheduler_output, following.dispatched)
                following.sample_later = False

    def _schedule_and_dispatch(self, prev: InFlightStep | None) -> InFlightStep | None:
        """schedule + execute (queued on the device, read back later); None when nothing can run."""
        if self.spec is not None and prev is None:  # proposals need every sequence's tokens on the host
            self.spec.propose(self.scheduler)
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            if prev is None and self.scheduler.has_unfinished() and not scheduler_output.preempted:  # admission checks prevent it
                raise RuntimeError("scheduler made no progress: the KV pool cannot hold any waiting request")
            return None
        later = prev is not None and scheduler_output.needs_host_tokens
        dispatched = self.runner.execute_model(scheduler_output, prev.dispatched if prev else None, defer_sampling=later)
        return InFlightStep(scheduler_output, dispatched, later)

    def _update(self, scheduler_output: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """update: stop strings from the detokenizer, then the scheduler takes the tokens (and checks every
        stop), the beams advance, and the output processor builds the outputs. A step that verified proposals
        is taken one emitted position at a time (SpecDecoder.take). Then a proposer with per-sequence state (a draft
        model's KV blocks) lets go of the sequences that stopped running in it (finished or preempted)."""
        if self.spec is None:
            return self._update_once(scheduler_output, result)
        if self.spec.verifies(scheduler_output):
            outputs = self.spec.take(scheduler_output, result.tokens, lambda out: self._update_once(
                out, result if out is scheduler_output else dataclasses.replace(result, prompt=None)))
        else:
            outputs = self._update_once(scheduler_output, result)
        self.spec.release_stopped(self.scheduler)
        return outputs

    def _update_once(self, scheduler_output: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        stop_strings = self.output_processor.detokenize(scheduler_output, result)
        live = self.scheduler.update(scheduler_output, result.tokens, stop_strings)
        ended_searches = self._update_beams(live, result)
        return self.output_processor.process(live, result, ended_searches, self.scheduler.finished_items)

    def _can_overlap(self, step: InFlightStep) -> bool:
        """The next step can be formed without this one's results: no beam search (the host picks the next beams
        from them). Grammars and penalties need them only to sample, which waits (sample_later). Speculative
        decoding proposes from them, and a verifying step decides where the next one starts."""
        if self.spec is not None and (self.spec.verifies(step.scheduler_output) or self.spec.may_propose(self.scheduler)):
            return False
        return not self.output_processor.beams

    # -- introspection -------------------------------------------------------------------------

    @property
    def group_error(self):
        """A stalled process group (the process is about to end); None otherwise."""
        return self.runner.group_error

    @property
    def needs_heartbeat(self) -> bool:
        return self.runner.needs_heartbeat

    def heartbeat(self) -> None:
        """Between requests: check the process group's followers (ProcessGroupError if one is gone)."""
        self.runner.heartbeat()

    def get_stats(self) -> dict[str, Any]:
        return {
            **self.scheduler.kv_stats(),
            "num_computed_tokens": self.scheduler.num_computed_tokens_total,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_compiles_after_warmup": self.num_compiles_after_warmup,
            # the KV pool's bytes a token takes over every layer (and device): MLA's latent rows, K/V heads otherwise
            "kv_bytes_per_token": self.runner.block_bytes // self.runner.block_size,
            "num_overlapped_steps": self.num_overlapped_steps,
            "warmup_seconds": self.warmup_seconds,
            **(self.spec.stats() if self.spec is not None else {}),
            **(self.mm.stats() if self.mm is not None else {}),
        }

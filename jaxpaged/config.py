"""EngineConfig: every engine knob in one place, validated once, with defaults per platform."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

ATTENTION_BACKEND_CHOICES = ("auto", "reference", "pallas", "native")
MATMUL_BACKEND_CHOICES = ("auto", "xla", "native")
QUANTIZATION_CHOICES = ("none", "gguf", "int8", "fp8")  # how weights load (models/loader.py, models/quantization.py)
KV_CACHE_DTYPE_CHOICES = ("auto", "int8", "fp8")  # pallas_kernels/kv_quant.py
MOE_KERNEL_CHOICES = ("loop", "triton")  # models/moe.py's expert loops; triton: pallas_kernels/moe_gemm.py
SCHEDULING_POLICY_CHOICES = ("fcfs", "priority")  # core/scheduler.py
RUNNER_CHOICES = ("auto", "generate", "pooling")  # pooling: jaxpaged/engine/pooling.py


def _positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (got {value!r})")


def option(default, help: str, *, group: str = "engine", choices=None):
    """An EngineConfig field that is also a flag of both CLIs, with this help (engine/arg_utils.py derives them)."""
    return dataclasses.field(default=default, metadata={"help": help, "group": group, "choices": choices})


@dataclasses.dataclass
class EngineConfig:
    model: str | None = option(None, "local HF folder, .gguf file, config.json (random weights), or a Hugging Face Hub id "
                               "(org/name, from the HF cache or downloaded: safetensors only); default: the built-in model", group="model")  # fmt: skip
    revision: str | None = option(None, "with a hub id: the branch, tag or commit to load (default: main)", group="model")
    hf_config: str | None = option(None, "with an Orbax checkpoint as the model: the HF folder or config.json it is a "
                                   "checkpoint of, whose tokenizer files it uses too (default: a config.json found in or "
                                   "above the checkpoint's folder); see docs/rl.md", group="model")  # fmt: skip
    dtype: str = option("auto", "float32, bfloat16, float16, or auto (float32 on CPU, bfloat16 on GPU/TPU; float16 on GPUs without bfloat16, compute capability below 8.0)", group="model")
    quantization: str | None = option(None, "int8 or fp8 (e4m3): linear weights quantized per output channel at load; gguf: a GGUF's "
                                      "Q8_0/Q4_0/Q4_1/Q4_K weights kept quantized (compressed-tensors, GPTQ and AWQ checkpoints always are); none: every weight dequantized to dtype (default: "
                                      "as stored, except that a GGUF is dequantized on CPU, where float matmuls are faster)",
                                      group="model", choices=QUANTIZATION_CHOICES)  # fmt: skip
    quantize_activations: bool = option(False, "with int8/fp8 per-channel weights: quantize each matmul's input too, one scale per token, "
                                        "so the dot runs in 8 bits (W8A8, as vLLM's fp8 and int8 schemes); off: weight-only", group="model")  # fmt: skip
    kv_cache_dtype: str = option("auto", "KV cache element type: auto (the model's dtype), int8 or fp8 (8 bits, one scale per "
                                 "token and head: about twice the tokens of bfloat16)", choices=KV_CACHE_DTYPE_CHOICES)  # fmt: skip
    max_model_len: int | None = option(None, "longest prompt + answer (default: the model's context)")
    max_num_seqs: int | None = option(None, "most sequences in one step (default: 64 on CPU, 256 on GPU/TPU)")
    max_num_batched_tokens: int | None = option(None, "token budget per step (default: 256 on CPU, 2048 on GPU/TPU)")
    num_kv_blocks: int | None = option(None, "KV cache size in blocks, overriding kv_cache_memory_fraction (default: sized from memory)")
    kv_cache_memory_fraction: float | None = option(
        None, "share of free memory for the KV cache (default: 0.9 on GPU/TPU; on CPU a 2 GiB budget, or this share of free RAM)")  # fmt: skip
    block_size: int = option(16, "tokens per KV block (default: 16)")
    tensor_parallel_size: int = option(1, "split the model over this many devices, a \"model\" mesh axis; see docs/models.md (default: 1)")
    pipeline_parallel_size: int = option(1, "split the layers into this many stages, each on its own tensor_parallel_size devices; "
                                         "see docs/distributed.md (default: 1)")  # fmt: skip
    data_parallel_size: int = option(1, "run this many independent replicas of the engine, each on its own devices, behind one "
                                     "request router; see docs/distributed.md (default: 1)")  # fmt: skip
    attention_backend: str = option("auto", "attention implementation (default: auto: the Pallas kernel on GPU/TPU, the native kernel on CPU)",
                                    choices=ATTENTION_BACKEND_CHOICES)  # fmt: skip
    matmul_backend: str = option("auto", "matmul implementation (default: auto: native, with weights packed at load, for float32 on one "
                                 "CPU device with AVX-512; else XLA's dot)", choices=MATMUL_BACKEND_CHOICES)  # fmt: skip
    moe_kernel: str = option("loop", "how a MoE layer runs its experts: loop (over the experts in use; on GPU a fixed count "
                             "of row tiles) or triton (on GPU one grouped-GEMM kernel launch per expert projection and "
                             "layer, which also keeps an MXFP4 checkpoint's experts 4-bit; on CPU that kernel "
                             "interpreted, for tests) (default: loop)",
                             choices=MOE_KERNEL_CHOICES)  # fmt: skip
    disable_hybrid_kv_cache_manager: bool = option(False, "models mixing windowed and global layers (Gemma 2/3, some "
        "Qwen2): keep every block for every layer, the window a mask, instead of KV cache groups whose windowed layers give "
        "back what their window left (vLLM's flag)")
    fused_kv_write: bool = option(False, "one executable a step: the forward writes the step's K/V into the donated cache "
                                  "itself, instead of a forward and then a write donating the cache the forward read (on "
                                  "a GPU that second call's donation may hold the host until the forward is done; on "
                                  "XLA:CPU the fused step copies the cache, so it is slower there); not with "
                                  "pipeline_parallel_size > 1 (default: off)")  # fmt: skip
    fuse_projections: bool = option(False, "lay each layer's q/k/v projections out as one weight, and gate/up as one, "
                                    "at load (as vLLM stores them), so a step runs one dot for each instead of XLA "
                                    "concatenating the weights at run time; the shared attention and gated MLP only; "
                                    "not with enable_lora (default: off)")  # fmt: skip
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes seen before (default: on)")
    batch_invariant: bool = option(False, "a request's tokens and logprobs never depend on the rest of the batch (one step shape; slower)")
    async_scheduling: bool = option(True, "schedule and pack the next step while the device runs this one; outputs are identical (default: on)")
    scheduling_policy: str = option("fcfs", "fcfs: requests are served in arrival order; priority: by each request's "
                                    "priority, lower first, then arrival, a shortage of KV blocks preempting the "
                                    "lowest (vLLM's) (default: fcfs)", choices=SCHEDULING_POLICY_CHOICES)  # fmt: skip
    precompile: bool = option(True, "compile every step bucket at start-up, so no request waits for a compile; off, each bucket "
                              "compiles (or loads from the cache) on first use (default: on for LLM and the server, off for generate)")  # fmt: skip
    background_compile: bool | None = option(
        None, "with precompile: serve once the largest step bucket is compiled and compile the others in the background, "
        "a step meanwhile padded to the smallest bucket ready (default: on for GPU/TPU, where compiling every bucket "
        "takes a minute; off on CPU)")  # fmt: skip
    enable_lora: bool = option(False, "serve LoRA adapters (PEFT's format) over the base model, several in one step; "
                               "see docs/lora.md (default: off)", group="lora")  # fmt: skip
    max_loras: int = option(4, "with enable_lora: adapters resident on the device at once, each a slot of the stacked "
                            "LoRA arrays; a request whose adapter finds no free slot waits (default: 4)", group="lora")  # fmt: skip
    max_lora_rank: int = option(16, "with enable_lora: the largest adapter rank r accepted; every slot is this wide "
                                "(default: 16)", group="lora")  # fmt: skip
    max_cpu_loras: int | None = option(None, "with enable_lora: adapters kept loaded in host memory, least recently used "
                                       "evicted (default: max_loras)", group="lora")  # fmt: skip
    lora_target_modules: str | None = option(None, "with enable_lora: the projections adapters may target, comma-separated "
                                             "(q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj); each costs two "
                                             "small matmuls per step (default: all seven)", group="lora")  # fmt: skip
    distributed: bool = option(False, "join a multi-process group that JAX detects by itself (TPU pod slices, SLURM, Open MPI); "
                               "see docs/distributed.md", group="distributed")  # fmt: skip
    coordinator_address: str | None = option(None, "host:port of process 0, which coordinates a multi-process group", group="distributed")
    num_processes: int | None = option(None, "processes in the group (each started by you, with its --process-id)", group="distributed")
    process_id: int | None = option(None, "this process's index in the group, 0 to num_processes - 1 (0 serves, the others execute)",
                                    group="distributed")  # fmt: skip
    distributed_timeout_s: float = option(120.0, "seconds the group may take to form, and process 0 may wait on the others "
                                          "during a step, before it fails (default: 120)", group="distributed")  # fmt: skip
    speculative_config: dict | str | None = option(None, "speculative decoding, vLLM's fields as a JSON object, e.g. "
                                                    "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'; see "
                                                    "docs/speculative_decoding.md (default: off)", group="speculative")  # fmt: skip
    limit_mm_per_prompt: dict | str | None = option(None, "vision-language models: the most images one prompt may hold, as JSON, "
                                                    "e.g. '{\"image\": 4}' (default: no limit but the context's)", group="vision")  # fmt: skip
    mm_processor_kwargs: dict | str | None = option(None, "vision-language models: settings for the model's image processor, as "
                                                    "JSON, e.g. '{\"max_soft_tokens\": 560}' (Gemma 4) or "
                                                    "'{\"max_pixels\": 1003520}' (Qwen-VL); a request's own "
                                                    "mm_processor_kwargs override them (default: the checkpoint's)",
                                                    group="vision")  # fmt: skip
    max_num_encoder_input_tokens: int | None = option(None, "vision-language models: image patches the vision encoder runs in "
                                                      "one step, its largest compiled batch; a larger image is refused "
                                                      "(default: one largest image's, at least max_num_batched_tokens)",
                                                      group="vision")  # fmt: skip
    encoder_cache_size: int | None = option(None, "vision-language models: image embeddings (placeholder tokens) the device "
                                            "keeps, so a repeated image is not encoded again (default: two full encoder "
                                            "steps' worth)", group="vision")  # fmt: skip
    allowed_local_media_path: str | None = option(None, "images may be read from local files under this folder (file:// URLs "
                                                  "or paths; default: none)", group="vision")  # fmt: skip
    allowed_media_domains: str | None = option(None, "images may be fetched over http(s) from these hosts, comma-separated "
                                               "(default: none)", group="vision")  # fmt: skip
    runner: str = option("auto", "generate, or pooling: embeddings and classifiers (LLM.embed, LLM.classify, LLM.score, "
                         "/v1/embeddings); auto: pooling for a checkpoint that is an embedding model (an architecture "
                         "*Model) or a classifier (*ForSequenceClassification), else generate", group="model",
                         choices=RUNNER_CHOICES)  # fmt: skip
    pooler_config: Any = option(None, "with runner pooling: how to pool, as JSON, e.g. '{\"pooling_type\": \"MEAN\", "
                                "\"normalize\": false}' (pooling_type LAST, MEAN or CLS; default: the checkpoint's "
                                "sentence-transformers config, else LAST, normalized)", group="model")  # fmt: skip
    generation_config: str = option("auto", "default sampling parameters of requests that leave them unset (LLM.generate "
                                    "without SamplingParams, the server's fields left out): auto: the model's "
                                    "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                                    "max_new_tokens), as vLLM; vllm: vLLM's own defaults; or a folder holding one", group="model")  # fmt: skip
    override_generation_config: Any = option(None, "generation config fields set over the model's, as JSON, e.g. "
                                             "'{\"temperature\": 0.5}'", group="model")  # fmt: skip
    hf_overrides: dict | str | None = option(None, "fields set over the checkpoint's config.json (an HF folder's), as "
                                             "JSON, e.g. '{\"is_causal\": false}' for gte-Qwen2's bidirectional "
                                             "attention (vLLM's --hf-overrides)", group="model")  # fmt: skip
    enable_prompt_embeds: bool = option(False, "accept prompts given as embeddings ({\"prompt_embeds\": [T, hidden]} in "
                                        "LLM.generate; the server's prompt_embeds field, base64 of a torch.save'd tensor): "
                                        "each step then carries an embeddings input beside the token ids; Llama-like "
                                        "models, not with pipeline parallelism, speculative decoding or a pooling runner "
                                        "(default: off)", group="model")  # fmt: skip
    profiler_dir: str | None = option(None, "folder for JAX profiler traces taken between LLM.start_profile() and "
                                      "stop_profile() (the server's POST /start_profile and /stop_profile, served "
                                      "only with it), as vLLM's VLLM_TORCH_PROFILER_DIR (default: none, profiling off)")  # fmt: skip
    seed: int = 0
    # an Orbax checkpoint's leaf names -> the port's parameter paths or HF names: a dict or a callable, a value None
    # skipping a leaf, (name, fn) transforming it (models/orbax_io.py)
    checkpoint_mapping: Any = None
    compilation_cache_dir: str | None = None  # JAX's persistent cache, for tensor parallel; default under the cache root
    cache_dir: str | None = None  # GGUF conversion cache root
    platform: str | None = None  # "cpu", "gpu" or "tpu"; default: the device JAX runs on

    @property
    def devices_per_replica(self) -> int:
        """Devices one engine replica spans: its pipeline stages, each tensor_parallel_size wide."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    def _check_distributed(self) -> None:
        for name in ("num_processes",):
            _positive_int(name, getattr(self, name), allow_none=True)
        if self.process_id is not None and (isinstance(self.process_id, bool) or not isinstance(self.process_id, int)
                                            or not 0 <= self.process_id < (self.num_processes or 1)):  # fmt: skip
            raise ValueError(f"process_id must be in [0, num_processes) (got {self.process_id!r} of {self.num_processes!r})")
        if (self.num_processes or 1) > 1 and (self.coordinator_address is None or self.process_id is None):
            raise ValueError("num_processes > 1 needs coordinator_address (host:port of process 0) and process_id")
        if not isinstance(self.distributed_timeout_s, (int, float)) or self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be a positive number (got {self.distributed_timeout_s!r})")

    def _check_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a bool (got {self.enable_lora!r})")
        for name in ("max_loras", "max_lora_rank"):
            _positive_int(name, getattr(self, name))
        _positive_int("max_cpu_loras", self.max_cpu_loras, allow_none=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        from jaxpaged.models.lora import parse_targets

        parse_targets(self.lora_target_modules)
        if self.enable_lora and self.fuse_projections:
            raise ValueError("enable_lora needs fuse_projections off: adapters wrap the separate q/k/v and gate/up "
                             "projections, which fuse_projections replaces")  # fmt: skip
        if self.enable_lora and (self.pipeline_parallel_size > 1 or self.data_parallel_size > 1):
            raise ValueError("enable_lora needs pipeline_parallel_size and data_parallel_size 1 (tensor parallelism is supported)")
        from jaxpaged import distributed

        if self.enable_lora and distributed.is_multiprocess():
            raise ValueError("enable_lora is not supported in a multi-process group (one process, tensor parallelism, is)")

    def _check_vision(self) -> None:
        from jaxpaged.utils.json_option import json_object

        _positive_int("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens, allow_none=True)
        _positive_int("encoder_cache_size", self.encoder_cache_size, allow_none=True)
        limits = self.limit_mm_per_prompt
        if limits is not None:
            limits = json_object("limit_mm_per_prompt", limits, ("image", "video"))
            for name, value in limits.items():
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"limit_mm_per_prompt[{name!r}] must be a non-negative integer (got {value!r})")
        self.limit_mm_per_prompt = limits
        if self.mm_processor_kwargs is not None:  # (its keys checked against the model's processor when it loads)
            self.mm_processor_kwargs = json_object("mm_processor_kwargs", self.mm_processor_kwargs, None) or None
        if isinstance(self.allowed_media_domains, (list, tuple)):
            self.allowed_media_domains = ",".join(self.allowed_media_domains)

    @property
    def media_domains(self) -> tuple[str, ...]:
        return tuple(d.strip() for d in (self.allowed_media_domains or "").split(",") if d.strip())

    def __post_init__(self) -> None:
        from jaxpaged import distributed, platforms

        self._check_distributed()
        distributed.initialize(self)  # before anything starts a JAX backend
        import jax
        from jaxpaged.models.loader import resolve_dtype

        platform = platforms.get(self.platform)  # its defaults fill what the caller left out
        self.platform = platform.name
        self.dtype = platform.dtype if self.dtype == "auto" else resolve_dtype(self.dtype)
        if self.max_num_seqs is None:
            self.max_num_seqs = platform.max_num_seqs
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = platform.max_num_batched_tokens
        if self.kv_cache_memory_fraction is None:
            self.kv_cache_memory_fraction = platform.kv_cache_memory_fraction
        if self.background_compile is None:
            self.background_compile = platform.background_compile
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "pipeline_parallel_size",
                     "data_parallel_size"):  # fmt: skip
            _positive_int(name, getattr(self, name))
        for name in ("num_kv_blocks", "max_model_len"):
            _positive_int(name, getattr(self, name), allow_none=True)
        if not 1 <= self.block_size <= 256 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two between 1 and 256 (got {self.block_size})")
        if self.kv_cache_memory_fraction is not None and not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1] (got {self.kv_cache_memory_fraction})")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES} (got {self.quantization!r})")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES} (got {self.kv_cache_dtype!r})")
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKEND_CHOICES} (got {self.attention_backend!r})")
        if self.matmul_backend not in MATMUL_BACKEND_CHOICES:
            raise ValueError(f"matmul_backend must be one of {MATMUL_BACKEND_CHOICES} (got {self.matmul_backend!r})")
        if self.moe_kernel not in MOE_KERNEL_CHOICES:
            raise ValueError(f"moe_kernel must be one of {MOE_KERNEL_CHOICES} (got {self.moe_kernel!r})")
        for name in ("enable_prefix_caching", "batch_invariant", "async_scheduling", "precompile", "quantize_activations",
                     "fused_kv_write", "fuse_projections", "enable_prompt_embeds"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool (got {getattr(self, name)!r})")
        if self.fused_kv_write and self.pipeline_parallel_size > 1:
            raise ValueError("fused_kv_write needs pipeline_parallel_size 1 (each stage writes its own layers' K/V)")
        self._check_lora()
        self._check_vision()
        if self.scheduling_policy not in SCHEDULING_POLICY_CHOICES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICY_CHOICES} (got {self.scheduling_policy!r})")
        if self.runner not in RUNNER_CHOICES:
            raise ValueError(f"runner must be one of {RUNNER_CHOICES} (got {self.runner!r})")
        from jaxpaged.engine.generation_defaults import check_generation_config

        self.override_generation_config = check_generation_config(self.generation_config, self.override_generation_config)
        if self.hf_overrides is not None:
            from jaxpaged.utils.json_option import json_object

            self.hf_overrides = json_object("hf_overrides", self.hf_overrides, None) or None
        from jaxpaged.pooling_params import PoolerConfig

        self.pooler_config = PoolerConfig.parse(self.pooler_config)
        if self.pooler_config is not None and self.runner == "generate":
            raise ValueError("pooler_config needs runner 'pooling' (or 'auto' with a pooling checkpoint)")
        if self.checkpoint_mapping is not None and not (callable(self.checkpoint_mapping) or isinstance(self.checkpoint_mapping, dict)):
            raise ValueError(f"checkpoint_mapping must be a dict or a callable (got {type(self.checkpoint_mapping).__name__})")
        from jaxpaged.spec_decode.config import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.enable_prompt_embeds and (self.speculative_config is not None or self.pipeline_parallel_size > 1):
            raise ValueError("enable_prompt_embeds needs pipeline_parallel_size 1 and no speculative_config (their "
                             "steps take token ids only)")  # fmt: skip
        if self.speculative_config is not None and self.pipeline_parallel_size > 1:
            raise ValueError("speculative_config needs pipeline_parallel_size 1")
        method = self.speculative_config.method if self.speculative_config is not None else None
        if method in ("draft_model", "mtp", "eagle3") and (self.tensor_parallel_size > 1 or distributed.is_multiprocess()):
            # its runner would split (and replay to followers) as the target's does: not built or tested yet
            raise ValueError(f"speculative_config.method {method!r} needs tensor_parallel_size 1 and one process")
        if method in ("mtp", "eagle3") and (self.enable_lora or self.data_parallel_size > 1):
            raise ValueError(f"speculative_config.method {method!r} needs enable_lora off and data_parallel_size 1 (its "
                             "layer reads the target's steps as one runner lays them out)")  # fmt: skip
        if self.profiler_dir is not None and (not isinstance(self.profiler_dir, (str, os.PathLike)) or not str(self.profiler_dir)):
            raise ValueError(f"profiler_dir must be a folder path (got {self.profiler_dir!r})")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer (got {self.seed!r})")
        if self.batch_invariant and self.pipeline_parallel_size > 1:  # a micro-batch boundary moves with the batch
            raise ValueError("batch_invariant needs pipeline_parallel_size 1: where micro-batches cut a sequence "
                             "depends on the rest of the batch")  # fmt: skip
        wanted = self.devices_per_replica * self.data_parallel_size
        if wanted > jax.device_count():
            raise ValueError(f"data_parallel_size x pipeline_parallel_size x tensor_parallel_size = {self.data_parallel_size} x "
                             f"{self.pipeline_parallel_size} x {self.tensor_parallel_size} = {wanted} devices, but only "
                             f"{jax.device_count()} {jax.devices()[0].platform} device(s) are visible (on CPU, "
                             "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)")  # fmt: skip
        if distributed.is_multiprocess() and (self.pipeline_parallel_size > 1 or self.data_parallel_size > 1):
            raise ValueError("a multi-process group runs tensor parallelism only: pipeline_parallel_size and "
                             "data_parallel_size must be 1 there")  # fmt: skip
        if distributed.is_multiprocess() and self.tensor_parallel_size != jax.device_count():
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must span the group's {jax.device_count()} devices "
                             f"({jax.process_count()} processes x {jax.local_device_count()}): every process runs every step")  # fmt: skip
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence needs at least one token of budget in a step
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )

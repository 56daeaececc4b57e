"""The device side: parameters, the KV-block array and the jitted step, one compiled shape per token bucket.

A step's tokens are padded to a bucket T (`token_buckets`), its sequence slots to S = min(T, max_num_seqs), its
block tables to the width of max_model_len (attention loops over live context only). Each bucket compiles at
warm-up (or on first use with precompile off), is stored as an executable later starts load, and is called
directly, so no other shape can compile. The step only reads the cache; a second jitted call, donating it, writes
the new K/V in place. Under tensor parallelism both run under the runner's mesh (models/sharding.py).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged import distributed, platforms
from jaxpaged.config import EngineConfig
from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.core.state_slots import spare_state_slots
from jaxpaged.models import lora
from jaxpaged.models.fused_projections import fuse_projections
from jaxpaged.models.loader import DTYPES, LoadedModel
from jaxpaged.models.quantization import is_quantized, quantize_activations
from jaxpaged.models.weights import param_bytes
from jaxpaged.pallas_kernels import copy_blocks, kv_cache_shape
from jaxpaged.pallas_kernels.state_cache import HybridCache, copy_states
from jaxpaged.sampling_params import MAX_STOP_TOKEN_IDS
from jaxpaged.worker.bucket_compiles import BucketCompiles, token_buckets
from jaxpaged.worker.executable_cache import ExecutableCache
from jaxpaged.worker.input_batch import InputBatchBuilder, StepInputs
from jaxpaged.worker.kv_memory import KVMemory, kv_pool, kv_writer
from jaxpaged.worker.lora_slots import LoRASlots
from jaxpaged.worker.packing import Packed
from jaxpaged.worker.prompt_embeds_inputs import PromptEmbedsInputs
from jaxpaged.worker.sampler import DYNAMIC, NUM_TOP_LOGPROBS, SamplerPlan, SamplingMetadata, prompt_logprobs, sample, _blank as _blank_array
from jaxpaged.worker.sampler_plans import SamplerPlans
from jaxpaged.worker.step_output import DispatchedStep, StepRef, StepResult
from jaxpaged.worker.weight_update import LoadedLayout

# The sampler's small per-row knobs, packed in one buffer: SamplingMetadata less its three large arrays, sent apart
# (ModelRunner._sampling_args). Its structure is fixed once here (a dataclasses.replace per step cost ~25 us).
_LARGE_FIELDS = ("history", "bitmask", "suppress_ids", "logit_bias")
_KNOB_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingMetadata) if f.name not in _LARGE_FIELDS)
_KNOBS_TREEDEF = jax.tree_util.tree_structure(
    SamplingMetadata(**dict.fromkeys(_KNOB_FIELDS, 0), **dict.fromkeys(_LARGE_FIELDS)))


def logits_and_prompt(model, hidden: jax.Array, logit_rows: jax.Array, prompt_next_ids: jax.Array) -> tuple:
    """The sampling rows' logits, and every row's prompt logprobs when some request asked for them."""
    logits = model.compute_logits(hidden[logit_rows])
    t, k = hidden.shape[0], NUM_TOP_LOGPROBS
    blank = (jnp.zeros(t), jnp.zeros(t, jnp.int32), jnp.zeros((t, k), jnp.int32), jnp.zeros((t, k)))
    prompt = jax.lax.cond(
        jnp.any(prompt_next_ids >= 0),
        lambda: prompt_logprobs(model.compute_logits(hidden).astype(jnp.float32), prompt_next_ids),
        lambda: blank,
    )
    return logits, prompt


def pooled_sums(hidden: jax.Array, pool_rows: jax.Array, num_rows: int) -> jax.Array:
    """A pooling engine's rows: the sum of each row's pooled tokens' hidden states, float32 [num_rows, D]."""
    rows = jnp.where(pool_rows >= 0, pool_rows, num_rows)  # the rest into a dropped segment
    return jax.ops.segment_sum(hidden.astype(jnp.float32), rows, num_segments=num_rows + 1)[:num_rows]


class ModelRunner(BucketCompiles, KVMemory, LoRASlots):
    """The device side of the engine; its compiles, sizing and adapters live in the mixins' modules."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, max_model_len: int, *, eos_token_ids: Sequence[int] = (),
                 executable_dir=None, devices: Sequence[jax.Device] | None = None, pooling: bool = False,
                 keep_hidden: bool = False, mirrored_kv: tuple[int, int] = (0, 0), aux_layers: tuple[int, ...] = ()):  # fmt: skip
        self.config = config
        # speculative method "mtp": each step keeps its final hidden states for the MTP layer's shadow step (self.mtp,
        # spec_decode/mtp.py); other engines' forwards are unchanged
        self.keep_hidden = keep_hidden
        # speculative method "eagle3": what it keeps is the residual stream entering these layers, concatenated
        self.aux_layers = tuple(aux_layers)
        # (KV layers kept apart on the pool's block ids, their extra blocks): the MTP layer's cache, counted where
        # the pool is sized (worker/kv_memory.py)
        self.mirrored_kv = mirrored_kv
        self.mtp = None
        # a pooling engine (engine/pooling.py): the forward returns its rows' pooled hidden states, not prompt logprobs
        self.pooling = pooling
        # the devices this engine runs on: the first tensor_parallel_size of them (a data-parallel replica gets its own)
        self.devices = list(jax.devices() if devices is None else devices)
        self.device = self.devices[0]
        self.platform = platforms.get(config.platform)
        self.model_config = loaded.config
        self.block_size = config.block_size
        self.table_width = -(-max_model_len // self.block_size)
        self.history_width = self.table_width * self.block_size
        # batch-invariant: one step shape for everything, so no row's arithmetic depends on the step's size
        self.buckets = [config.max_num_batched_tokens] if config.batch_invariant else token_buckets(config.max_num_batched_tokens, config.max_num_seqs)
        self.dtype = DTYPES[loaded.dtype]
        quantized = any(is_quantized(m) for _, m in nnx.iter_modules(loaded.model))
        # what the plan reports: the scheme asked for (or a GGUF's platform default), else what the checkpoint holds
        self.weight_scheme = loaded.quantization if loaded.quantization not in (None, "none") else (
            "pre-quantized checkpoint" if quantized else "none")  # fmt: skip
        if any(getattr(m, "mx_scale", None) is not None for _, m in nnx.iter_modules(loaded.model)):
            self.weight_scheme = "MXFP4 experts kept 4-bit (the grouped GEMM decodes them)"  # models/mxfp4.py
        if config.quantize_activations:
            self.weight_scheme += " x 8-bit activations"
        self.lora_targets = lora.parse_targets(config.lora_target_modules) if config.enable_lora else ()
        if config.enable_lora:
            lora.check_architecture(loaded.config)
        # the weights as loaded, before this runner lays them out: where a weight update starts (weight_update.py)
        self.loaded_layout = LoadedLayout.of(loaded)
        t0 = time.perf_counter()
        self.matmul_backend = self.prepare_weights(loaded.model)
        self.startup_seconds = {"pack": time.perf_counter() - t0}
        self.compile_seconds = 0.0  # compiling or loading executables, at warm-up or on first use
        self.tp = config.tensor_parallel_size
        # hybrid models (windowed and global layers): KV cache groups, so local layers free what their window left
        self.kv_groups = self._kv_groups(config, loaded.config)
        # hybrid models: their linear layers' state per sequence beside the KV pool, a slot for each sequence that can
        # run at once and spares for speculative decoding's snapshots (pallas_kernels/state_cache.py; the scheduler's
        # HybridKVCacheManager hands them out)
        self.state_spec = loaded.model.state_spec() if hasattr(loaded.model, "state_spec") else None
        self.num_state_slots = config.max_num_seqs + spare_state_slots(config) if self.state_spec is not None else 0
        self._executable_dir = executable_dir
        # (function, bucket) -> executable: forward and write per token bucket, sample per number of sampling rows
        self._compiled: dict[tuple[str, int], jax.stages.Compiled] = {}
        # Where a lax.cond makes the host wait for the device (GPU), the step's executables hold none: prompt
        # logprobs are their own executable, run when a row wants them, and the sampler is compiled per plan.
        self._prompt_apart = not self.platform.device_conditionals
        self._max_suppress = MAX_STOP_TOKEN_IDS + len(eos_token_ids)
        self._pending: dict[int, Future] = {}  # token bucket -> its executables compiling in the background
        # the buckets a step may use now: all of them, unless background_compile has some still compiling
        self.ready_buckets: list[int] = list(self.buckets)
        self.background_compile_seconds: float | None = None  # warm-up's start to the last background compile done
        self._background: ThreadPoolExecutor | None = None
        self._blanks: dict[tuple, jax.Array] = {}  # (input, shape) -> a blank per-row input kept on the device
        self._blank_prompt_ids: dict[int, np.ndarray] = {}  # token bucket -> all -1
        self._dispatched: dict[int, DispatchedStep] = {}  # the last few steps, by seq
        self._num_dispatched = 0
        self.mm = None  # vision-language models: the encoder cache and its steps (_place; text only under PP)
        # enable_prompt_embeds: each step's given embeddings (worker/prompt_embeds_inputs.py); None: the step takes none
        self.prompt_embeds = PromptEmbedsInputs(self) if config.enable_prompt_embeds else None
        self._place(loaded)
        self.lora_weights = self._lora_slots(loaded.config) if config.enable_lora else None
        self.copy_width = config.max_num_seqs  # block copies per call (copy-on-write: about one per sequence)
        self.input_batch = InputBatchBuilder(self, eos_token_ids, self._max_suppress)
        # the "previous step's tokens" of a step that takes none; placed as the step places its own (replicated
        # under TP), so both kinds of step hit the one compiled executable
        self._no_sampled = self._put(np.zeros(config.max_num_seqs, np.int32))
        # a process group: the leader sends each device call to the followers, who replay it (follow())
        self.channel = distributed.StepChannel() if distributed.is_multiprocess() else None
        self.group_error: distributed.ProcessGroupError | None = None  # set when the group stalls (the leader's)
        if self.channel is not None and distributed.is_leader():
            atexit.register(self.close)
            distributed.watch(config.distributed_timeout_s, self._group_stalled)
        self._depth = 0  # device calls in progress: only the outermost is sent

    def prepare_weights(self, model: nnx.Module) -> str:
        """Lay loaded weights out in place for this runner: 8-bit activations, the platform's layout for its matmuls,
        LoRA's wrapped projections (before the split, so the graphdef holds them); the matmul path taken. Run at
        start-up, and traced again by a weight update on the new weights (worker/weight_update.py)."""
        if self.config.fuse_projections:  # first: every layout below then treats the fused Linears as any other
            fuse_projections(model, self.config.tensor_parallel_size)
        if self.config.quantize_activations and not quantize_activations(model, self.platform.fp8_dot_operands):
            raise ValueError("quantize_activations needs int8 or fp8 weights quantized per output channel (quantization="
                             "'int8' or 'fp8', or a compressed-tensors checkpoint); this model has none")  # fmt: skip
        backend = self.platform.prepare_model(
            model, self.config.matmul_backend, dtype=self.dtype, tensor_parallel_size=self.config.devices_per_replica,
            moe_kernel=self.config.moe_kernel,
        )  # fmt: skip
        if self.config.enable_lora:
            lora.attach(model, self.lora_targets)
        return backend

    # -- placement ----------------------------------------------------------------------------

    def _place(self, loaded: LoadedModel) -> None:
        """Weights and the KV pool onto this runner's devices (one, or a TP mesh), and the step's jitted functions."""
        self.graphdef, self.state = nnx.split(loaded.model)
        self.mesh = None
        if self.tp > 1:
            from jaxpaged.models.sharding import make_mesh, shard_params

            self.mesh = make_mesh(self.tp, self.devices)
            # KV heads may be widened to one per device, so the cache shape comes from the returned config.
            self.state, self.model_config = shard_params(self.state, self.model_config, self.mesh)
        if self.mesh is None:
            self.state = jax.device_put(self.state, self.device)
            replicated, new_kv = None, None
            self._forward = jax.jit(self._forward_impl)
            self._prompt = jax.jit(self._prompt_impl)
            self._samplers = self._sampler_plans({})
        else:
            from jax.sharding import NamedSharding, PartitionSpec

            from jaxpaged.models.sharding import new_kv_sharding

            replicated, new_kv = NamedSharding(self.mesh, PartitionSpec()), new_kv_sharding(self.mesh)
            # the second output: prompt logprobs, or the hidden states they are computed from apart
            self._forward = jax.jit(self._forward_impl, out_shardings=(replicated, replicated, new_kv, replicated))
            self._prompt = jax.jit(self._prompt_impl, out_shardings=replicated)
            self._samplers = self._sampler_plans({"out_shardings": (replicated, replicated)})
        from jaxpaged.multimodal.runner import encoder_runner

        self.images_off: str | None = None  # why a vision-language model runs on text only (encoder_runner)
        self.mm = encoder_runner(self, loaded, self.config)  # its cache before the pool, sized from what is left
        self.num_blocks = self._pool_size(param_bytes(self.state))
        cfg = self.model_config
        shape = kv_cache_shape(self.kv_layers, cfg.num_kv_heads, self.num_blocks, self.block_size, cfg.head_dim)
        self.kv_cache_dtype = self.config.kv_cache_dtype
        t0 = time.perf_counter()
        self.kv_cache, self._write, self._copy = kv_pool(
            shape, self.kv_cache_dtype, self.platform.kv_storage_dtype(self.dtype), self.mesh, self.device,
            None if self.kv_groups is None else self.kv_groups.layer_groups,
        )
        if self.state_spec is not None:
            self._attach_states()
        # fused_kv_write: the forward and the write as one executable, the cache donated to it (out: as it was placed)
        self._fused = None
        if self.config.fused_kv_write:
            shardings = {} if self.mesh is None else {"out_shardings": (
                replicated, replicated, jax.tree_util.tree_map(lambda x: x.sharding, self.kv_cache))}
            self._fused = jax.jit(self._fused_impl, donate_argnums=(1,), **shardings)
        jax.block_until_ready(self.kv_cache)
        self.startup_seconds["kv_cache"] = time.perf_counter() - t0

    def _attach_states(self) -> None:
        """A hybrid model's state arrays beside the KV pool, in one HybridCache, and their donated slot copy. Under a
        mesh they split by head (models/sharding.py), and the forward, the write and both copies take the cache's
        shardings, and the step's new states theirs."""
        spec, n = self.state_spec, self.num_state_slots
        if self.mesh is None:
            with jax.default_device(self.device):
                self.kv_cache = HybridCache(self.kv_cache, spec.empty(n))
            self._copy_states = jax.jit(copy_states, donate_argnums=(0,))
            return
        from jax.sharding import NamedSharding, PartitionSpec

        from jaxpaged.models.sharding import hybrid_cache_sharding, state_update_sharding

        split = hybrid_cache_sharding(self.mesh, spec, self.kv_cache_dtype)
        self.kv_cache = HybridCache(self.kv_cache, jax.jit(lambda: spec.empty(n), out_shardings=split.states)())
        write_fn = kv_writer(None if self.kv_groups is None else self.kv_groups.layer_groups)
        self._write = jax.jit(write_fn, donate_argnums=(0,), out_shardings=split)
        self._copy = jax.jit(copy_blocks, donate_argnums=(0,), out_shardings=split)
        self._copy_states = jax.jit(copy_states, donate_argnums=(0,), out_shardings=split)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        update = state_update_sharding(self.mesh, spec)
        self._forward = jax.jit(self._forward_impl, out_shardings=(replicated, replicated, update, replicated))

    @property
    def _step_name(self) -> str:
        """The executable whose presence marks a bucket compiled: the forward, or fused_kv_write's step."""
        return "forward" if self._fused is None else "step"

    @property
    def single_device(self) -> bool:
        """Everything on one device: executables can be stored on disk and compiled in the background."""
        return self.mesh is None

    @functools.cached_property
    def executables(self) -> ExecutableCache:
        """Executables stored on disk are for one device; under TP the XLA cache alone spares compiles. (Made on
        first use: sizing the pool may compile the sampler before _place has finished.)"""
        stored = self._executable_dir if self.single_device else None
        # the forward's outputs differ where prompt logprobs are computed apart: part of every stored step's key
        return ExecutableCache(stored, salt=f"{self.graphdef!r} prompt_apart={self._prompt_apart} pooling={self.pooling}"
                               + (f" keep_hidden{self.aux_layers}" if self.keep_hidden else ""), device=self.device)

    def _sampler_plans(self, jit_kwargs: dict) -> SamplerPlans:
        static = not self.platform.device_conditionals
        # another plan compiles in the background on one device; a process group's members must run the same
        # executables, so there (and under a mesh) a step that is not all-greedy runs FULL
        background = self.single_device and not distributed.is_multiprocess()
        return SamplerPlans(self, static=static, background=background, jit_kwargs=jit_kwargs)

    @property
    def _sharding(self) -> jax.sharding.Sharding:
        return jax.sharding.SingleDeviceSharding(self.device)

    # -- the jitted step ---------------------------------------------------------------------

    def _forward_impl(self, state, kv_cache, step: Packed, prev_sampled, lora_weights=None, encoder_cache=None,
                      prompt_embeds=None):
        """-> (sampling rows' logits, prompt logprobs, the step's new K/V, the slots the write puts them in).
        A pooling engine: its rows' pooled sums in the prompt logprobs' place, read from that leaf's pool_rows, and
        the step's final hidden states [T, D] (fetched only by a step with token-task rows: step.pool_tokens).
        With enable_lora, the stacked LoRA arrays and (packed last) each token's adapter slot; without, neither.
        A vision-language model's encoder cache, and (packed last) its per-token image rows (multimodal/runner.py).
        With enable_prompt_embeds, the step's given embeddings [T, D] and (packed last) where they apply."""
        input_ids, positions, attn_metadata, logit_rows, prompt_next_ids, prev_rows, *lora_slots = step.unpack()
        inputs = {} if prompt_embeds is None else {"prompt_embeds": (lora_slots.pop(), prompt_embeds)}
        if self.mm is not None:
            inputs["mm"] = self.mm.step_inputs(lora_slots.pop(), encoder_cache)
        # Inputs sampled by the previous step come from its device output: the host never waited for them.
        input_ids = jnp.where(prev_rows >= 0, prev_sampled[jnp.maximum(prev_rows, 0)], input_ids)
        model = nnx.merge(self.graphdef, state)
        with self._lora_active(lora_weights, lora_slots):
            if self.aux_layers:
                hidden, new_kv, kept = model.forward_with_aux(input_ids, positions, kv_cache, attn_metadata, self.aux_layers)
            else:
                hidden, new_kv = model.forward(input_ids, positions, kv_cache, attn_metadata, **inputs)
                kept = hidden
        if self.pooling:  # prompt_next_ids holds pool_rows (_forward_args); the token tasks read `hidden` whole
            pooled = pooled_sums(hidden, prompt_next_ids, logit_rows.shape[0])
            return model.compute_logits(hidden[logit_rows]), (pooled, hidden), new_kv, attn_metadata.slot_mapping
        if self._prompt_apart:  # the final hidden states in the prompt's place: _prompt_impl reads them if asked
            second = (hidden, kept) if self.keep_hidden else hidden
            return model.compute_logits(hidden[logit_rows]), second, new_kv, attn_metadata.slot_mapping
        logits, prompt = logits_and_prompt(model, hidden, logit_rows, prompt_next_ids)
        if self.keep_hidden:  # the drafting layer's input beside the prompt logprobs
            prompt = (prompt, kept)
        return logits, prompt, new_kv, attn_metadata.slot_mapping

    def _prompt_impl(self, state, hidden, prompt_next_ids):
        """Prompt logprobs from a step's final hidden states, for a step where some row asked for them."""
        model = nnx.merge(self.graphdef, state)
        return prompt_logprobs(model.compute_logits(hidden).astype(jnp.float32), prompt_next_ids)

    def _fused_impl(self, state, kv_cache, step: Packed, prev_sampled, lora_weights=None, encoder_cache=None,
                    prompt_embeds=None):
        """-> (logits, prompt logprobs, the cache with the step's K/V written): _forward_impl and the write in one."""
        logits, prompt, new_kv, slot_mapping = self._forward_impl(state, kv_cache, step, prev_sampled, lora_weights,
                                                                  encoder_cache, prompt_embeds)  # fmt: skip
        return logits, prompt, self._write(kv_cache, new_kv, slot_mapping)

    def _sample_impl(self, logits, packed: Packed, history, bitmask, suppress_ids, logit_bias, no_sampled,
                     plan: SamplerPlan = DYNAMIC):  # fmt: skip
        # no_sampled ([max_num_seqs] zeros) is an argument, not a constant, so its width is part of the signature
        # the executable cache keys on.
        sampling_metadata = dataclasses.replace(packed.unpack(), history=history, bitmask=bitmask, suppress_ids=suppress_ids,
                                                logit_bias=logit_bias)  # fmt: skip
        out = sample(logits, sampling_metadata, plan)
        sampled = jnp.zeros_like(no_sampled).at[: out.tokens.shape[0]].set(out.tokens.astype(jnp.int32))
        return out, sampled

    def _blank(self, name: str, array: np.ndarray, needed: bool) -> jax.Array | np.ndarray:
        """A per-row input that is blank in this step (no penalties: the history; no constraint: the mask) is one
        device-resident array per shape, reused instead of sent again."""
        if needed:
            return array
        key = (name, array.shape)
        if key not in self._blanks:
            self._blanks[key] = self._put(array)
        return self._blanks[key]

    def _put(self, array: np.ndarray) -> jax.Array:
        """On the device, or replicated over the TP mesh (a process group's other devices included)."""
        if self.mesh is None:
            return jax.device_put(array, self.device)
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.device_put(array, NamedSharding(self.mesh, PartitionSpec()))

    @contextlib.contextmanager
    def _device_call(self, name: str, *args):
        """Around each device call a follower must replay: the leader sends (name, args) first."""
        leading = self.channel is not None and self._depth == 0 and distributed.is_leader()
        if leading:
            refs = tuple(StepRef(a.seq) if isinstance(a, DispatchedStep) else a for a in args)
            self.channel.send((name, refs))
        self._depth += 1
        try:
            # a call whose collectives wait on a stuck follower blocks here (the CPU client dispatches in line)
            with distributed.lost_peer_is_group_error(), (
                distributed.waiting(f"the step call {name}") if leading else contextlib.nullcontext()
            ):
                yield
        finally:
            self._depth -= 1

    @property
    def needs_heartbeat(self) -> bool:
        """A process group's leader: an idle engine still checks its followers now and then."""
        return self.channel is not None and distributed.is_leader()

    def heartbeat(self) -> None:
        """An empty message to the followers: a dead one makes it raise ProcessGroupError at once."""
        with self._device_call("_heartbeat_now"):
            pass

    def _heartbeat_now(self) -> None:
        pass

    def _group_stalled(self, what: str) -> None:
        """The watchdog's call: a follower is stuck or unreachable; this process cannot go on."""
        self.group_error = distributed.ProcessGroupError(f"a process of the group is stuck or unreachable: {what}")
        distributed.end_process(self.group_error)

    def follow(self) -> None:
        """A follower's loop: replay the leader's device calls until it stops (or fails: ProcessGroupError)."""
        while True:
            name, args = self.channel.receive()
            if name == "stop":
                distributed.leave()
                return
            getattr(self, name)(*(self._dispatched[a.seq] if isinstance(a, StepRef) else a for a in args))

    def close(self) -> None:
        """The leader releases its followers (their follow() returns); background compiles not started are dropped."""
        if self._background is not None:
            self._background.shutdown(wait=False, cancel_futures=True)
        self._samplers.close()
        if self.channel is not None and distributed.is_leader():
            channel, self.channel = self.channel, None
            try:
                channel.send(("stop", ()))
            except distributed.ProcessGroupError:  # a follower already gone: nobody left to release
                return
            distributed.await_followers()

    def _on_mesh(self):
        """Trace and run under the TP mesh, so attention sees it (shard_map); nothing without TP."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: blocks src -> dst, in fixed-size batches so the copy never recompiles."""
        for i in range(0, len(pairs), self.copy_width):
            self._copy_batch(pairs[i : i + self.copy_width])

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Hybrid models: state slots src -> dst (a fork's child takes its parent's state), copy_width pairs a call."""
        for i in range(0, len(pairs), self.copy_width):
            self._copy_state_batch(pairs[i : i + self.copy_width])

    def _copy_state_batch(self, pairs: list[tuple[int, int]]) -> None:
        with self._device_call("_copy_state_batch", pairs):
            src = np.zeros(self.copy_width, np.int32)
            dst = np.full(self.copy_width, self.num_state_slots, np.int32)  # padding: out of range, dropped
            if pairs:
                src[: len(pairs)], dst[: len(pairs)] = zip(*pairs)
            args = (self.kv_cache, src, dst)
            with self._on_mesh():
                self.kv_cache = self._executable("copy_states", self._copy_states, 0, args)(*args)

    def _copy_batch(self, pairs: list[tuple[int, int]]) -> None:
        """At most copy_width pairs, padded with pairs whose out-of-range dst drops them."""
        with self._device_call("_copy_batch", pairs):
            self._copy_batch_now(pairs)

    def _copy_arrays(self, pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) of copy_width entries; the padding's dst is out of range, so the copy drops it."""
        src = np.zeros(self.copy_width, np.int32)
        dst = np.full(self.copy_width, self.num_blocks, np.int32)
        if pairs:
            src[: len(pairs)], dst[: len(pairs)] = zip(*pairs)
        return src, dst

    def _copy_batch_now(self, pairs: list[tuple[int, int]]) -> None:
        args = (self.kv_cache, *self._copy_arrays(pairs))
        with self._on_mesh():
            self.kv_cache = self._executable("copy", self._copy, 0, args)(*args)

    def execute_model(self, scheduler_output: SchedulerOutput, prev: DispatchedStep | None = None,
                      defer_sampling: bool = False) -> DispatchedStep:  # fmt: skip
        """The scheduler's step as this runner's padded input batch, queued on the device (see dispatch).
        defer_sampling: only the forward now; sample_later(scheduler_output, step) once the host is up to date."""
        if scheduler_output.encoder_work:  # images to encode into the encoder cache first (multimodal/runner.py)
            self.mm.encode(scheduler_output.encoder_work)
        step = self.input_batch.build(scheduler_output, with_sampling=not defer_sampling)
        step.state_copies = scheduler_output.state_copies
        dispatched = self.dispatch(step, scheduler_output.block_copies, prev)
        if self.mtp is not None:  # the MTP layer's shadow step, once the step's tokens are sampled (on the device)
            dispatched.mtp_step = step
            if not defer_sampling:
                self._shadow(scheduler_output, dispatched)
        return dispatched

    def _shadow(self, scheduler_output: SchedulerOutput, dispatched: DispatchedStep) -> None:
        step, dispatched.mtp_step = dispatched.mtp_step, None
        hidden, dispatched.hidden = dispatched.hidden, None
        self.mtp.shadow(scheduler_output, step, dispatched, hidden)

    def sample_later(self, scheduler_output: SchedulerOutput, dispatched: DispatchedStep) -> None:
        """Sample a step dispatched with defer_sampling, its sampling rows built from the requests as they are now."""
        self.sample(dispatched, self.input_batch.sampling(scheduler_output, dispatched.bucket))
        if self.mtp is not None:
            self._shadow(scheduler_output, dispatched)

    def dispatch(self, step: StepInputs, copies: list[tuple[int, int]] = (), prev: DispatchedStep | None = None) -> DispatchedStep:
        """Queue the step on the device and return at once; `prev` supplies the inputs step.prev_rows point at.
        A step without sampling metadata is only run forward: sample() it later."""
        with self._device_call("dispatch", step, list(copies), prev):
            dispatched = self._dispatch(step, copies, prev)
        dispatched.seq, self._num_dispatched = self._num_dispatched, self._num_dispatched + 1
        self._dispatched[dispatched.seq] = dispatched
        self._dispatched.pop(dispatched.seq - 8, None)  # a step is sampled within the next one or two
        return dispatched

    def _dispatch(self, step: StepInputs, copies, prev: DispatchedStep | None) -> DispatchedStep:
        if copies:
            self.copy(copies)
        if step.state_copies:  # hybrid models: forked sequences' states (core/state_slots.py)
            self.copy_states(step.state_copies)
        t = step.input_ids.shape[0]
        if not self.config.precompile and (self._step_name, t) not in self._compiled and t != self.buckets[0]:
            self.prefetch(self.buckets[0])  # decode steps of a few sequences follow a first prefill: compile beside it
        logits, prompt = self._forward_and_write(step, prev)
        if self.pooling:  # the second output: the pooled sums and the hidden states
            sums, hidden = prompt
            dispatched = DispatchedStep(t, logits, None, pooled=sums, pooled_tokens=hidden if step.pool_tokens else None)
            if step.sampling is not None:
                self.sample(dispatched, step.sampling)
            return dispatched
        hidden = None
        if self.keep_hidden:  # the drafting layer's input beside the prompt logprobs (or the hidden states they need)
            prompt, hidden = prompt
        want_prompt = step.prompt_next_ids is not None and bool((step.prompt_next_ids >= 0).any())
        if want_prompt and self._prompt_apart:  # `prompt` holds the step's hidden states
            args = (self.state, prompt, self._put(step.prompt_next_ids))
            with self._on_mesh():
                prompt = self._executable("prompt", self._prompt, t, args)(*args)
        dispatched = DispatchedStep(t, logits, prompt if want_prompt else None, hidden=hidden)
        if step.sampling is not None:
            self.sample(dispatched, step.sampling)
        return dispatched

    def _forward_and_write(self, step: StepInputs, prev: DispatchedStep | None) -> tuple:
        """Queue the step's forward and its KV write: -> (logits of the sampling rows, prompt logprobs)."""
        args = self._forward_args(step, prev)
        t = step.input_ids.shape[0]
        with self._on_mesh():
            if self._fused is not None:
                return self._run_fused(t, args)
            logits, prompt, new_kv, slots = self._run_forward(t, args)
            self._run_write(t, new_kv, slots)
        return logits, prompt

    def _run_fused(self, bucket: int, args: tuple) -> tuple:
        """fused_kv_write: the forward and the KV write in one call, which donates the cache (args[1])."""
        logits, prompt, self.kv_cache = self._executable("step", self._fused, bucket, args)(*args)
        return logits, prompt

    def _run_forward(self, bucket: int, args: tuple) -> tuple:
        return self._executable("forward", self._forward, bucket, args)(*args)

    def _run_write(self, bucket: int, new_kv, slots) -> None:
        """The step's K/V into the cache, which the call donates: updated in place."""
        args = (self.kv_cache, new_kv, slots)
        self.kv_cache = self._executable("write", self._write, bucket, args)(*args)

    def sample(self, dispatched: DispatchedStep, sampling: SamplingMetadata) -> None:
        """Queue the sampler on a dispatched forward's logits."""
        with self._device_call("sample", dispatched, sampling):
            self._sample_now(dispatched, sampling)

    def _sample_now(self, dispatched: DispatchedStep, sampling: SamplingMetadata) -> None:
        args = (dispatched.logits, *self._sampling_args(sampling), self._no_sampled)
        rows = dispatched.logits.shape[0]  # buckets with as many sampling rows share one sampler
        # a stage's input is needed where it is not the kept blank
        needed = [not isinstance(arg, jax.Array) for arg in args[4:6]]  # the suppress ids, the biases
        plan = self._samplers.plan(sampling, suppress=needed[0], bias=needed[1])
        with self._on_mesh():
            dispatched.out, dispatched.sampled = self._samplers.executable(rows, plan, args)(*args)
        dispatched.logits, dispatched.want_top = None, bool(sampling.want_logprobs)

    def _sampling_args(self, sampling: SamplingMetadata) -> tuple:
        """(the per-row knobs packed in one buffer, the history, the bitmask, the ids min_tokens forbids, the logit
        biases): the last four are large and mostly blank (at 1,024 rows the blank suppress ids alone were 256 KB,
        packed and sent every step), so a blank one is a device array kept from an earlier step instead."""
        knobs = Packed.of_leaves([getattr(sampling, name) for name in _KNOB_FIELDS], _KNOBS_TREEDEF)
        suppress, bias = sampling.suppress_ids, sampling.logit_bias
        return (
            knobs, self._blank("history", sampling.history, bool(sampling.any_penalty)),
            self._blank("bitmask", sampling.bitmask, bool(sampling.any_constrained)),
            self._blank("suppress", suppress, suppress is not _blank_array(suppress.shape) and bool((suppress >= 0).any())),
            # (the values, not only identity: a process group's followers get the step's arrays unpickled)
            self._blank("bias", bias, bias is not _blank_array(bias.shape) and bool((bias[:, 0] >= 0).any())),
        )  # fmt: skip

    def _forward_args(self, step: StepInputs, prev: DispatchedStep | None) -> tuple:
        """The step's host arrays go in one packed copy (packing.py)."""
        t = step.input_ids.shape[0]
        none = self._all_minus_one(t)  # no prompt logprobs wanted, no input from the previous step
        next_ids = step.pool_rows if self.pooling else step.prompt_next_ids  # (one leaf: a pooling engine has no prompt logprobs)
        next_ids = next_ids if next_ids is not None else none
        prev_rows = step.prev_rows if step.prev_rows is not None else none
        leaves = (step.input_ids, step.positions, step.attention, step.logit_rows, next_ids, prev_rows)
        if self.lora_weights is not None:  # each token's adapter slot, and the stacked arrays: LoRA engines only
            leaves += (step.lora_slots if step.lora_slots is not None else none,)
        if self.mm is not None:  # each token's encoder-cache row (M-RoPE positions), and the cache
            leaves += (self.mm.step_leaves(step, t),)
        if self.prompt_embeds is not None:  # where the step's given embeddings apply (all False in most steps)
            leaves += (self.prompt_embeds.mask(step, t),)
        args = (self.state, self.kv_cache, Packed.of(leaves), prev.sampled if prev is not None else self._no_sampled)
        if self.prompt_embeds is not None:
            return (*args, self.lora_weights, None if self.mm is None else self.mm.array, self.prompt_embeds.rows(step, t))
        if self.mm is not None:
            return (*args, self.lora_weights, self.mm.array)
        return args if self.lora_weights is None else (*args, self.lora_weights)

    def execute(self, step: StepInputs, copies: list[tuple[int, int]] = ()) -> StepResult:
        return self.dispatch(step, copies).fetch()

    def _all_minus_one(self, num_tokens: int) -> np.ndarray:
        if num_tokens not in self._blank_prompt_ids:
            self._blank_prompt_ids[num_tokens] = np.full(num_tokens, -1, np.int32)
        return self._blank_prompt_ids[num_tokens]

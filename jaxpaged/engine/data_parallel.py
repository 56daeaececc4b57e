"""Data parallelism: D independent LLMEngine replicas, each on its own devices, behind one request router.

For small models on many devices: every replica holds the whole model and its own KV pool, so replicas never
talk to each other. The model is read from disk once; each replica's runner places a copy on its devices.
A new request goes to the least loaded replica (fewest unfinished requests, then fewest KV blocks in use) and
stays there; step() steps every replica with work. LLM and AsyncLLMEngine use this as they use an LLMEngine.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any

import jax

from jaxpaged.config import EngineConfig
from jaxpaged.engine.llm_engine import LLMEngine, PromptType
from jaxpaged.engine.profiler import Profiler
from jaxpaged.models.loader import LoadedModel
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger("jaxpaged.engine")

# stats that are not counts: averaged (utilization) or left per replica
_AVERAGED = ("kv_token_utilization",)


def make_engine(config: EngineConfig, loaded: LoadedModel | None = None) -> LLMEngine | DataParallelEngine:
    """The engine a config asks for: one LLMEngine, or a DataParallelEngine of data_parallel_size replicas."""
    return DataParallelEngine(config, loaded) if config.data_parallel_size > 1 else LLMEngine(config, loaded)


def replica_devices(config: EngineConfig, devices=None) -> list[list[jax.Device]]:
    """Replica r runs on devices[r*k:(r+1)*k], k = devices_per_replica."""
    devices = list(jax.devices() if devices is None else devices)
    k, d = config.devices_per_replica, config.data_parallel_size
    if isinstance(d, bool) or not isinstance(d, int) or d < 1 or d * k > len(devices):
        raise ValueError(f"data_parallel_size must be a positive integer whose replicas of {k} device(s) fit in the "
                         f"{len(devices)} devices given (got {d!r})")  # fmt: skip
    return [devices[r * k : (r + 1) * k] for r in range(d)]


class DataParallelEngine:
    """LLMEngine's request/step interface over data_parallel_size replicas."""

    is_follower = False  # a process group runs tensor parallelism only (EngineConfig refuses both)

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, devices=None):
        self.config = config
        groups = replica_devices(config, devices)
        first = LLMEngine(config, loaded, devices=groups[0])  # loads the model (once) and sizes the KV pool
        # The others take replica 0's pool size: the accelerator platforms size it from the first visible device's
        # free memory, which replica 0 has just filled; replicas on like devices want like pools anyway.
        rest = config if config.num_kv_blocks is not None else _with_pool(config, first.runner.num_blocks)
        self.replicas = [first] + [LLMEngine(rest, first.loaded, devices=g) for g in groups[1:]]
        self.loaded = first.loaded
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        self.eos_token_ids = first.eos_token_ids
        self.harmony = first.harmony  # GPT-OSS's chat prompts through openai-harmony (each replica renders its own)
        self.pooler = first.pooler  # a pooling engine's (engine/pooling.py): the same in every replica
        self.default_sampling_kwargs = first.default_sampling_kwargs  # the model's generation config defaults
        self._owner: dict[str, int] = {}  # unfinished request id -> its replica
        self.profiler = Profiler(config.profiler_dir)  # one trace covers every replica (JAX has one per process)
        self._ids = itertools.count()
        logger.info(
            "data parallel: %d replicas on %s; each: %s", len(self.replicas),
            ", ".join("[" + " ".join(str(dev) for dev in g) + "]" for g in groups), first.runner.memory_plan(),
        )  # fmt: skip

    # -- requests ------------------------------------------------------------------------------

    def _load(self, index: int) -> tuple[int, int]:
        """What routing compares: unfinished requests, then KV blocks in use."""
        replica = self.replicas[index]
        requests = len(replica.output_processor.parents)  # queued or running
        return requests, replica.scheduler.kv.pool.num_used

    def get_default_sampling_params(self) -> SamplingParams:
        return self.replicas[0].get_default_sampling_params()

    def route(self) -> int:
        """The replica a new request goes to: the least loaded (the lowest index on a tie)."""
        return min(range(len(self.replicas)), key=self._load)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0) -> str:  # fmt: skip
        """LLMEngine.add_request on the least loaded replica; ids are unique over all replicas."""
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        index = self.route()
        self.replicas[index].add_request(request_id, prompt, params, priority=priority)
        self._owner[request_id] = index
        return request_id

    def load_media(self, prompt: PromptType) -> PromptType:
        return self.replicas[0].load_media(prompt)  # every replica's loader is the same

    def render_prompt(self, prompt: PromptType) -> PromptType:
        return self.replicas[0].render_prompt(prompt)  # (and its tokenizer)

    def replica_of(self, request_id: str) -> int | None:
        """The replica holding an unfinished request (None if unknown or finished)."""
        return self._owner.get(str(request_id))

    def abort_request(self, request_id: str) -> bool:
        return self.abort_request_with_output(request_id) is not None

    def abort_request_with_output(self, request_id: str) -> RequestOutput | None:
        index = self._owner.pop(str(request_id), None)
        return None if index is None else self.replicas[index].abort_request_with_output(request_id)

    def get_prompt_token_ids(self, request_id: str) -> list[int]:
        return self.replicas[self._owner[str(request_id)]].get_prompt_token_ids(request_id)

    def has_request(self, request_id: str) -> bool:
        index = self._owner.get(str(request_id))
        return index is not None and self.replicas[index].has_request(request_id)

    def num_waiting_requests(self) -> int:
        return sum(r.num_waiting_requests() for r in self.replicas)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work. Each step leaves its successor dispatched (async scheduling),
        so while the host reads one replica's tokens the other devices compute."""
        outputs = []
        for replica in self.replicas:
            if replica.has_unfinished_requests():
                outputs += replica.step()
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    # -- rollouts: every replica takes the same weights and sleeps together (engine/weight_sync.py) ------

    def _each(self, method: str, *args, **kwargs) -> dict[str, Any]:
        results = [getattr(r, method)(*args, **kwargs) for r in self.replicas]
        outputs = [out for result in results for out in result.pop("outputs", [])]
        for out in outputs:
            self._owner.pop(out.request_id, None)
        return {**results[0], "outputs": outputs, "replicas": results}

    def update_weights(self, weights, **kwargs) -> dict[str, Any]:
        """LLMEngine.update_weights on every replica (each reshards the weights onto its own devices)."""
        return self._each("update_weights", weights, **kwargs)

    def sleep(self, level: int = 1, **kwargs) -> dict[str, Any]:
        return self._each("sleep", level, **kwargs)

    def wake_up(self, tags=None) -> dict[str, Any]:
        return self._each("wake_up", tags)

    @property
    def is_sleeping(self) -> bool:
        return any(r.is_sleeping for r in self.replicas)

    def reset_prefix_cache(self) -> bool:
        """Every replica's prefix cache, or none: False while any replica's sequences hold KV blocks."""
        held = sum(r.scheduler.kv.pool.num_used for r in self.replicas)
        if held:
            logger.warning("reset_prefix_cache refused: %d KV blocks are still held by sequences", held)
            return False
        return all([r.reset_prefix_cache() for r in self.replicas])

    def start_profile(self, profile_prefix: str | None = None) -> str:
        return self.profiler.start(profile_prefix)

    def stop_profile(self) -> str:
        return self.profiler.stop()

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

    # -- introspection -------------------------------------------------------------------------

    @property
    def num_compiles_after_warmup(self) -> int:
        return sum(r.num_compiles_after_warmup for r in self.replicas)

    @property
    def startup_seconds(self) -> dict[str, float]:
        """Each phase summed over the replicas (they start one after another)."""
        total: dict[str, float] = {}
        for replica in self.replicas:
            for phase, seconds in replica.startup_seconds.items():
                total[phase] = total.get(phase, 0.0) + seconds
        return total

    @property
    def compile_seconds(self) -> float:
        return sum(r.compile_seconds for r in self.replicas)

    def get_stats(self) -> dict[str, Any]:
        """Counts summed over the replicas, utilization averaged; "replicas" holds each one's own stats."""
        per = [r.get_stats() for r in self.replicas]
        stats: dict[str, Any] = {}
        for key in per[0]:
            values = [s[key] for s in per]
            stats[key] = sum(values) / len(values) if key in _AVERAGED else sum(values)
        stats["replicas"] = per
        return stats


def _with_pool(config: EngineConfig, num_blocks: int) -> EngineConfig:
    return dataclasses.replace(config, num_kv_blocks=num_blocks)

"""The engine as a trainer's rollout engine (issue 47): weights replaced in place, memory given back between rollouts.

`LLMEngine.update_weights`, `sleep` and `wake_up` come here. Each first settles the requests in flight as the caller
chose (`in_flight="finish"`: stepped to their end, their outputs returned; `"abort"`: ended at once with
`finish_reason="abort"` and `stop_reason=ABORT_REASON`), then drops the prefix cache (its K/V came from the old
weights, or from a pool being freed). The weights themselves are the runner's (worker/weight_update.py,
worker/sleep_mode.py). While asleep, or while weights dropped by sleep(level=2) have not been given again, the
engine refuses requests with EngineAsleepError, or queues them when sleep was asked to (`queue_requests=True`),
to run once it is awake.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxpaged.worker.sleep_mode import TAGS, RunnerSleep, device_bytes_in_use
from jaxpaged.worker.weight_update import (
    WeightUpdater,
    mxfp4_packed,
    named_arrays,
    safetensors_shapes,
    safetensors_weights,
)

if TYPE_CHECKING:
    from jaxpaged.engine.llm_engine import LLMEngine
    from jaxpaged.lora import LoRARequest

logger = logging.getLogger("jaxpaged.engine")

IN_FLIGHT = ("finish", "abort")
ABORT_REASON = "aborted: the engine's weights or memory were being replaced (in_flight='abort')"
_PEFT = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?(?:\.weight)?$")


class EngineAsleepError(RuntimeError):
    """The engine is asleep (or its weights were dropped and not given again) and does not take requests now."""


class WeightSync:
    """One engine's weight updates and sleep state."""

    def __init__(self, engine: LLMEngine):
        from jaxpaged.worker.pipeline_runner import PipelineRunner

        self.engine = engine
        self.supported = not isinstance(engine.runner, PipelineRunner)
        self.updater = WeightUpdater(engine.runner)
        self.sleeper = RunnerSleep(engine.runner, self.updater)
        self.queue_while_asleep = False
        self.level = 0

    # -- requests while asleep -----------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        """Nothing may run: asleep, or weights dropped at level 2 not all given again."""
        return self.sleeper.asleep or bool(self.updater.missing)

    def why_paused(self) -> str:
        if self.sleeper.asleep:
            away = [t for t, gone in (("weights", self.sleeper.weights != "awake"), ("kv_cache", self.sleeper.kv_asleep)) if gone]
            return (f"the engine is asleep (sleep(level={self.level}); {' and '.join(away)} away): call wake_up() "
                    "first, or sleep(..., queue_requests=True) to queue requests until then")
        missing = sorted(self.updater.layout.paths[i] for i in self.updater.missing)
        return (f"sleep(level=2) dropped the weights and {len(missing)} parameters have not been given again "
                f"(update_weights), e.g. {missing[0]}")

    def admit(self) -> None:
        """A new request's check: refused while paused unless requests queue."""
        if self.paused and not (self.queue_while_asleep and self.sleeper.asleep):
            raise EngineAsleepError(self.why_paused())

    # -- in flight -----------------------------------------------------------------------------------

    def _settle(self, in_flight: str) -> list:
        """Finish or abort every unfinished request; -> their final outputs."""
        if in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight must be one of {IN_FLIGHT} (got {in_flight!r})")
        engine = self.engine
        outputs = []
        if in_flight == "finish":
            while engine.has_unfinished_requests():
                outputs.extend(out for out in engine.step() if out.finished)
            return outputs
        for request_id in list(engine.output_processor.parents):
            out = engine.abort_request_with_output(request_id)
            if out is not None:
                for completion in out.outputs:
                    if completion.finish_reason == "abort":
                        completion.stop_reason = ABORT_REASON
                outputs.append(out)
        while engine._in_flight is not None:  # the dispatched step: read, its rows dropped (their requests ended)
            engine.step()
        return outputs

    def _drop_prefix_cache(self) -> int:
        engine = self.engine
        dropped = engine.scheduler.kv.pool.reset_prefix_cache()
        if dropped:
            logger.info("prefix cache: %d cached blocks dropped", dropped)
        return dropped

    def _release_loaded(self) -> None:
        """The loaded model keeps its parameters' shapes only: its arrays were the first weights, which an update or
        sleep is about to let go of."""
        from flax import nnx

        model = self.engine.loaded.model
        if model is not None and not getattr(self, "_released", False):
            state = nnx.state(model)
            nnx.update(model, jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
            self._released = True

    def _check_supported(self, what: str) -> None:
        if not self.supported:
            raise ValueError(f"{what} is not supported with pipeline_parallel_size > 1")

    # -- the operations ------------------------------------------------------------------------------

    def update_weights(self, weights, mapping=None, in_flight: str = "finish", lora_request: LoRARequest | None = None,
                       copy: bool = False) -> dict[str, Any]:  # fmt: skip
        t0 = time.perf_counter()
        plan = self._checked(weights, mapping, in_flight, lora_request, copy, safetensors_weights)
        outputs = self._settle(in_flight)
        if lora_request is not None:
            return self._replace_lora(*plan, lora_request, outputs, t0)
        self._release_loaded()
        result = self.updater.apply(plan)
        result["prefix_blocks_dropped"] = self._drop_prefix_cache()
        result["outputs"] = outputs
        return result

    def check_update(self, weights, mapping=None, in_flight: str = "finish", lora_request: LoRARequest | None = None,
                     copy: bool = False) -> None:  # fmt: skip
        """update_weights' checks alone (its ValueError naming every bad tensor; a folder read for its shapes, nothing
        copied to the devices), nothing changed or waited for: AsyncLLMEngine raises bad input at once instead of
        once the requests in flight have finished."""
        self._checked(weights, mapping, in_flight, lora_request, copy, safetensors_shapes)

    def _checked(self, weights, mapping, in_flight: str, lora_request: LoRARequest | None, copy: bool, read_folder):
        """Everything update_weights checks before it touches anything (a folder read by read_folder); -> the
        updater's plan, or an adapter and its new tensors."""
        self._check_supported("update_weights")
        if in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight must be one of {IN_FLIGHT} (got {in_flight!r})")
        if isinstance(weights, (str, os.PathLike)):
            weights = read_folder(weights, self.updater.layout)
        if lora_request is not None:
            return self._lora_pieces(weights, mapping, lora_request)
        if self.sleeper.weights != "awake":
            raise EngineAsleepError("update_weights: the weights are asleep; wake_up(tags=['weights']) first")
        return self.updater.plan(weights, mapping, copy)

    def _lora_pieces(self, weights, mapping, request: LoRARequest) -> tuple[Any, dict[str, dict[str, Any]]]:
        """Some of an adapter's tensors (PEFT's names, lora_A [r, in] and lora_B [out, r]) checked against it: -> the
        adapter and its new tensors by layer key, or one ValueError naming every problem."""
        engine = self.engine
        if engine.lora is None:
            raise ValueError("lora_request needs an engine started with enable_lora=True")
        adapter = engine.lora.load(request)
        from jaxpaged.models.lora import target_shapes

        shapes = target_shapes(engine.loaded.config, engine.runner.lora_targets)
        pieces: dict[str, dict[str, np.ndarray]] = {}
        problems = []
        for given, target, array, fn in named_arrays(weights, mapping):
            array = _applied(fn, array)
            m = _PEFT.match(target)
            key = None if m is None else f"layers.{m[1]}.{m[2]}.{m[3]}"
            if key not in shapes:
                problems.append(f"unknown tensor {given}: not a lora_A/lora_B weight of a projection this engine adapts")
                continue
            fan_in, fan_out = shapes[key]
            want = (adapter.rank, fan_in) if m[4] == "A" else (fan_out, adapter.rank)
            if tuple(array.shape) != want:
                problems.append(f"tensor {given} has shape {tuple(array.shape)}, but adapter {request.lora_name!r} needs {want}")
                continue
            pieces.setdefault(key, {})[m[4]] = array
        for key, ab in pieces.items():
            if len(ab) == 1 and key not in adapter.weights:
                problems.append(f"{key}: adapter {request.lora_name!r} does not adapt it, so both lora_A and lora_B are needed")
        if problems:
            raise ValueError(f"update_weights: {len(problems)} problem(s), nothing was changed: " + "; ".join(problems))
        return adapter, pieces

    def _replace_lora(self, adapter, pieces, request: LoRARequest, outputs: list, t0: float) -> dict[str, Any]:
        """A checked adapter update: read to the host, where the engine keeps adapters (they are small)."""
        engine = self.engine
        new = {}
        for key, ab in pieces.items():
            old_a, old_b = adapter.weights.get(key, (None, None))
            a = np.ascontiguousarray(np.asarray(ab["A"], np.float32).T) if "A" in ab else old_a
            b = np.ascontiguousarray(np.asarray(ab["B"], np.float32).T) * np.float32(adapter.scaling) if "B" in ab else old_b
            new[key] = (a, b)
        slot = engine.lora.replace_tensors(request, new)
        return {"tensors": sum(len(ab) for ab in pieces.values()), "slot": slot, "seconds": time.perf_counter() - t0,
                "prefix_blocks_dropped": self._drop_prefix_cache(), "outputs": outputs}  # fmt: skip

    def sleep(self, level: int = 1, in_flight: str = "finish", queue_requests: bool = False) -> dict[str, Any]:
        self._check_supported("sleep")
        if level not in (1, 2) or isinstance(level, bool):
            raise ValueError(f"level must be 1 (weights to host memory) or 2 (weights dropped) (got {level!r})")
        if in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight must be one of {IN_FLIGHT} (got {in_flight!r})")
        packed = [path for path in self.updater.layout.paths if mxfp4_packed(self.updater.layout, path)] if level == 2 else []
        if packed:
            raise ValueError(f"level: sleep(level=2) drops the weights for update_weights to bring back, and this engine "
                             f"keeps MXFP4 experts 4-bit ({packed[0]} and {len(packed) - 1} more), which no update sets; "
                             "use level=1, or start the engine with moe_kernel='loop' or quantization='none'")  # fmt: skip
        outputs = self._settle(in_flight) if not self.sleeper.asleep else []
        t0 = time.perf_counter()
        devices = self.engine.runner.devices
        before, own_before = device_bytes_in_use(devices), self.sleeper.own_bytes()
        self._drop_prefix_cache()
        self._release_loaded()
        self.sleeper.sleep(level)
        self.level = max(self.level, level)
        self.queue_while_asleep = bool(queue_requests)
        after = device_bytes_in_use(devices)
        logger.info("sleep(level=%d): device memory in use %.1f -> %.1f MB", level, before / 1e6, after / 1e6)
        # bytes_*: the devices' (everything this process holds there); engine_bytes_*: the weights and KV pool alone
        return {"level": level, "bytes_before": before, "bytes_asleep": after, "engine_bytes_before": own_before,
                "engine_bytes_asleep": self.sleeper.own_bytes(), "seconds": time.perf_counter() - t0,
                "outputs": outputs}  # fmt: skip

    def wake_up(self, tags=None) -> dict[str, Any]:
        self._check_supported("wake_up")
        tags = list(TAGS) if tags is None else [tags] if isinstance(tags, str) else list(tags)
        unknown = [t for t in tags if t not in TAGS]
        if unknown or not tags:
            raise ValueError(f"tags must name some of {TAGS} (got {tags!r})")
        t0 = time.perf_counter()
        self.sleeper.wake(tags)
        if not self.sleeper.asleep:
            self.level = 0
        return {"tags": tags, "bytes_in_use": device_bytes_in_use(self.engine.runner.devices),
                "engine_bytes": self.sleeper.own_bytes(), "seconds": time.perf_counter() - t0}  # fmt: skip


def check_update(engine, weights, **kwargs) -> None:
    """WeightSync.check_update of an LLMEngine, or of a DataParallelEngine's first replica (the replicas run one model)."""
    replicas = getattr(engine, "replicas", None)
    (replicas[0] if replicas else engine).weight_sync.check_update(weights, **kwargs)


def _applied(fn, array):
    """A mapping's function on a given array; on a shape (check_update's folder) what it would make of it."""
    if fn is None:
        return array
    return jax.eval_shape(fn, array) if isinstance(array, jax.ShapeDtypeStruct) else fn(array)

"""The engine's adapters: a host-side LRU of loaded adapters (max_cpu_loras) and the device's slots (max_loras).

A request holds its adapter's slot from admission until it finishes (preemption included), so a running row's slot
never changes; a slot no request holds stays resident (least recently used first to go) until another adapter
needs it. Writing a slot is one jitted, donated update of fixed shape (ModelRunner.write_lora_slot): adapters
coming and going compile nothing.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import TYPE_CHECKING

from jaxpaged.lora.request import LoRARequest
from jaxpaged.models.lora import LoRAAdapter, load_adapter

if TYPE_CHECKING:
    from jaxpaged.worker.model_runner import ModelRunner

logger = logging.getLogger("jaxpaged.lora")


class LoRAManager:
    def __init__(self, runner: ModelRunner, base_config, max_loras: int, max_rank: int, max_cpu_loras: int | None):
        self.runner = runner
        self.base_config = base_config  # the model's config as loaded (before tensor parallelism widens KV heads)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self._host: collections.OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = collections.OrderedDict()
        self._slot_ids: list[int | None] = [None] * max_loras  # the adapter id each device slot holds
        self._slot_requests: list[LoRARequest | None] = [None] * max_loras  # and the request it was loaded for
        self._holders = [0] * max_loras  # unfinished requests per slot
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict((s, None) for s in range(max_loras))
        self._lock = threading.Lock()  # the server loads adapters from its own thread
        self._updated: set[int] = set()  # adapters update_weights changed: their host copy is the only one, never evicted

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory, read (and checked) on first use; ValueError for a bad one."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest (got {type(request).__name__})")
        with self._lock:
            known = self._host.get(request.lora_int_id)
            if known is not None:
                self._check_same(known[0], request)
                self._host.move_to_end(request.lora_int_id)
                return known[1]
            if request.lora_int_id in self._slot_ids:  # evicted from host memory, still on the device
                self._check_same(self._slot_requests[self._slot_ids.index(request.lora_int_id)], request)
        adapter = load_adapter(request.lora_name, request.lora_path, self.base_config, self.runner.lora_targets, self.max_rank)
        with self._lock:
            known = self._host.get(request.lora_int_id)
            if known is not None:  # loaded meanwhile by another thread
                self._check_same(known[0], request)
                return known[1]
            self._host[request.lora_int_id] = (request, adapter)
            while len(self._host) > self.max_cpu_loras:
                evicted = next((i for i in self._host if i not in self._updated), None)
                if evicted is None:  # all of them updated: kept over max_cpu_loras rather than lost
                    break
                del self._host[evicted]
                logger.info("LoRA adapter %d evicted from host memory (max_cpu_loras=%d)", evicted, self.max_cpu_loras)
        logger.info("LoRA adapter %r (id %d, rank %d, %d projections, %.1f MB) loaded from %s", request.lora_name,
                    request.lora_int_id, adapter.rank, len(adapter.weights), adapter.nbytes / 1e6, request.lora_path)  # fmt: skip
        return adapter

    @staticmethod
    def _check_same(known: LoRARequest, request: LoRARequest) -> None:
        if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} at "
                             f"{known.lora_path!r}; give {request.lora_name!r} another id")  # fmt: skip

    def acquire(self, request: LoRARequest) -> int | None:
        """A device slot holding the adapter, held for one request until release(); None while every slot is held."""
        adapter = self.load(request)
        with self._lock:
            if request.lora_int_id in self._slot_ids:
                slot = self._slot_ids.index(request.lora_int_id)
            elif self._idle:
                slot = next(iter(self._idle))
                previous = self._slot_ids[slot]
                self.runner.write_lora_slot(slot, adapter)
                self._slot_ids[slot], self._slot_requests[slot] = request.lora_int_id, request
                logger.info("LoRA adapter %r in device slot %d%s", request.lora_name, slot,
                            "" if previous is None else f" (evicting adapter {previous})")  # fmt: skip
            else:
                return None
            self._holders[slot] += 1
            self._idle.pop(slot, None)
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self._holders[slot] -= 1
            if self._holders[slot] == 0:
                self._idle[slot] = None  # most recently used: the last to be overwritten

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (host copy, and its device slot unless a request still holds it); False if unknown."""
        with self._lock:
            known = self._host.pop(lora_int_id, None) is not None
            self._updated.discard(lora_int_id)
            if lora_int_id in self._slot_ids:
                slot = self._slot_ids.index(lora_int_id)
                # still held: its rows stay for those requests, but no new request finds them (ids are positive)
                self._slot_ids[slot] = None if self._holders[slot] == 0 else -lora_int_id
                if self._holders[slot] == 0:
                    self._idle.move_to_end(slot, last=False)  # first to be reused
                known = True
            return known

    def replace_tensors(self, request: LoRARequest, weights: dict[str, tuple]) -> int | None:
        """New values for some of an adapter's projections (key -> (A [in, r], B [r, out] scaled), as load_adapter
        stores them), in its host copy and, where resident, its device slot; -> that slot, or None."""
        adapter = self.load(request)
        with self._lock:
            adapter.weights.update(weights)
            self._updated.add(request.lora_int_id)  # read again from its folder, it would lose them
            slot = self._slot_ids.index(request.lora_int_id) if request.lora_int_id in self._slot_ids else None
        if slot is not None:
            self.runner.write_lora_slot(slot, adapter)
        return slot

    def list(self) -> list[LoRARequest]:
        """The adapters loaded in host memory, least recently used first."""
        with self._lock:
            return [request for request, _ in self._host.values()]

    def stats(self) -> dict:
        with self._lock:
            return {"lora_slots_held": sum(h > 0 for h in self._holders), "lora_slots_loaded": sum(s is not None for s in self._slot_ids),
                    "loras_in_host_memory": len(self._host)}  # fmt: skip

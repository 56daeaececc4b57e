"""The stacked LoRA arrays on the runner's devices (models/lora.py), and their donated slot write."""

from __future__ import annotations

import contextlib
import logging

import jax
import numpy as np

from jaxpaged.models import lora

logger = logging.getLogger("jaxpaged.runner")


class LoRASlots:
    """ModelRunner's adapters: `lora_weights`, one slot per adapter loaded (jaxpaged/lora/manager.py)."""

    def _lora_slots(self, base_config) -> dict:
        """The empty stacked LoRA arrays (models/lora.py) on this runner's devices, and their jitted slot write,
        compiled now with an empty slot so that adapters loaded later compile nothing."""
        cfg, r = self.config, self.config.max_lora_rank
        self._lora_shapes = lora.target_shapes(self.model_config, self.lora_targets)
        # tensor parallelism may have widened the KV heads: k/v's B columns repeat as the base's did
        self._lora_kv_repeat = (self.model_config.num_kv_heads // base_config.num_kv_heads, self.model_config.head_dim)
        weights = lora.empty_weights(self._lora_shapes, cfg.max_loras, r, self.dtype)
        if self.mesh is None:
            weights = jax.device_put(weights, self.device)
            self._lora_write = jax.jit(lora.write_slot, donate_argnums=(0,))
        else:
            shardings = lora.weight_shardings(self.mesh, weights)
            weights = jax.device_put(weights, shardings)
            self._lora_write = jax.jit(lora.write_slot, donate_argnums=(0,), out_shardings=shardings)
        self.lora_weights = weights
        self.write_lora_slot(0, None)
        logger.info("LoRA: %d slots of rank %d over %s (%.1f MB)", cfg.max_loras, r, ", ".join(self.lora_targets),
                    sum(a.nbytes + b.nbytes for a, b in self.lora_weights.values()) / 1e6)  # fmt: skip
        return self.lora_weights

    def write_lora_slot(self, slot: int, adapter) -> None:
        """Slot `slot` of the stacked arrays becomes `adapter` (None: empty), in place (donated)."""
        arrays = lora.slot_arrays(adapter, self._lora_shapes, self.config.max_lora_rank, self.dtype, self._lora_kv_repeat)
        with self._on_mesh():
            self.lora_weights = self._lora_write(self.lora_weights, self._put(np.int32(slot)), self._put(arrays))

    def _lora_active(self, lora_weights, lora_slots):
        """While the step is traced: the adapters for the wrapped projections; nothing without LoRA."""
        if lora_weights is None:
            return contextlib.nullcontext()
        return lora.active(lora_weights, lora_slots[0], self.config.max_loras, self.config.max_lora_rank)

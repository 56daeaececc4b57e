"""The KV pool and what fits beside the weights: block sizes, the memory plan start-up logs, the check that one
max_model_len sequence fits before the pool takes the rest."""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp

from jaxpaged.config import EngineConfig
from jaxpaged.core.kv_cache_coordinator import KVGroups, kv_groups, layer_localities
from jaxpaged.core.kv_cache_manager import freeing_window, max_blocks_held
from jaxpaged.models.weights import param_bytes
from jaxpaged.pallas_kernels import copy_blocks, write_kv
from jaxpaged.pallas_kernels.kv_quant import empty_quantized_kv, kv_bytes_per_token_head

logger = logging.getLogger("jaxpaged.runner")
KV_STORAGE = {"int8": jnp.int8, "fp8": jnp.uint8}  # an 8-bit cache's element type, per kv_cache_dtype

def kv_writer(layer_groups=None):
    """write_kv, or with KV cache groups write_kv into each layer's (group, index) of layer_groups."""
    return write_kv if layer_groups is None else functools.partial(write_kv, layer_groups=layer_groups)


def kv_pool(shape: tuple[int, ...], kv_cache_dtype: str, storage_dtype, mesh, device, layer_groups=None) -> tuple:
    """An empty KV array on `device` (or split over `mesh` by KV head), and its donated write and block copy (with
    KV cache groups, each layer's (group, index) in layer_groups)."""
    write_fn = kv_writer(layer_groups)

    def empty():
        if kv_cache_dtype == "auto":
            return jnp.zeros(shape, storage_dtype)
        # 8-bit values and a float32 scale per token and head; fp8 kept as its uint8 bits, so that writes scatter
        # bytes in place (XLA:CPU rewrote an fp8 scatter over the whole pool) and every reader decodes the bits
        return empty_quantized_kv(shape, kv_cache_dtype, KV_STORAGE[kv_cache_dtype])

    if mesh is None:
        with jax.default_device(device):
            cache = empty()
        return cache, jax.jit(write_fn, donate_argnums=(0,)), jax.jit(copy_blocks, donate_argnums=(0,))
    from jaxpaged.models.sharding import kv_cache_sharding

    split = kv_cache_sharding(mesh, kv_cache_dtype)
    write = jax.jit(write_fn, donate_argnums=(0,), out_shardings=split)
    return jax.jit(empty, out_shardings=split)(), write, jax.jit(copy_blocks, donate_argnums=(0,), out_shardings=split)


class KVMemory:
    """ModelRunner's sizing: the pool's blocks, their bytes, and what one sequence holds."""

    @staticmethod
    def _kv_groups(config: EngineConfig, model_config) -> KVGroups | None:
        if config.disable_hybrid_kv_cache_manager:
            return None
        return kv_groups(layer_localities(model_config), model_config.num_layers)

    @property
    def kv_layers(self) -> int:
        """The cache's first axis: every layer, or with KV cache groups the layers of one group."""
        return self.model_config.num_kv_layers if self.kv_groups is None else self.kv_groups.size

    @property
    def state_bytes(self) -> int:
        """The state cache's bytes (hybrid models; 0 for others), over every slot and linear layer."""
        return 0 if self.state_spec is None else self.num_state_slots * self.state_spec.slot_bytes

    def _state_plan(self) -> str:
        if self.state_spec is None:
            return ""
        spec = self.state_spec
        return (f"; {spec.num_layers} linear layers' states beside it, {self.num_state_slots} slots of "
                f"{spec.slot_bytes / 1e6:.2f} MB ({self.state_bytes / 1e6:.1f} MB), the KV serving the "
                f"{self.model_config.num_kv_layers} attention layers; prefix caching off")

    @property
    def block_bytes(self) -> int:
        """One block's bytes over the layers it serves (every layer, or one group's), K and V and KV head (an 8-bit
        cache's scales included)."""
        cfg = self.model_config
        per_token_head = kv_bytes_per_token_head(cfg.head_dim, self.config.kv_cache_dtype, self.dtype)
        return self.kv_layers * 2 * cfg.num_kv_heads * self.block_size * per_token_head

    @property
    def layer_block_bytes(self) -> int:
        """One block's bytes in one layer."""
        return self.block_bytes // self.kv_layers

    @property
    def mirrored_block_bytes(self) -> int:
        """What each block id costs beside the pool: the layers kept apart on the pool's block ids (mirrored_kv: the
        MTP layer's cache, spec_decode/mtp.py)."""
        return self.mirrored_kv[0] * self.layer_block_bytes

    def memory_plan(self) -> str:
        """What start-up put on the device: weights (and how they are stored), the KV pool and the tokens it holds."""
        weights = param_bytes(self.state) / 1e6
        scheme = self.weight_scheme
        kv = self.kv_cache_dtype if self.kv_cache_dtype != "auto" else jnp.dtype(self.dtype).name
        tokens = self.num_blocks * self.block_size
        per_token = self.block_bytes / self.block_size / 1e3
        window = freeing_window(self.model_config.sliding_windows)
        held = "" if window is None else (
            f"; sliding window {window}: blocks behind it go back to the pool, so a {self.history_width}-token sequence "
            f"holds at most {self.seq_blocks} blocks ({self.num_blocks // self.seq_blocks} such sequences at once)")
        if self.kv_groups is not None:
            groups = self.kv_groups
            held = (f"; KV cache groups: {len(groups.layers)} of {groups.size} layers (windows {list(groups.windows)}), "
                    f"a block serving one group; windowed (or chunked) groups give back what their window (or chunk) "
                    f"left, so a "
                    f"{self.history_width}-token sequence holds at most {self.seq_blocks} blocks over all groups "
                    f"({self.num_blocks // self.seq_blocks} such sequences at once)")  # fmt: skip
        layers, extra = self.mirrored_kv
        if layers:
            held += (f"; the MTP layer's cache beside it on the same block ids ({layers} layer, {extra} scratch blocks: "
                     f"{(self.num_blocks + extra) * self.mirrored_block_bytes / 1e6:.1f} MB)")  # fmt: skip
        return (f"weights {weights:.1f} MB ({jnp.dtype(self.dtype).name}, quantization: {scheme}); KV cache {self.num_blocks} blocks "
                f"of {self.block_size} tokens in {kv} ({self.num_blocks * self.block_bytes / 1e6:.1f} MB, {per_token:.1f} kB a token), "
                f"up to {tokens} tokens held at once{held}{self._state_plan()}")  # fmt: skip

    @property
    def seq_blocks(self) -> int:
        """The most blocks one max_model_len sequence holds at once: its table's width, or with a freeing sliding
        window about the window's (jaxpaged/core/kv_cache_manager.py)."""
        step = self.config.max_num_batched_tokens
        if self.kv_groups is not None:
            return self.kv_groups.blocks_held(self.history_width, self.block_size, step)
        return max_blocks_held(self.history_width, self.block_size, freeing_window(self.model_config.sliding_windows), step)

    def check_memory(self, weight_bytes: int) -> None:
        """Before the KV pool is allocated: the weights and one max_model_len sequence's KV must fit this engine's
        devices. Logs how many devices the model and context need; a ValueError saying so when they do not fit."""
        per_device, shared = self.platform.device_memory(self.device)
        need = weight_bytes + self.seq_blocks * (self.block_bytes + self.mirrored_block_bytes)
        need += self.state_spec.slot_bytes if self.state_spec else 0
        n = self.config.devices_per_replica
        if per_device is None:
            return
        usable = per_device * (1.0 if shared else (self.config.kv_cache_memory_fraction or 1.0))
        devices_needed = 1 if shared else max(1, math.ceil(need / usable))
        gb = 1e9
        logger.info("memory: weights %.2f GB + one %d-token sequence's KV %.2f GB = %.2f GB: %s", weight_bytes / gb,
                    self.history_width, (need - weight_bytes) / gb, need / gb,
                    f"fits in the host's {usable / gb:.1f} GB" if shared else
                    f"needs {devices_needed} device(s) of {usable / gb:.1f} GB usable; this engine spans {n}")  # fmt: skip
        if need > usable * (1 if shared else n):
            where = f"the host's {usable / gb:.1f} GB" if shared else f"{n} device(s) of {usable / gb:.1f} GB usable"
            raise ValueError(
                f"this model needs {need / gb:.2f} GB for its weights and one {self.history_width}-token sequence's KV cache, "
                f"more than {where}; " + ("lower max_model_len or use a smaller dtype or quantization" if shared else
                f"tensor_parallel_size x pipeline_parallel_size must reach {devices_needed} devices (or lower max_model_len)")
            )  # fmt: skip

    def _pool_size(self, weight_bytes: int) -> int:
        self.check_memory(weight_bytes)
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        mirrored = self.mirrored_kv[1] * self.mirrored_block_bytes  # (its scratch blocks)
        return self.platform.num_kv_blocks(
            self.config, block_bytes=self.block_bytes + self.mirrored_block_bytes, weight_bytes=weight_bytes,
            table_width=self.seq_blocks, reserved_bytes=self._workspace_bytes() + self.state_bytes + mirrored,
        )

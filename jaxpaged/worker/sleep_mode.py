"""Giving device memory back between rollouts (issue 47), as vLLM's sleep mode: the KV pool freed, the weights moved
to host memory (level 1) or dropped (level 2), and each brought back on its own (`wake(["weights"])` before
`wake(["kv_cache"])` lets a trainer load new weights before the pool is rebuilt).

What comes back has the shapes, dtypes and shardings the compiled steps were built for, and is made by a program
compiled when the engine went to sleep, so waking compiles nothing. Weights dropped at level 2 come back as zeros
(their memory reserved, as vLLM's) and count as missing until an update gives them values (the engine refuses
requests until then).
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp

from jaxpaged.utils import compile_monitor

logger = logging.getLogger("jaxpaged.sleep")

TAGS = ("weights", "kv_cache")
HOST = "pinned_host"


def _abstract(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _zeros_program(abstract):
    """A compiled program making zeros in `abstract`'s shapes and shardings (compiled now, run on wake)."""
    leaves, treedef = jax.tree_util.tree_flatten(abstract)

    def zeros():
        return [jnp.zeros(a.shape, a.dtype) for a in leaves]

    with compile_monitor.expected():
        compiled = jax.jit(zeros, out_shardings=[a.sharding for a in leaves]).lower().compile()
    return lambda: jax.tree_util.tree_unflatten(treedef, compiled())


def device_bytes_in_use(devices) -> int:
    """The devices' memory in use: the allocator's count where it keeps one (GPU, TPU), else the live arrays' bytes
    in device memory (the CPU, whose host-memory arrays are another memory kind)."""
    stats = [d.memory_stats() or {} for d in devices]
    if all("bytes_in_use" in s for s in stats):
        return sum(s["bytes_in_use"] for s in stats)
    devices = set(devices)
    total = 0
    for x in jax.live_arrays():
        if x.is_deleted() or x.sharding.memory_kind not in (None, "device") or not set(x.sharding.device_set) & devices:
            continue
        total += sum(shard.data.nbytes for shard in x.addressable_shards if shard.device in devices)
    return total


class RunnerSleep:
    """A runner's sleep state: which of its weights and KV pool are away, and how to bring them back."""

    def __init__(self, runner, updater):
        self.runner = runner
        self.updater = updater
        self.weights = "awake"  # "awake", "host" (level 1) or "dropped" (level 2)
        self.kv_asleep = False
        self._host_state = None
        self._state_abstract = None
        self._make_state = None
        self._make_kv = None

    def own_bytes(self) -> int:
        """The device bytes of this runner's weights and KV pool (what sleep gives back)."""
        leaves = jax.tree_util.tree_leaves((self.runner.state, self.runner.kv_cache))
        return sum(x.nbytes for x in leaves if isinstance(x, jax.Array) and not x.is_deleted()
                   and x.sharding.memory_kind in (None, "device"))  # fmt: skip

    @property
    def asleep(self) -> bool:
        return self.kv_asleep or self.weights != "awake"

    def sleep(self, level: int) -> None:
        runner = self.runner
        if not self.kv_asleep:
            jax.block_until_ready(runner.kv_cache)
            if self._make_kv is None:
                self._make_kv = _zeros_program(_abstract(runner.kv_cache))
            for leaf in jax.tree_util.tree_leaves(runner.kv_cache):
                leaf.delete()  # the engine's own: gone at once
            runner.kv_cache = None
            self.kv_asleep = True
        if self.weights == "awake":
            jax.block_until_ready(runner.state)
            self._state_abstract = _abstract(runner.state)
        if level == 2 and self.weights != "dropped" and self._make_state is None:
            self._make_state = _zeros_program(self._state_abstract)  # compiled now: waking compiles nothing
        if self.weights == "awake":
            if level == 1:
                self._host_state = jax.tree_util.tree_map(
                    lambda x: jax.device_put(x, x.sharding.with_memory_kind(HOST)), runner.state)
                jax.block_until_ready(self._host_state)
                self.weights = "host"
            else:
                self.weights = "dropped"
            # dropped, not deleted: an update may have installed a trainer's own arrays (a pointer swap)
            runner.state = None
        elif self.weights == "host" and level == 2:
            self._host_state, self.weights = None, "dropped"

    def wake(self, tags) -> None:
        runner = self.runner
        if "weights" in tags and self.weights != "awake":
            if self.weights == "host":
                shardings = jax.tree_util.tree_map(lambda a: a.sharding, self._state_abstract)
                runner.state = jax.device_put(self._host_state, shardings)
                self._host_state = None
            else:
                runner.state = self._make_state()
                self.updater.missing = set(range(len(self.updater.layout.paths)))
                logger.info("wake_up: the weights sleep(level=2) dropped are zeros until update_weights gives them")
            jax.block_until_ready(runner.state)
            self.weights = "awake"
        if "kv_cache" in tags and self.kv_asleep:
            t0 = time.perf_counter()
            runner.kv_cache = self._make_kv()
            jax.block_until_ready(runner.kv_cache)
            self.kv_asleep = False
            logger.debug("KV pool back in %.3fs", time.perf_counter() - t0)

"""Several processes, one engine, on JAX's multi-controller runtime (`jax.distributed`).

Every process loads the model and runs the same jitted steps over one global mesh; process 0 (the leader) owns the
scheduler, the tokenizer and any server, and sends each of its runner's device calls to the others (followers),
which replay them. The transport is a JAX collective: each message is pickled, padded to one of a few size classes
and broadcast by an all-reduce over a one-device-per-process mesh, one executable per class compiled when the
channel opens, so serving compiles nothing new. On CPU the collectives go through gloo.

A follower that dies makes the leader's next broadcast fail at once (its peer's connection closes): the leader
raises ProcessGroupError and the engine reports it. JAX's recoverable mode is on, so the coordination service does
not also terminate the leader when the dead peer's heartbeats stop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import threading
import time
from typing import Any

import jax
import numpy as np

logger = logging.getLogger("jaxpaged.distributed")

HEADER_BYTES = 16  # the size class and the exact length of the message that follows
SIZE_CLASSES = tuple(2**k for k in range(12, 27))  # 4 KiB .. 64 MiB: a step's inputs, padded up to the next one


class ProcessGroupError(RuntimeError):
    """A process of the distributed group failed, left or did not answer in time."""


def wants_distributed(config) -> bool:
    return bool(config.distributed or config.coordinator_address or (config.num_processes or 1) > 1)


def initialize(config) -> None:
    """Join the process group the config names (or that JAX detects on a cluster), before JAX starts a backend."""
    if not wants_distributed(config) or jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes need it; others ignore it
    jax.config.update("jax_enable_recoverability", True)  # a dead peer fails collectives, not this process
    t0 = time.perf_counter()
    if config.process_id and config.coordinator_address:  # JAX aborts the process on this timeout: check first
        _await_coordinator(config.coordinator_address, config.distributed_timeout_s)
    logger.info("joining the process group at %s as process %s of %s (up to %.0fs)", config.coordinator_address,
                config.process_id, config.num_processes, config.distributed_timeout_s)  # fmt: skip
    try:
        jax.distributed.initialize(
            config.coordinator_address, config.num_processes, config.process_id,
            initialization_timeout=int(config.distributed_timeout_s),
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - JAX raises several kinds for a group that does not form
        raise ProcessGroupError(
            f"could not join the process group at {config.coordinator_address} as process {config.process_id} of "
            f"{config.num_processes} within {config.distributed_timeout_s:.0f}s: {e}"
        ) from e
    logger.info("process %d of %d joined in %.1fs: %d devices, %d here", jax.process_index(), jax.process_count(),
                time.perf_counter() - t0, jax.device_count(), jax.local_device_count())  # fmt: skip


def _await_coordinator(address: str, timeout_s: float) -> None:
    """Wait (bounded) until process 0's coordinator accepts connections."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ProcessGroupError(f"could not join the process group: no coordinator answered at {address} "
                                        f"within {timeout_s:.0f}s ({e}); is process 0 running?") from e  # fmt: skip
            time.sleep(0.2)


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def leave() -> None:
    """A follower leaves the group once the leader has released it, while the leader still waits for it (leaving
    after the leader's coordination service has gone aborts the process)."""
    try:
        jax.distributed.shutdown()
    except Exception as e:  # noqa: BLE001 - the group is over either way
        logger.warning("leaving the process group: %s", e)


def await_followers(timeout_s: float = 30.0, grace_s: float = 1.0) -> None:
    """The leader waits (bounded) until every follower has left, so its own exit does not pull the group down.

    The coordinator drops a follower from the live set before its answer to that follower's leave is sent: exiting
    at once can still abort the follower, hence grace_s after the last one has gone."""
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        return
    everyone = list(range(jax.process_count()))  # the coordinator refuses a query that leaves out the asking process
    gone = threading.Event()

    def wait() -> None:
        try:  # the call blocks until each live process in the list has left or made the same call
            while set(client.get_live_nodes(everyone)) - {jax.process_index()}:
                time.sleep(0.05)
        except Exception as e:  # noqa: BLE001 - the group is over either way
            logger.warning("waiting for the followers to leave: %s", e)
        gone.set()

    threading.Thread(target=wait, name="jaxpaged-await-followers", daemon=True).start()
    if not gone.wait(timeout_s):
        logger.warning("followers still connected %.0fs after release; exiting anyway", timeout_s)
        return
    time.sleep(grace_s)


class Watchdog:
    """Process 0's bound on waiting for the others: a peer that is alive but stuck (no connection closes) would
    otherwise hold a broadcast or a step's collective forever. Past timeout_s, on_stall is called once."""

    def __init__(self, timeout_s: float, on_stall):
        self.timeout_s, self.on_stall = timeout_s, on_stall
        self._since: float | None = None
        self._what = ""
        threading.Thread(target=self._run, name="jaxpaged-group-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def waiting(self, what: str):
        outer = self._since, self._what
        self._since, self._what = time.monotonic(), what
        try:
            yield
        finally:
            self._since, self._what = outer

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout_s:
                self.on_stall(f"{self._what} has waited {time.monotonic() - since:.0f}s for the other processes")
                return


_watchdog: Watchdog | None = None  # the leader's, once its runner starts one


def watch(timeout_s: float, on_stall) -> None:
    global _watchdog
    _watchdog = Watchdog(timeout_s, on_stall)


def waiting(what: str):
    """Around a wait on the other processes (the leader's watchdog times it; nothing elsewhere)."""
    return _watchdog.waiting(what) if _watchdog is not None else contextlib.nullcontext()


def end_process(error: ProcessGroupError, grace_s: float = 5.0) -> None:
    """A stuck group cannot be recovered from inside (the wait is in a collective): log, and exit after grace_s,
    time for a server's /health to answer 503."""
    logger.error("%s; process %d exits in %.0fs", error, jax.process_index(), grace_s)
    threading.Timer(grace_s, os._exit, args=(1,)).start()


def host_value(x) -> np.ndarray:
    """A replicated array's value on this host (device_get refuses arrays that span other processes' devices).
    In a group, a step whose collective lost its peer fails here: that is a ProcessGroupError."""
    with lost_peer_is_group_error(), waiting("reading a step's results"):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_shards[0].data)
        return np.asarray(jax.device_get(x))


@contextlib.contextmanager
def lost_peer_is_group_error():
    """In a group, a JAX error from a collective whose transport lost a peer (gloo, NCCL and the coordination
    service say so in their words) is re-raised as a ProcessGroupError; any other error passes unchanged."""
    try:
        yield
    except (jax.errors.JaxRuntimeError, ValueError) as e:
        text = str(e).lower()
        words = ("gloo", "nccl", "connection reset", "connection closed", "unavailable", "peer")
        if is_multiprocess() and any(word in text for word in words):
            raise ProcessGroupError(f"a process of the group failed or left: {e}") from e
        raise


class StepChannel:
    """The leader's messages to the followers: send() on process 0, receive() everywhere else, in the same order."""

    def __init__(self):
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        self.processes = jax.process_count()
        devices = [next(d for d in jax.devices() if d.process_index == p) for p in range(self.processes)]
        self.mesh = Mesh(np.array(devices), ("process",))
        self.rows = NamedSharding(self.mesh, PartitionSpec("process"))
        self.device = next(d for d in devices if d.process_index == jax.process_index())
        reduce = jax.jit(lambda x: x.sum(axis=0, dtype=np.uint8), out_shardings=NamedSharding(self.mesh, PartitionSpec()))
        self._reduce = {}
        for size in (HEADER_BYTES, *SIZE_CLASSES):  # all compiled now: no message compiles anything later
            shape = jax.ShapeDtypeStruct((self.processes, size), np.uint8, sharding=self.rows)
            self._reduce[size] = reduce.lower(shape).compile()

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        size = next((s for s in SIZE_CLASSES if s >= len(data)), None)
        if size is None:
            raise ProcessGroupError(f"a step message of {len(data)} bytes exceeds the largest size class ({SIZE_CLASSES[-1]})")
        self._broadcast(np.array([size, len(data)], np.int64).view(np.uint8))
        self._broadcast(np.frombuffer(data.ljust(size, b"\0"), np.uint8))

    def receive(self) -> Any:
        size, length = self._broadcast(np.zeros(HEADER_BYTES, np.uint8)).view(np.int64)
        return pickle.loads(self._broadcast(np.zeros(int(size), np.uint8))[: int(length)].tobytes())

    def _broadcast(self, row: np.ndarray) -> np.ndarray:
        """The leader's row, on every process: each contributes its row (zeros but the leader's) to a sum."""
        local = row if is_leader() else np.zeros_like(row)
        shard = jax.device_put(local[None], self.device)
        rows = jax.make_array_from_single_device_arrays((self.processes, row.size), self.rows, [shard])
        try:
            with waiting("a step's broadcast"):
                return host_value(self._reduce[row.size](rows))
        except (jax.errors.JaxRuntimeError, ValueError) as e:  # gloo reports a closed peer as a ValueError
            raise ProcessGroupError(f"a process of the group failed or left: {e}") from e

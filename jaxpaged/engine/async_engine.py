"""AsyncLLMEngine: one background thread steps the engine; asyncio callers add, stream and abort.

`LLMEngine.step()` is a blocking JAX call, so it never runs on the event loop. A dedicated thread
owns the engine: every mutation (add, abort, step) happens there, fed by a command queue, so the
engine needs no locks. Outputs go back to the loop with one `call_soon_threadsafe` per step. What a request needs
before it is added and that touches no engine state (tokenizing text and templating a conversation with a tokenizer
copy, fetching and decoding media) is done in a worker thread first, so that the engine's thread keeps stepping.

A request's outputs are cumulative (as vLLM's), so its stream keeps only the latest one: a slow
reader skips intermediate outputs instead of queueing them, and memory stays bounded.

If a step raises, the thread dies: every caller waiting on a stream gets `EngineDeadError`,
`errored` becomes True and every later call fails at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from jaxpaged.engine.llm_engine import LLMEngine, PromptType
from jaxpaged.engine.metrics import IterationStats, RequestTimer
from jaxpaged.engine.weight_sync import check_update
from jaxpaged.lora import LoRARequest
from jaxpaged.outputs import PoolingRequestOutput, RequestOutput
from jaxpaged.pooling_params import PoolingParams
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.utils.text import ChatPrompt

__all__ = ["AsyncLLMEngine", "ChatPrompt", "EngineDeadError", "IterationStats", "QueueFullError", "RequestStream"]

logger = logging.getLogger("jaxpaged.async_engine")
HEARTBEAT_S = 2.0  # an idle engine's check of its process group's followers


class EngineDeadError(RuntimeError):
    """The step loop has died; the engine serves nothing more."""


class QueueFullError(RuntimeError):
    """The waiting queue already holds `max_waiting` requests; try again later."""


class RequestStream:
    """The latest output of one request, readable from the event loop.

    Streams of one HTTP request may share `event`, so one reader can wait on all of them at once
    (one reader per event: a reader clears it before waiting).
    """

    def __init__(self, request_id: str, event: asyncio.Event):
        self.request_id = request_id
        self.event = event
        self.finished = False
        self.error: BaseException | None = None
        self.prompt_token_ids: list[int] = []
        self._latest: RequestOutput | None = None

    def _put(self, output: RequestOutput) -> None:
        if self.finished:
            return
        self._latest = output
        self.finished = output.finished
        self.event.set()

    def _fail(self, error: BaseException) -> None:
        if self.finished:
            return
        self.error, self.finished = error, True
        self.event.set()

    @property
    def pending(self) -> bool:
        """Something arrived that take() has not returned yet."""
        return self._latest is not None or self.error is not None

    def take(self) -> RequestOutput | None:
        """The output that arrived since the last take (None if none); raises the loop's error."""
        if self.error is not None:
            raise self.error
        out, self._latest = self._latest, None
        return out

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            out = self.take()
            if out is not None:
                yield out
                if out.finished:
                    return
                continue
            self.event.clear()
            if not self.pending:
                await self.event.wait()


class AsyncLLMEngine:
    """Many asyncio callers share one continuous batch stepped on a background thread."""

    def __init__(
        self,
        engine: LLMEngine,  # or a DataParallelEngine (engine/data_parallel.py): the same interface
        *,
        max_waiting: int | None = None,
        stats_listener: Callable[[IterationStats], None] | None = None,
    ):
        if max_waiting is not None and (isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1):
            raise ValueError(f"max_waiting must be None or a positive integer (got {max_waiting!r})")
        self.engine = engine
        self.max_waiting = max_waiting
        self.stats_listener = stats_listener
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # orders "is it dead?" checks against the death itself
        self._dead: BaseException | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        # engine-thread state
        self._streams: dict[str, tuple[RequestStream, asyncio.AbstractEventLoop]] = {}
        self._timer = RequestTimer()  # arrivals and token times -> each pass's IterationStats (engine/metrics.py)
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        # a call waiting for the requests in flight to finish (update_weights, sleep), and the adds and calls sent
        # after it, which wait behind it
        self._held: list[tuple] = []
        self._stats: dict[str, Any] = engine.get_stats()
        self._preemptions = self._stats["num_preemptions"]
        if getattr(engine, "needs_heartbeat", False):
            self.start()  # a process group's failure shows on /health even before the first request

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jaxpaged-engine", daemon=True)
                self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop; unfinished requests are aborted and their callers get EngineDeadError."""
        with self._lock:
            self._stopping = True
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine serves no more: its loop died, or its process group stalled (the loop waits in it)."""
        return self._dead or getattr(self.engine, "group_error", None)

    def get_stats(self) -> dict[str, Any]:
        """The engine's stats as of the last loop pass (a snapshot: safe from any thread)."""
        return dict(self._stats)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def harmony(self) -> bool:
        """Whether chat prompts are rendered by openai-harmony (GPT-OSS), not the chat template."""
        return bool(getattr(self.engine, "harmony", False))

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def default_sampling_kwargs(self) -> dict:
        """The model's generation config defaults for the fields a request leaves unset (llm_engine)."""
        return getattr(self.engine, "default_sampling_kwargs", {})

    # -- the caller's side (event loop) -----------------------------------------------------------

    def _submit(self, command: tuple) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine loop has died: {self._dead!r}")
            if self._stopping:
                raise EngineDeadError("the engine is shutting down")
            self._commands.put(command)
        self.start()

    async def add_requests(
        self, requests: Sequence[tuple[str, PromptType | ChatPrompt, SamplingParams]] | Sequence[tuple], event: asyncio.Event | None = None
    ) -> list[RequestStream]:
        """Queue requests, all or none: the first bad one raises its ValueError and none stays queued.

        Raises ValueError (bad input, naming the parameter), QueueFullError or EngineDeadError.
        """
        loop = asyncio.get_running_loop()
        if hasattr(self.engine, "render_prompt") and any(_to_prepare(prompt) for _, prompt, *_ in requests):
            # media fetched and decoded, text templated and tokenized, here in a worker thread: the engine's keeps stepping
            requests = await loop.run_in_executor(None, self._prepare, list(requests))
        event = event or asyncio.Event()
        streams = [RequestStream(str(rid), event) for rid, *_ in requests]
        done: asyncio.Future = loop.create_future()
        self._submit(("add", list(requests), streams, loop, done))
        try:
            await done
        except asyncio.CancelledError:
            for stream in streams:  # the add may still land: make sure nothing runs for nobody
                self.abort(stream.request_id)
            raise
        return streams

    def _prepare(self, requests: list[tuple]) -> list[tuple]:
        engine = self.engine
        return [(rid, engine.render_prompt(engine.load_media(prompt)), *rest) for rid, prompt, *rest in requests]

    async def add_request(self, request_id: str, prompt: PromptType | ChatPrompt, params: SamplingParams,
                          lora_request: LoRARequest | None = None, priority: int = 0) -> RequestStream:  # fmt: skip
        return (await self.add_requests([(request_id, prompt, params, lora_request, priority)]))[0]

    async def generate(
        self, prompt: PromptType | ChatPrompt, sampling_params: SamplingParams, request_id: str,
        lora_request: LoRARequest | None = None, priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs as they grow (vLLM's AsyncLLM.generate, `lora_request` included);
        leaving early (or being cancelled) aborts it. priority: with scheduling_policy "priority", lower first (vLLM's)."""
        stream = await self.add_request(request_id, prompt, sampling_params, lora_request, priority)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    async def encode(self, prompt: PromptType | ChatPrompt, pooling_params: PoolingParams, request_id: str,
                     lora_request: LoRARequest | None = None, priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:  # fmt: skip
        """A pooling engine's (runner="pooling") output for the prompt, yielded once it has run (vLLM's AsyncLLM.encode);
        leaving early (or being cancelled) aborts it. priority: as generate's."""
        async for out in self.generate(prompt, pooling_params, request_id, lora_request, priority):
            yield out

    async def _on_engine(self, fn: Callable[[Any], Any], when_idle: bool,
                         check: Callable[[Any], None] | None = None) -> Any:  # fmt: skip
        """fn(engine) on the engine thread, its result or error back here; when_idle: once the requests in flight
        have finished (they stream as usual), with requests sent meanwhile held until it has run. check(engine), if
        given, runs before fn is held: its error (bad input) comes back at once, not after the wait."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._submit(("call", fn, when_idle, loop, done, check))
        return await done

    async def update_weights(self, weights, *, mapping=None, in_flight: str = "finish", lora_request=None,
                             copy: bool = False) -> dict[str, Any]:  # fmt: skip
        """LLMEngine.update_weights on the engine thread. in_flight="finish": the requests in flight finish (and
        stream) first, new ones wait for the update; "abort": they end at once with finish_reason "abort"."""
        kwargs = {"mapping": mapping, "in_flight": in_flight, "lora_request": lora_request, "copy": copy}
        return await self._on_engine(lambda engine: engine.update_weights(weights, **kwargs),
                                     when_idle=in_flight == "finish",
                                     check=lambda engine: check_update(engine, weights, **kwargs))  # fmt: skip

    async def sleep(self, level: int = 1, *, in_flight: str = "finish", queue_requests: bool = False) -> dict[str, Any]:
        """LLMEngine.sleep on the engine thread; requests sent while asleep are refused (EngineAsleepError) or, with
        queue_requests, run after wake_up."""
        return await self._on_engine(
            lambda engine: engine.sleep(level, in_flight=in_flight, queue_requests=queue_requests),
            when_idle=in_flight == "finish")  # fmt: skip

    async def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        return await self._on_engine(lambda engine: engine.wake_up(tags), when_idle=False)

    async def reset_prefix_cache(self) -> bool:
        """LLMEngine.reset_prefix_cache on the engine thread, between steps: False while requests hold KV blocks
        (as vLLM, it does not wait for them)."""
        return await self._on_engine(lambda engine: engine.reset_prefix_cache(), when_idle=False)

    async def start_profile(self, profile_prefix: str | None = None) -> str:
        """LLMEngine.start_profile on the engine thread, between steps."""
        return await self._on_engine(lambda engine: engine.start_profile(profile_prefix), when_idle=False)

    async def stop_profile(self) -> str:
        return await self._on_engine(lambda engine: engine.stop_profile(), when_idle=False)

    @property
    def profiler_dir(self) -> str | None:
        """Where start_profile writes (None: profiling is off, and the server has no profile routes)."""
        return getattr(self.engine.config, "profiler_dir", None)

    async def get_per_token_logps(self, prompt_tokens, completion_tokens, *, pad_id: int | None = None):
        """LLM.get_per_token_logps beside whatever else the engine runs (engine/scoring.py): float32 [B, C]."""
        from jaxpaged.engine.scoring import SCORING_PARAMS, logps_from_outputs, scoring_requests

        sequences, starts, width, slots = scoring_requests(prompt_tokens, completion_tokens, pad_id)
        tag = f"score-{id(sequences)}-{time.monotonic_ns()}"
        streams = await self.add_requests([(f"{tag}-{i}", {"prompt_token_ids": s}, SCORING_PARAMS) for i, s in enumerate(sequences)])
        finals = []
        for stream in streams:
            last = None
            async for out in stream:
                last = out
            finals.append(last)
        return logps_from_outputs(finals, starts, width, slots)

    @property
    def is_sleeping(self) -> bool:
        return bool(getattr(self.engine, "is_sleeping", False))

    def abort(self, request_id: str) -> None:
        """Cancel a request from any thread; its blocks return after the step in flight."""
        try:
            self._submit(("abort", str(request_id)))
        except EngineDeadError:
            pass  # nothing runs any more

    # -- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if self._held and not self.engine.has_unfinished_requests():
                    self._release_held()
                    if self._outbox:  # what it settled (a held abort's final output) goes out before the loop waits
                        self._publish()
                self._drain(block=not self.engine.has_unfinished_requests() and not self._held)
                if self._stopping:
                    break
                if self._outbox:  # aborts: their final outputs (and freed blocks) go out before the next step
                    self._publish()
                if self.engine.has_unfinished_requests():
                    self._route_outputs(self.engine.step())
                self._publish()
        except BaseException as exc:
            logger.exception("the engine loop died")
            self._die(exc)
            return
        self._die(EngineDeadError("the engine was shut down"))

    def _drain(self, block: bool) -> None:
        try:
            if block and getattr(self.engine, "needs_heartbeat", False):
                while True:  # idle in a process group: check the followers every HEARTBEAT_S
                    try:
                        command = self._commands.get(timeout=HEARTBEAT_S)
                        break
                    except queue.Empty:
                        self.engine.heartbeat()
            else:
                command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._command(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _command(self, command: tuple) -> None:
        kind = command[0]
        if kind == "call" and (self._held or command[2] and self.engine.has_unfinished_requests()):
            self._hold_call(command)
        elif kind == "add" and self._held:  # behind a call waiting for the engine to be idle
            self._held.append(command)
        elif kind == "add":
            self._add(*command[1:])
        elif kind == "abort":
            self._abort(command[1])
            if any(c[0] == "add" and any(s.request_id == command[1] for s in c[2]) for c in self._held):
                self._held.append(command)  # an add of that id is held: it must not run for nobody once released
        elif kind == "call":
            self._call(*command[1:5])

    def _hold_call(self, command: tuple) -> None:
        """Hold a call that must wait, once its check has passed: a failed one settles its caller now."""
        check, loop, done = command[5], command[3], command[4]
        if check is not None:
            try:
                check(self.engine)
            except Exception as exc:  # noqa: BLE001 - bad input goes back to its caller; the loop goes on
                _call_soon(loop, _settle, done, exc)
                return
        self._held.append((*command[:5], None))  # checked: not again if released only to wait behind another call

    def _release_held(self) -> None:
        """The engine is idle: run the held call, then what came after it (up to the next call that must wait)."""
        held, self._held = self._held, []
        for i, command in enumerate(held):
            if self._held:
                self._held.extend(held[i:])
                return
            try:
                self._command(command)
            except BaseException:
                self._held.extend(held[i + 1 :])  # the loop dies: _die settles them (held only here, they'd wait forever)
                raise

    def _call(self, fn, when_idle, loop, done) -> None:
        try:
            result = fn(self.engine)
        except Exception as exc:  # noqa: BLE001 - bad input goes back to its caller; the loop goes on
            _call_soon(loop, _settle, done, exc)
            return
        if isinstance(result, dict) and result.get("outputs"):
            self._route_outputs(result["outputs"])  # the requests it aborted or finished
        _call_soon(loop, _resolve, done, result)

    def _add(self, requests, streams, loop, done) -> None:
        added: list[str] = []
        try:
            if self.max_waiting is not None and len(requests) > self.max_waiting:
                raise ValueError(f"prompt: {len(requests)} prompts in one request exceed the waiting queue ({self.max_waiting})")
            if self.max_waiting is not None and self.engine.num_waiting_requests() + len(requests) > self.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests); retry later")
            for (rid, prompt, params, *extra), stream in zip(requests, streams):  # extra: a LoRARequest (or None), a priority
                # (a conversation the worker thread left as it was, harmony's or with images, is rendered here)
                self.engine.add_request(rid, prompt, params, **_optional_args(*extra))
                added.append(rid)
                stream.prompt_token_ids = self.engine.get_prompt_token_ids(rid)
        except Exception as exc:  # noqa: BLE001 - bad input goes back to its caller; the loop goes on
            for rid in added:
                self.engine.abort_request(rid)
            _call_soon(loop, _settle, done, exc)
            return
        now = time.monotonic()
        for stream in streams:
            self._streams[stream.request_id] = (stream, loop)
            self._timer.added(stream.request_id, len(stream.prompt_token_ids), now)
        _call_soon(loop, _settle, done, None)

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort_request_with_output(request_id)
        if output is not None:
            self._route_outputs([output])

    def _route_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            rid = out.request_id
            entry = self._streams.get(rid)
            self._timer.output(out, now)
            if out.finished:
                self._streams.pop(rid, None)
            if entry is not None:
                self._outbox.setdefault(entry[1], []).append((entry[0], out))

    def _publish(self) -> None:
        """Refresh the stats snapshot, then hand this pass's outputs over: whoever sees an output sees its stats."""
        self._stats = self.engine.get_stats()
        stats = self._timer.take()
        stats.engine = self._stats
        stats.preemptions = self._stats["num_preemptions"] - self._preemptions
        self._preemptions = self._stats["num_preemptions"]
        if self.stats_listener is not None:
            try:
                self.stats_listener(stats)
            except Exception:
                logger.exception("stats listener failed")
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            _call_soon(loop, _deliver, items)

    def _die(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"the engine loop has died: {exc!r}")
        error.__cause__ = None if error is exc else exc
        with self._lock:
            self._dead = error
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            _call_soon(loop, _deliver, items)
        pending, self._held = self._held + pending, []
        for command in pending:
            if command[0] == "add":
                _call_soon(command[3], _settle, command[4], error)
            elif command[0] == "call":
                _call_soon(command[3], _settle, command[4], error)
        for rid, (stream, loop) in list(self._streams.items()):
            _call_soon(loop, stream._fail, error)
            try:
                self.engine.abort_request(rid)  # give the blocks back if the engine still can
            except Exception:
                logger.debug("could not abort %s after the loop died", rid, exc_info=True)
        self._streams.clear()
        self._timer.clear()
        try:
            self._stats = self.engine.get_stats()
        except Exception:
            logger.debug("no stats after the loop died", exc_info=True)


def _to_prepare(prompt) -> bool:
    """Whether a prompt has work the engine's thread need not do: text to tokenize, a conversation to template,
    images or videos (files to fetch and decode). Token ids and embeddings have none."""
    if isinstance(prompt, dict):
        return bool(prompt.get("multi_modal_data")) or prompt.keys() == {"prompt"}
    return isinstance(prompt, (str, ChatPrompt))


def _optional_args(lora_request=None, priority=0) -> dict:
    """add_request's optional arguments, only those set: a data parallel engine takes no lora_request."""
    return ({} if lora_request is None else {"lora_request": lora_request}) | ({} if priority == 0 else {"priority": priority})


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # that caller's event loop is closed: nobody is listening


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _resolve(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _deliver(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream._put(out)

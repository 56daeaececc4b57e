"""Compiling the step per token bucket: at warm-up, in the background while serving starts, or on first use; each
executable stored for later starts (executable_cache.py) and called directly, so no other shape can compile."""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxpaged.utils import compile_monitor
from jaxpaged.utils.logging_utils import progress_hidden
from jaxpaged.worker.sampler import bitmask_words, build_sampling_metadata
from jaxpaged.worker.sampler_plans import sampler_name

logger = logging.getLogger("jaxpaged.runner")


def token_buckets(max_tokens: int, max_seqs: int | None = None, smallest: int = 4) -> list[int]:
    """Step sizes T that steps are padded to: 4, 8, 16, then about 25% apart (multiples of 8) up to max_seqs, then
    powers of two up to max_tokens. Decode steps fall below max_seqs and shrink one finished request at a time, so
    the finer spacing there keeps a draining batch fuller for a few more compiles (docs/benchmarks.md)."""
    buckets, b = [], min(smallest, max_tokens)
    while b < max_tokens:
        buckets.append(b)
        fine = max_seqs is not None and b < max_seqs
        b = min(-(-b * 5 // 4 // 8) * 8, max_seqs) if fine else b * 2
        b = max(b, buckets[-1] + 1)
    return buckets + [max_tokens]


def abstract(leaf):
    """A device array as its shape, dtype and placement only: a background compile must not touch the KV cache
    the running steps donate."""
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding, weak_type=leaf.weak_type)
    return leaf


class BucketCompiles:
    """ModelRunner's compiles: `_compiled` holds (name, bucket) -> executable, `_pending` the buckets compiling in
    the background, `ready_buckets` those a step may use now."""

    def _workspace_bytes(self) -> int:
        """Device memory the largest sampler (and prompt-logprobs executable, and vision encoder) takes beyond its
        inputs, read from the compiled executables before the pool takes what is left: none reads the pool, so they
        compile now and warm-up keeps them. On an H100 the 256-row sampler's 5.9 GB did not fit in the 10% the pool
        left."""
        if not self.platform.reserve_step_workspace or not self.single_device:
            return 0
        t = self.buckets[-1]
        rows = self.bucket_for(t)[1]
        state = jax.tree_util.tree_map(abstract, self.state)
        hidden = jax.ShapeDtypeStruct((t, self.model_config.hidden_size), self.dtype, sharding=self._sharding)
        vocab = jax.eval_shape(lambda st, h: nnx.merge(self.graphdef, st).compute_logits(h), state, hidden).shape[-1]
        logits = jax.ShapeDtypeStruct((rows, vocab), jnp.float32, sharding=self._sharding)
        sampling = build_sampling_metadata([], rows, self.history_width, self._max_suppress,
                                           bitmask_words(self.model_config.vocab_size))  # fmt: skip
        no_sampled = jax.ShapeDtypeStruct((self.config.max_num_seqs,), jnp.int32, sharding=self._sharding)
        args = (logits, *jax.tree_util.tree_map(abstract, self._sampling_args(sampling)), no_sampled)
        compiled = []
        with compile_monitor.expected():  # kept for warm-up, which then compiles the rest
            for plan in self._samplers.warm_plans:
                name = sampler_name(plan)
                compiled.append(self.executables.compile(name, self._samplers.jitted(plan), args))
                self._compiled[name, rows] = compiled[-1]
            if self._prompt_apart:
                next_ids = jax.ShapeDtypeStruct((t,), jnp.int32, sharding=self._sharding)
                compiled.append(self.executables.compile("prompt", self._prompt, (state, hidden, next_ids)))
                self._compiled["prompt", t] = compiled[-1]
            if self.mm is not None:  # the vision encoder at its largest bucket
                bucket = self.mm.buckets[-1]
                batch = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=self._sharding),
                                               self.mm.adapter.batch([], bucket))  # fmt: skip
                dst = jax.ShapeDtypeStruct((self.mm.adapter.rows_for(bucket),), jnp.int32, sharding=self._sharding)
                compiled.append(self.executables.compile("encode", self.mm._encode, (state, abstract(self.mm.array), batch, dst)))
                self._compiled["encode", bucket] = compiled[-1]
        need = 0
        for executable in compiled:
            try:
                memory = executable.memory_analysis()
                need = max(need, memory.temp_size_in_bytes + memory.output_size_in_bytes)
            except Exception:  # noqa: BLE001 (a backend without memory analysis: the pool's margin must do)
                return 0
        logger.info("memory: %.2f GB kept for the largest workspace of the sampler, prompt logprobs or encoder", need / 1e9)
        return need

    def bucket_for(self, num_tokens: int) -> tuple[int, int]:
        """(T, S) padded sizes for a step of num_tokens tokens."""
        for b in self.buckets:
            if num_tokens <= b:
                return b, min(b, self.config.max_num_seqs)
        raise ValueError(f"a step of {num_tokens} tokens exceeds max_num_batched_tokens ({self.buckets[-1]})")

    def step_bucket(self, num_tokens: int) -> tuple[int, int]:
        """(T, S) for a step of num_tokens tokens: the smallest bucket ready. While background_compile compiles the
        others, a step is padded to a larger bucket instead of waiting for its own."""
        if len(self.ready_buckets) < len(self.buckets):
            self._collect_background()
        for b in self.ready_buckets:
            if num_tokens <= b:
                return b, min(b, self.config.max_num_seqs)
        return self.bucket_for(num_tokens)  # (its error)

    def finish_background_compiles(self) -> float | None:
        """Wait for background_compile's buckets and the sampler plans compiling (benchmarks, tests): the seconds from
        warm-up to the last bucket, or None."""
        for future in list(self._pending.values()):
            future.result()
        if len(self.ready_buckets) < len(self.buckets):
            self._collect_background()
        self._samplers.finish()
        return self.background_compile_seconds

    def _collect_background(self) -> None:
        """Take in the background compiles that are done."""
        for t, future in list(self._pending.items()):
            if future.done():
                self._compiled.update(self._pending.pop(t).result())
                bisect.insort(self.ready_buckets, t)
                self._store_executables()
        if len(self.ready_buckets) == len(self.buckets):
            self.background_compile_seconds = time.perf_counter() - self._warmup_started
            logger.info("every step bucket compiled, %.1fs after warm-up began", self.background_compile_seconds)

    def prefetch(self, num_tokens: int) -> None:
        """Compile (or load) a bucket's step and KV write on a background thread, for a later step to pick up.
        One device only; the compile is one that precompile-off or warm-up asked for."""
        t, _ = self.bucket_for(num_tokens)
        if not self.single_device or (self._step_name, t) in self._compiled or t in self._pending:
            return
        if self._background is None:
            self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxpaged-compile")
        self._pending[t] = self._background.submit(self._bucket_compiler(t))

    def _bucket_compiler(self, t: int):
        """A call that compiles (or loads) bucket t's forward, KV write and, unless another has it, its sampler, leaving
        them unstored (store_pending, on the main thread): -> {(name, bucket): executable}."""
        step = self.input_batch.blank(t)
        args = jax.tree_util.tree_map(abstract, self._forward_args(step, None))
        sampling = jax.tree_util.tree_map(abstract, self._sampling_args(step.sampling))

        _, rows = self.bucket_for(t)
        # one sampler per row count and warm plan: unless compiled, or queued beside another bucket with as many rows
        plans = self._samplers.warm_plans
        with_sampler = (sampler_name(plans[0]), rows) not in self._compiled and all(
            self.bucket_for(p)[1] != rows for p in self._pending)  # fmt: skip

        def compile_all():
            with compile_monitor.expected():
                if self._fused is not None:
                    forward = self.executables.compile("step", self._fused, args, store_now=False)
                    ready = {("step", t): forward}
                    self._check_fused_in_place(forward, t)
                else:
                    forward = self.executables.compile("forward", self._forward, args, store_now=False)
                    write = self.executables.compile("write", self._write, (args[1], *forward.out_info[2:4]), store_now=False)
                    ready = {("forward", t): forward, ("write", t): write}
                if self._prompt_apart and ("prompt", t) not in self._compiled:
                    hidden = forward.out_info[1]
                    hidden = hidden[0] if isinstance(hidden, tuple) else hidden  # (with what a drafting layer keeps)
                    next_ids = jax.ShapeDtypeStruct((t,), jnp.int32, sharding=hidden.sharding)
                    ready["prompt", t] = self.executables.compile("prompt", self._prompt, (args[0], hidden, next_ids),
                                                                  store_now=False)  # fmt: skip
                for plan in plans if with_sampler else ():
                    name = sampler_name(plan)
                    ready[name, rows] = self.executables.compile(
                        name, self._samplers.jitted(plan), (forward.out_info[0], *sampling, args[3]), store_now=False)
            return ready

        return compile_all

    def _check_fused_in_place(self, executable, bucket: int) -> None:
        """fused_kv_write pays only where XLA writes the donated cache in place: say so where it copies it instead
        (XLA:CPU does, its temporaries as large as the cache)."""
        try:
            temp = executable.memory_analysis().temp_size_in_bytes
        except Exception:  # noqa: BLE001 (a backend without memory analysis)
            return
        cache = self.block_bytes * self.num_blocks  # (not the array itself: a step running beside may have donated it)
        if temp >= cache // 2:
            logger.warning("fused_kv_write: the %d-token step copies the KV cache (%.1f MB of temporaries for a %.1f MB "
                           "cache), so it is slower than a separate write here", bucket, temp / 1e6, cache / 1e6)

    def _executable(self, name: str, jitted, bucket: int, args: tuple) -> jax.stages.Compiled:
        """The compiled `name` for a bucket: compiled (or loaded from disk) on first use, at warm-up unless
        precompile is off. Called directly, a Compiled refuses other shapes instead of compiling them."""
        compiled = self._compiled.get((name, bucket))
        if compiled is None:
            t0 = time.perf_counter()
            pending = self._pending.pop(bucket, None) if name in ("forward", "write", "step", "prompt") else None
            if pending is not None:  # prefetched: wait for the background compile
                self._compiled.update(pending.result())
                compiled = self._compiled[(name, bucket)]
                self._store_executables()
            else:
                self._quiesce()
                lazily = contextlib.nullcontext() if self.config.precompile else compile_monitor.expected()
                with lazily:
                    compiled = self._compiled[(name, bucket)] = self.executables.compile(name, jitted, args)
            self.compile_seconds += time.perf_counter() - t0
        return compiled

    def _store_executables(self) -> None:
        """Store the background compiles' executables, here on the main thread once the steps in flight are done."""
        if self.executables.has_unstored:
            self._quiesce()
            self.executables.store_pending()

    def _quiesce(self) -> None:
        """Wait for the steps in flight before compiling here: storing an executable (serializing it) while another
        runs crashed XLA:CPU now and then (a segfault in serialize_executable, always during warm-up)."""
        if self.executables.directory is None:
            return
        last = self._dispatched.get(self._num_dispatched - 1)
        jax.block_until_ready([self.kv_cache, *(() if last is None else (last.sampled, last.logits, last.out))])

    def warmup(self) -> float:
        """Compile (or load) every bucket now, so serving never compiles; nothing when precompile is off."""
        if not self.config.precompile:
            logger.info("step buckets %s are compiled on first use (precompile off)", self.buckets)
            return 0.0
        t0 = self._warmup_started = time.perf_counter()
        # XLA compiles outside the GIL: the buckets side by side, a thread per two cores (each compile uses more than
        # one; on 2 cores two threads measured no faster than one)
        workers = min(len(self.buckets), (os.cpu_count() or 2) // 2, 8)
        background = self.config.background_compile and self.single_device and self.channel is None and len(self.buckets) > 1
        if background:  # the largest bucket alone (it takes any step), then the decode sizes, largest first
            self._background = ThreadPoolExecutor(max_workers=max(workers, 1), thread_name_prefix="jaxpaged-compile")
            largest = self.buckets[-1]
            self.prefetch(largest)
            # the others start once it is in: compiled beside it, they held up serving (the H100's warm-up took 36 s
            # to its first bucket with seven compiling alongside)
            self._compiled.update(self._pending.pop(largest).result())
            self.ready_buckets = [largest]
            for t in sorted(self.buckets[:-1], key=lambda b: (b > self.config.max_num_seqs, -b)):
                self.prefetch(t)
        elif self.single_device:  # every bucket compiled (and stored) before any runs: see _quiesce
            # one worker: on this thread (XLA:CPU crashed now and then compiling or serializing on a compile thread
            # in long test processes, never here); more: side by side on a pool
            if workers > 1:
                self._background = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jaxpaged-compile")
                for t in self.buckets:
                    self.prefetch(t)
            for t in tqdm(list(self._pending) if workers > 1 else self.buckets, desc="Compiling step buckets",
                          unit="bucket", leave=False, disable=progress_hidden()):  # fmt: skip
                self._compiled.update(self._pending.pop(t).result() if workers > 1 else self._bucket_compiler(t)())
        # a mesh's buckets compile here, on first use; one device's are compiled above, and a step through one of them
        # runs the rest of a step's programs (a 1B model's ten CPU buckets took 4.5 s to run, for nothing)
        for t in self.ready_buckets if not self.single_device else self.ready_buckets[:1]:
            self.execute(self.input_batch.blank(t))
        if self.mm is not None:  # every patch-count bucket of the encoder
            self.mm.warmup()
        self._copy_batch([])  # all padding: compiles the copy as copy() runs it, copies nothing
        if self.state_spec is not None:
            self._copy_state_batch([])
        jax.block_until_ready(self.kv_cache)
        self._store_executables()
        elapsed = time.perf_counter() - t0
        cache = self.executables
        logger.info(
            "step buckets %s ready in %.1fs (%d executables loaded from the cache, %d compiled)%s",
            self.ready_buckets, elapsed, cache.num_loaded, cache.num_compiled,
            f"; compiling {len(self._pending)} more in the background" if self._pending else "",
        )
        return elapsed

"""Which compiled sampler a step runs.

Where a `lax.cond` runs on the device (CPU, TPU), one sampler per row count skips the stages a batch does not use
at run time (sampler.DYNAMIC). On a GPU, XLA runs a cond by copying its predicate to the host and waiting for the
stream to reach it, so the host stalls until the step's forward has run (an H100 trace, docs/benchmarks.md): there
the host picks the step's stages (sampler.plan_for) and runs a sampler compiled for exactly those, with no cond.
Warm-up compiles two per row count, GREEDY (the argmax alone) and FULL (every stage, right for any batch); a step
needing another plan runs FULL while that plan compiles in the background, then its own.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import Future, ThreadPoolExecutor

import jax

from jaxpaged.utils import compile_monitor
from jaxpaged.worker.sampler import DYNAMIC, FULL, GREEDY, SamplerPlan, SamplingMetadata, plan_for

logger = logging.getLogger("jaxpaged.runner")


def sampler_name(plan: SamplerPlan) -> str:
    """The executable's name: its plan is static, so it names the stored executable too."""
    return "sample" if plan == DYNAMIC else f"sample-{plan.name}"


class SamplerPlans:
    """The runner's samplers: one jitted function per plan, compiled per row count through the runner's
    executables (warm-up, disk cache, `_executable`)."""

    def __init__(self, runner, *, static: bool, background: bool, jit_kwargs: dict):
        self.runner = runner
        self.static = static  # plans picked by the host (no cond in a sampler)
        self.background = background  # other plans compiled off the step path (one device, no process group)
        self.warm_plans = (GREEDY, FULL) if static else (DYNAMIC,)
        self._jit_kwargs = jit_kwargs
        self._jitted: dict[SamplerPlan, object] = {}
        self._pending: dict[tuple[str, int], Future] = {}
        self._executor: ThreadPoolExecutor | None = None

    def jitted(self, plan: SamplerPlan):
        if plan not in self._jitted:
            self._jitted[plan] = jax.jit(functools.partial(self.runner._sample_impl, plan=plan), **self._jit_kwargs)
        return self._jitted[plan]

    def plan(self, sampling: SamplingMetadata, suppress: bool, bias: bool) -> SamplerPlan:
        """The stages this step's rows need (DYNAMIC where the device decides)."""
        return plan_for(sampling, suppress=suppress, bias=bias) if self.static else DYNAMIC

    def executable(self, rows: int, plan: SamplerPlan, args: tuple) -> jax.stages.Compiled:
        """The compiled sampler for `plan` at `rows` rows, or FULL's while `plan`'s compiles in the background."""
        runner, key = self.runner, (sampler_name(plan), rows)
        compiled = runner._compiled.get(key)
        if compiled is not None:
            return compiled
        if plan in self.warm_plans:  # compiled at warm-up (or now, on first use, with precompile off)
            return runner._executable(key[0], self.jitted(plan), rows, args)
        if self.background:
            future = self._pending.get(key)
            if future is None:
                self._pending[key] = self._compile_later(plan, args)
            elif future.done():
                return self._take(key)
        return runner._executable(sampler_name(FULL), self.jitted(FULL), rows, args)

    def finish(self) -> None:
        """Wait for the plans compiling in the background and take them in (benchmarks, tests)."""
        for key in list(self._pending):
            self._pending[key].exception()
            self._take(key)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile_later(self, plan: SamplerPlan, args: tuple) -> Future:
        from jaxpaged.worker.bucket_compiles import abstract as _abstract

        abstract = jax.tree_util.tree_map(_abstract, args)
        jitted, executables = self.jitted(plan), self.runner.executables
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxpaged-sampler")
        logger.info("compiling the sampler for plan %s at %d rows in the background", plan.name, args[0].shape[0])

        def compile_plan():
            with compile_monitor.expected():
                return executables.compile(sampler_name(plan), jitted, abstract, store_now=False)

        return self._executor.submit(compile_plan)

    def _take(self, key: tuple[str, int]) -> jax.stages.Compiled:
        """A finished background compile into the runner's executables (FULL's instead if it failed)."""
        runner, future = self.runner, self._pending.pop(key)
        try:
            runner._compiled[key] = future.result()
            runner._store_executables()
        except Exception as exc:  # noqa: BLE001 - FULL serves every batch: keep serving, say why once
            logger.warning("the sampler for %s could not be compiled (%s); its steps keep the full sampler", key, exc)
            runner._compiled[key] = runner._compiled[(sampler_name(FULL), key[1])]
        return runner._compiled[key]

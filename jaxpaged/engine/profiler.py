"""start_profile / stop_profile (vLLM's, whose torch profiler writes under VLLM_TORCH_PROFILER_DIR): a JAX profiler
trace of everything this process runs meanwhile (host threads and device kernels), written under
EngineConfig.profiler_dir for TensorBoard's profile plugin or XProf (`<dir>[/<prefix>]/plugins/profile/<run>/`).

JAX's profiler is one per process, so an engine holds one Profiler whatever its replicas.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

logger = logging.getLogger("jaxpaged.engine")
_PLAIN = re.compile(r"[A-Za-z0-9._-]+")


class ProfilerError(RuntimeError):
    """A profile cannot start or stop now: no profiler_dir, one already running, or none to stop."""


class Profiler:
    def __init__(self, directory: str | None):
        self.directory = None if directory is None else Path(directory).expanduser()
        self.log_dir: Path | None = None  # the running trace's, while one runs

    @property
    def running(self) -> bool:
        return self.log_dir is not None

    def start(self, profile_prefix: str | None = None) -> str:
        """Start tracing into profiler_dir (or its profile_prefix subfolder); -> that folder."""
        import jax

        if self.directory is None:
            raise ProfilerError("start_profile needs profiler_dir (--profiler-dir): the folder traces are written to")
        if profile_prefix is not None and (not isinstance(profile_prefix, str) or not _PLAIN.fullmatch(profile_prefix)
                                           or profile_prefix in (".", "..")):  # fmt: skip
            raise ValueError(f"profile_prefix must be a plain name (letters, digits, '.', '_', '-'), a subfolder of "
                             f"profiler_dir (got {profile_prefix!r})")  # fmt: skip
        if self.running:
            raise ProfilerError(f"a profile is already running (into {self.log_dir}): call stop_profile() first")
        log_dir = self.directory / profile_prefix if profile_prefix else self.directory
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            jax.profiler.start_trace(str(log_dir))
        except RuntimeError as exc:  # someone else's trace (jax.profiler.start_trace outside the engine)
            raise ProfilerError(f"start_profile: JAX's profiler would not start: {exc}") from exc
        self.log_dir = log_dir
        logger.info("profiling into %s", log_dir)
        return str(log_dir)

    def stop(self) -> str:
        """Stop and write the trace; -> the folder of this run's trace files."""
        import jax

        if not self.running:
            raise ProfilerError("stop_profile: no profile is running (start_profile() first)")
        log_dir, self.log_dir = self.log_dir, None
        jax.profiler.stop_trace()
        runs = sorted((log_dir / "plugins" / "profile").glob("*"), key=lambda p: p.stat().st_mtime)
        where = str(runs[-1]) if runs else str(log_dir)
        logger.info("profile written to %s", where)
        return where

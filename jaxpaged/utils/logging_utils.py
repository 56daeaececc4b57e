"""One place that decides what the user sees on stderr."""

from __future__ import annotations

import logging
import sys


class _DropNotices(logging.Filter):
    """Library notices that do not apply to jaxpaged: transformers says it found no PyTorch, which we never use."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "PyTorch was not found" not in record.getMessage()


_DROP_NOTICES = _DropNotices()


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is now, not as it was at set-up: notebooks and test runners replace it."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def progress_hidden() -> bool:
    """Progress bars (loading, compiling) follow jaxpaged's log level: hidden above INFO (--quiet, log_level="WARNING")."""
    return logging.getLogger("jaxpaged").getEffectiveLevel() > logging.INFO


def setup_logging(level: int | str = logging.INFO) -> None:
    """Our loggers at `level` on stderr; libraries' chatter (absl, orbax, jax) at WARNING, and their notices
    that a user can do nothing about hidden unless `level` is DEBUG."""
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("jaxpaged")
    root.handlers[:] = [h for h in root.handlers if not isinstance(h, _StderrHandler)] + [handler]  # keep the user's
    root.setLevel(level)
    root.propagate = False
    transformers_logger = logging.getLogger("transformers")  # before transformers is imported, so its first notice too
    transformers_logger.removeFilter(_DROP_NOTICES)
    if root.getEffectiveLevel() > logging.DEBUG:
        transformers_logger.addFilter(_DROP_NOTICES)
    for noisy in ("absl", "jax", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)
    except ImportError:
        pass

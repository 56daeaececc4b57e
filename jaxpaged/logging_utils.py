"""One place that decides what the user sees on stderr."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: int | str = logging.INFO) -> None:
    """Our loggers at `level` on stderr; libraries' chatter (absl, orbax, jax) at WARNING."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("jaxpaged")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    for noisy in ("absl", "jax", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)
    except ImportError:
        pass

"""jaxpaged as an RL trainer's rollout engine: Tunix's rollout interface (`JaxpagedRollout`, the `rl` extra) over the
engine's update_weights, sleep and get_per_token_logps (docs/rl.md)."""

from __future__ import annotations


def __getattr__(name: str):
    if name == "JaxpagedRollout":  # imports Tunix: only when asked for
        from jaxpaged.rl.tunix_rollout import JaxpagedRollout

        return JaxpagedRollout
    raise AttributeError(name)


__all__ = ["JaxpagedRollout"]

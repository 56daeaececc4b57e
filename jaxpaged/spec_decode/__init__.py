"""Speculative decoding: proposers guess k tokens per sequence, the target verifies them in one step (docs/speculative_decoding.md)."""

from jaxpaged.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]

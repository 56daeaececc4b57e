"""Length-dependent RoPE (longrope, dynamic NTK) decided per sequence, as transformers' generation decides it.

transformers picks a forward's frequencies from that forward's length (its largest position + 1). Its Phi-3
generation (longrope) runs a prompt in one forward and, when a sequence first grows past
original_max_position_embeddings, drops its cache and recomputes every position with the long factors: its KV is
always wholly in the regime of the sequence's current length. Dynamic NTK models keep their cache: a prompt's keys
use the prompt's length, each later token its own.

jaxpaged follows both exactly, with the compiled step unchanged (both frequency sets are computed and selected):
- each token decides from max(its position + 1, its row's RoPE length) (`row_lengths`, the runner's
  AttentionMetadata.rope_lens): longrope's is the sequence's token count at scheduling, so every chunk of a long
  prompt and a recompute after preemption use the whole sequence's regime; dynamic's is the prompt's length, so a
  recompute gives every key the length it was first computed at;
- `key` names the regime a sequence's KV is computed in and roots its prefix-cache hashes (Request.block_hashes),
  so a block is shared only within one regime;
- longrope's `recompute_past` (the switch): a running sequence whose KV was computed in the short regime (an empty
  key) and whose length passes it is recomputed by the scheduler, as transformers does.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class LengthDependentRope:
    rope_type: str  # "longrope" or "dynamic"
    switch: int  # longrope: original_max_position_embeddings; dynamic: max_position_embeddings

    def __post_init__(self):
        if self.rope_type not in ("longrope", "dynamic"):
            raise ValueError(f"{self.rope_type!r} RoPE does not depend on the sequence's length")

    @property
    def recompute_past(self) -> int:
        """Past this token count a sequence computed in the short regime is recomputed (0: never, dynamic)."""
        return self.switch if self.rope_type == "longrope" else 0

    def key(self, num_tokens: int, prompt_len: int) -> bytes:
        """The regime of a KV computed from scratch now; b"" for the unscaled (short) one, as other models have."""
        if self.rope_type == "longrope":
            return b"rope:long" if num_tokens > self.switch else b""
        return b"rope:prompt=%d" % prompt_len if prompt_len > self.switch else b""

    def row_lengths(self, prompt_lens: np.ndarray, num_outputs: np.ndarray) -> np.ndarray:
        """[rows] each step row's RoPE length, from its sequence's prompt length and output count at scheduling."""
        return prompt_lens + num_outputs if self.rope_type == "longrope" else prompt_lens

    @staticmethod
    def of(rope) -> LengthDependentRope | None:
        """A model's (its ModelConfig.rope), or None where the frequencies do not depend on the length."""
        if rope.rope_type == "longrope":
            return LengthDependentRope("longrope", rope.original_max_position_embeddings)
        if rope.rope_type == "dynamic":
            return LengthDependentRope("dynamic", rope.max_position_embeddings)
        return None

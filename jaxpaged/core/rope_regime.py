"""Length-dependent RoPE (longrope, dynamic NTK) decided per sequence, as transformers' generation decides it.

transformers picks a forward's frequencies from that forward's length (its largest position + 1), and its generic
generation keeps the cache: a prompt's keys use the prompt's length, each later token its own length. Its Phi-3
generation (longrope) differs: when a sequence first grows past original_max_position_embeddings it drops its cache
and recomputes every position with the long factors, so its KV is always wholly in the regime of the sequence's
current length.

jaxpaged follows both exactly, with the compiled step unchanged (both frequency sets are computed and selected):
- each token decides from max(its position + 1, its row's RoPE length) (`row_lengths`, the runner's
  AttentionMetadata.rope_lens): the prompt's length where the cache is kept, so a chunked prompt or a recompute
  after preemption gives every key the length transformers computed it at; where it is recomputed (Phi-3), the
  sequence's token count at scheduling, the regime of its whole length;
- `key` names the regime a sequence's KV is computed in and roots its prefix-cache hashes (Request.block_hashes),
  so a block is shared only by sequences whose keys at its positions are the same;
- `recompute_past` (Phi-3's switch): a running sequence whose KV is in the short regime (an empty key) and whose
  length passes it is recomputed by the scheduler.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# transformers' generation of these drops the cache and recomputes when a sequence first passes longrope's switch
# (Phi3ForCausalLM.prepare_inputs_for_generation); other models keep their keys
RECOMPUTING_ARCHITECTURES = ("Phi3ForCausalLM",)


@dataclasses.dataclass(frozen=True)
class LengthDependentRope:
    rope_type: str  # "longrope" or "dynamic"
    switch: int  # longrope: original_max_position_embeddings; dynamic: max_position_embeddings
    recomputes: bool = False  # longrope: recompute a short-regime sequence growing past the switch (Phi-3)

    def __post_init__(self):
        if self.rope_type not in ("longrope", "dynamic") or (self.recomputes and self.rope_type != "longrope"):
            raise ValueError(f"no length-dependent RoPE rule for {self.rope_type!r} (recomputes={self.recomputes})")

    @property
    def recompute_past(self) -> int:
        """Past this token count a sequence computed in the short regime is recomputed (0: never)."""
        return self.switch if self.recomputes else 0

    def key(self, num_tokens: int, prompt_len: int) -> bytes:
        """The regime of a KV computed from scratch now; b"" where its keys depend on their positions alone."""
        if self.rope_type == "dynamic":  # past the switch, a prompt's keys use its own length
            return b"rope:prompt=%d" % prompt_len if prompt_len > self.switch else b""
        return b"rope:long" if (num_tokens if self.recomputes else prompt_len) > self.switch else b""

    def row_lengths(self, prompt_lens: np.ndarray, num_outputs: np.ndarray) -> np.ndarray:
        """[rows] each step row's RoPE length, from its sequence's prompt length and output count at scheduling."""
        return prompt_lens + num_outputs if self.recomputes else prompt_lens

    @staticmethod
    def of(model_config) -> LengthDependentRope | None:
        """A model's (its ModelConfig), or None where the frequencies do not depend on the length."""
        rope = model_config.rope
        if rope.rope_type == "longrope":
            recomputes = model_config.architecture in RECOMPUTING_ARCHITECTURES
            return LengthDependentRope("longrope", rope.original_max_position_embeddings, recomputes)
        if rope.rope_type == "dynamic":
            return LengthDependentRope("dynamic", rope.max_position_embeddings)
        return None

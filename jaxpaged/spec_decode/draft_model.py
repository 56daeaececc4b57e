"""The `draft_model` proposer: a smaller model with the target's vocabulary guesses k tokens per sequence.

The draft runs on its own ModelRunner (the engine's, with its own weights, KV pool and compiled buckets) and its own
KVCacheManager (block tables by sequence id). A call first catches each sequence up on the tokens the draft has not
seen (its prompt, accepted guesses, the target's corrections), in ragged steps of at most max_num_batched_tokens;
the last of those tokens gives the first guess, and k - 1 one-token steps give the rest, each fed the previous
guess on the device (prev_rows), so the host waits once per call, not once per guess. Every step has one of the
runner's bucketed shapes, all compiled at warm-up.

Guesses are the draft's greedy argmax, a deterministic function of the prefix: a point mass q = 1 on its token,
which is what the verifier (rejection_sampler.py) is exact for, so sampled output keeps the target's distribution
without the draft's probabilities (vLLM verifies with them; a greedy draft is the simpler exact choice, and
accepts less often than a sampled one only where the target samples at a high temperature).

Rollback costs nothing: positions written from guesses the target rejected are simply written again at the next
catch-up, which starts at the first position whose token the draft did not see (the guesses it fed are compared
with the sequence's real tokens).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence

import numpy as np

from jaxpaged.config import EngineConfig
from jaxpaged.core.block_pool import BlockPool
from jaxpaged.core.kv_cache_manager import KVCacheManager, freeing_window, slot_mapping
from jaxpaged.models.loader import LoadedModel, load_model
from jaxpaged.pallas_kernels import AttentionMetadata
from jaxpaged.spec_decode.config import SpeculativeConfig
from jaxpaged.worker.model_runner import ModelRunner
from jaxpaged.worker.step_output import DispatchedStep
from jaxpaged.worker.input_batch import StepInputs

logger = logging.getLogger("jaxpaged.spec_decode")


@dataclasses.dataclass
class _DraftSeq:
    """What the draft's KV holds for one sequence: its first `start` tokens, then the guesses `fed` after them
    (right only as far as they match the tokens the sequence went on to have)."""

    start: int = 0
    fed: list[int] = dataclasses.field(default_factory=list)

    def known(self, tokens: Sequence[int]) -> int:
        n = 0
        for guess, token in zip(self.fed, tokens[self.start : self.start + len(self.fed)]):
            if guess != token:
                break
            n += 1
        return self.start + n


@dataclasses.dataclass
class _Row:
    """One sequence's tokens in a draft step: positions [start, start + count), from the host or (prev_row >= 0)
    from the previous step's sampled row."""

    seq_id: str
    start: int
    count: int
    ids: Sequence[int] = ()
    prev_row: int = -1


def draft_pool_blocks(config: EngineConfig, spec: SpeculativeConfig, max_model_len: int) -> int:
    """Enough for every sequence that can hold draft state at once to reach max_model_len: the draft proposes only
    while fewer than disable_by_batch_size sequences run, and lets go of each as it stops running."""
    seqs = min(config.max_num_seqs, spec.disable_by_batch_size - 1)
    return max(1, seqs) * -(-max_model_len // config.block_size)


def load_draft(config: EngineConfig, spec: SpeculativeConfig, target: LoadedModel, max_model_len: int, platform) -> LoadedModel:
    """The draft's weights, with the engine's dtype and platform; a ValueError naming speculative_config.model when
    its vocabulary differs from the target's or its context is shorter than max_model_len."""
    draft = load_model(
        spec.model, dtype=config.dtype, attention_backend=config.attention_backend, cache_dir=config.cache_dir,
        batch_invariant=config.batch_invariant, platform=platform,
    )  # fmt: skip
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of {draft.config.vocab_size} tokens, "
                         f"the target's has {target.config.vocab_size}: a draft must share the target's vocabulary")  # fmt: skip
    if hasattr(draft.model, "state_spec"):  # its proposer keeps KV blocks only: no state to roll back
        raise ValueError(f"speculative_config.model {spec.model!r} is a hybrid model ({draft.config.architecture}, linear "
                         "layers with a state per sequence): not supported as a draft")  # fmt: skip
    if draft.config.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model {spec.model!r} has a context of {draft.config.max_position_embeddings} "
                         f"tokens, shorter than max_model_len ({max_model_len}); lower max_model_len")  # fmt: skip
    return draft


class DraftModelProposer:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, spec: SpeculativeConfig, max_model_len: int, *,
                 devices=None, executable_dir=None):  # fmt: skip
        num_blocks = draft_pool_blocks(config, spec, max_model_len)
        draft_config = dataclasses.replace(
            config, model=spec.model, revision=None, quantization=None, quantize_activations=False,
            num_kv_blocks=num_blocks, enable_lora=False, speculative_config=None, disable_hybrid_kv_cache_manager=True,
        )  # fmt: skip  # one table per sequence (self.kv): a hybrid draft keeps every block, its window a mask
        self.runner = ModelRunner(loaded, draft_config, max_model_len, executable_dir=executable_dir, devices=devices)
        self.block_size = config.block_size
        self.max_step_tokens = config.max_num_batched_tokens
        window = freeing_window(loaded.config.sliding_windows)
        self.kv = KVCacheManager(BlockPool(num_blocks, enable_caching=False), config.block_size, window)
        self.seqs: dict[str, _DraftSeq] = {}
        self._greedy = {}  # rows S -> all-greedy sampling metadata (padding rows are greedy)
        self._fetched: dict[int, np.ndarray] = {}  # within a call: a draft step's sampled tokens, read back once
        logger.info("draft model %s: %s", spec.model, self.runner.memory_plan())

    @classmethod
    def load(cls, config: EngineConfig, spec: SpeculativeConfig, target: LoadedModel, max_model_len: int, platform,
             devices=None, executable_dir=None) -> DraftModelProposer:  # fmt: skip
        return cls(load_draft(config, spec, target, max_model_len, platform), config, spec, max_model_len,
                   devices=devices, executable_dir=executable_dir)  # fmt: skip

    def warmup(self) -> float:
        return self.runner.warmup()

    @property
    def held(self) -> Iterable[str]:
        return self.seqs.keys()

    def release(self, seq_ids: Iterable[str]) -> None:
        """Sequences that stopped running (finished, aborted, preempted): their draft blocks go back."""
        for seq_id in list(seq_ids):
            self.seqs.pop(seq_id, None)
            self.kv.free(seq_id)
        self.kv.take_changed()

    def stats(self) -> dict:
        pool = self.kv.pool
        return {"spec_decode_draft_blocks_total": pool.num_blocks, "spec_decode_draft_blocks_used": pool.num_used}

    # -- proposing ----------------------------------------------------------------------------

    def propose(self, tokens: Sequence[Sequence[int]], ks: Sequence[int], seq_ids: Sequence[str]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in tokens]
        live, known = [], {}
        for i, (toks, k, seq_id) in enumerate(zip(tokens, ks, seq_ids)):
            seq = self.seqs.setdefault(seq_id, _DraftSeq())
            start = min(seq.known(toks), len(toks) - 1)  # the last token is always fed: its logits give guess 1
            if self.kv.allocate_slots(seq_id, start, len(toks) + k - 1 - start):  # guess j is fed at len + j - 1
                live.append(i)
                known[i] = start
            # else: the pool is full (it is sized not to be); this sequence goes without guesses this step
        self.kv.take_changed()
        if not live:
            return out
        first = self._catch_up(tokens, seq_ids, live, known)  # i -> (step, row) that sampled guess 1
        steps = [first]  # per guess j: i -> (step, row) that sampled it
        for j in range(1, max(ks[i] for i in live)):
            prev = steps[-1]
            last = max((step for step, _ in prev.values()), key=lambda s: s.seq)  # rows of other steps: via the host
            rows = []
            for i in live:
                if ks[i] > j:
                    step, row = prev[i]
                    on_device = step is last
                    ids = () if on_device else [int(self._tokens(step)[row])]
                    rows.append((i, _Row(seq_ids[i], len(tokens[i]) + j - 1, 1, ids, row if on_device else -1)))
            dispatched = self.runner.dispatch(self._inputs([r for _, r in rows]), prev=last)
            steps.append({i: (dispatched, r) for r, (i, _) in enumerate(rows)})
        for i in live:
            guesses = [int(self._tokens(s[i][0])[s[i][1]]) for s in steps if i in s]
            out[i] = guesses
            self.seqs[seq_ids[i]] = _DraftSeq(len(tokens[i]), guesses[:-1])  # the last guess is never fed
        self._fetched.clear()
        return out

    def _catch_up(self, tokens, seq_ids, live: list[int], known: dict[int, int]) -> dict[int, tuple[DispatchedStep, int]]:
        """Feed each sequence its unseen tokens, in steps of at most max_num_batched_tokens; -> where each
        sequence's first guess was sampled (the step with its last token)."""
        pos = dict(known)
        first = {}
        while True:
            budget, rows = self.max_step_tokens, []
            for i in live:
                n = min(len(tokens[i]) - pos[i], budget)
                if n > 0:
                    rows.append((i, _Row(seq_ids[i], pos[i], n, tokens[i][pos[i] : pos[i] + n])))
                    budget -= n
                    pos[i] += n
                if budget == 0:
                    break
            if not rows:
                return first
            dispatched = self.runner.dispatch(self._inputs([r for _, r in rows]))
            for r, (i, row) in enumerate(rows):
                if row.start + row.count == len(tokens[i]):
                    first[i] = (dispatched, r)

    def _tokens(self, step: DispatchedStep) -> np.ndarray:
        """A draft step's sampled tokens on the host (read once)."""
        if step.seq not in self._fetched:
            self._fetched[step.seq] = step.fetch().tokens
        return self._fetched[step.seq]

    def _inputs(self, rows: list[_Row]) -> StepInputs:
        """A draft step as the runner's padded inputs: each row's tokens, its table's slots, logits at its last token."""
        total = sum(r.count for r in rows)
        t, s = self.runner.bucket_for(total)
        ids, positions = np.zeros(t, np.int32), np.zeros(t, np.int32)
        slots = np.full(t, -1, np.int32)
        tables = np.zeros((s, self.runner.table_width), np.int32)
        seq_lens = np.zeros(s, np.int32)
        query_start_loc = np.full(s + 1, total, np.int32)
        query_start_loc[0] = 0
        logit_rows = np.zeros(s, np.int32)
        prev_rows = None
        cursor = 0
        for r, row in enumerate(rows):
            table = self.kv.block_table(row.seq_id)
            tables[r, : len(table)] = table
            end = cursor + row.count
            positions[cursor:end] = np.arange(row.start, row.start + row.count)
            slots[cursor:end] = slot_mapping(table, row.start, row.count, self.block_size)
            if row.prev_row >= 0:
                prev_rows = np.full(t, -1, np.int32) if prev_rows is None else prev_rows
                prev_rows[cursor] = row.prev_row
            else:
                ids[cursor:end] = row.ids
            seq_lens[r] = row.start + row.count
            query_start_loc[r + 1] = end
            logit_rows[r] = end - 1
            cursor = end
        if s not in self._greedy:
            self._greedy[s] = self.runner.input_batch.blank(t).sampling
        # a draft with length-dependent RoPE (core/rope_regime.py) gets each row's length, as the runner's steps do
        rope_lens = None if self.runner.input_batch.rope is None else seq_lens.copy()
        attention = AttentionMetadata(slots, tables, seq_lens, query_start_loc, rope_lens)
        return StepInputs(ids, positions, attention, logit_rows, self._greedy[s], prev_rows=prev_rows)

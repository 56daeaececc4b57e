"""The engine's side of speculative decoding: who speculates, the proposals handed to the scheduler, and a verified
step's results taken one token at a time, so stops, detokenizing and outputs behave exactly as without it.

A step with proposals is never overlapped (async scheduling): proposing needs the sequences' tokens on the host,
and the step's accepted count decides where the next one starts. Each verifying row is sampled as if the proposals before
it were already output: its penalties' history, min_tokens suppression and grammar mask include them, so logprobs,
penalties, min_tokens and structured outputs give what they give without speculation; a grammar also cuts a
proposal at its first token it refuses. Beams do not speculate (the host picks them from each step's candidates).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxpaged.core.request import PLACEHOLDER, Request
from jaxpaged.core.rope_regime import LengthDependentRope
from jaxpaged.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from jaxpaged.spec_decode.config import SpeculativeConfig
from jaxpaged.spec_decode.proposer import NgramProposer, Proposer


def may_speculate(req: Request) -> bool:
    """Any sequence but a beam."""
    return not req.is_beam


def can_speculate(req: Request) -> bool:
    """Such a sequence decoding now, its tokens all on the host."""
    return req.num_in_flight == 0 and req.num_computed_tokens == req.num_tokens - 1 and req.hold_at is None and may_speculate(req)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None,
                 rope: LengthDependentRope | None = None, states=None):  # fmt: skip
        self.config = config
        # a hybrid model's HybridKVCacheManager: a rejected guess restores the linear layers' state (core/state_slots.py)
        self.states = states
        self.num_restored = 0  # verifying rows restored so (their kept tokens computed again)
        self.max_model_len = max_model_len
        # longrope: a sequence in the short regime verifies no position past the switch, where it is recomputed
        self.rope_switch = rope.recompute_past if rope is not None else 0
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.num_spec_steps = 0  # steps that verified some proposal
        self.num_drafts = 0  # sequences' proposals verified (one per sequence per step)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_at = np.zeros(config.num_speculative_tokens, np.int64)  # accepted proposals by position

    def active(self, scheduler: Scheduler) -> bool:
        """Speculation pays only for small batches (vLLM's disable_by_batch_size)."""
        return 0 < len(scheduler.running) < self.config.disable_by_batch_size

    def may_propose(self, scheduler: Scheduler) -> bool:
        """Whether the next step may speculate: then it is formed after this one's tokens are read."""
        return self.active(scheduler) and any(may_speculate(req) for req in scheduler.running)

    def propose(self, scheduler: Scheduler) -> None:
        """Proposals for the running sequences that may speculate, into scheduler.draft_tokens."""
        if not self.active(scheduler):
            return
        k = self.config.num_speculative_tokens
        reqs, ks = [], []
        for req in scheduler.running:
            if can_speculate(req):  # no proposal past max_tokens, nor a position past max_model_len
                room = min(k, req.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - req.num_tokens)
                if self.rope_switch and not req.rope_key:
                    room = min(room, self.rope_switch - req.num_tokens)
                if room > 0:
                    reqs.append(req)
                    ks.append(room)
        if not reqs:
            return
        proposals = self.proposer.propose([req.prompt_token_ids + req.output_token_ids for req in reqs], ks,
                                          [req.seq_id for req in reqs])
        for i, (req, proposal) in enumerate(zip(reqs, proposals)):
            if proposal and req.grammar is not None:  # verify only what the grammar allows
                proposals[i] = proposal[: req.grammar.valid_prefix(proposal)]
        scheduler.draft_tokens = {req: p for req, p in zip(reqs, proposals) if p}

    def release_stopped(self, scheduler: Scheduler) -> None:
        """The proposer lets go of sequences no longer running (finished, aborted or preempted): a draft model's
        KV blocks go back at once. Called after every update and abort."""
        held = self.proposer.held
        if held:
            running = {req.seq_id for req in scheduler.running}
            gone = [seq_id for seq_id in held if seq_id not in running]
            if gone:
                self.proposer.release(gone)

    @staticmethod
    def verifies(output: SchedulerOutput) -> bool:
        return any(item.draft_token_ids for item in output.scheduled)

    def take(self, output: SchedulerOutput, tokens: np.ndarray, update: Callable[[SchedulerOutput], list]) -> list:
        """A verifying step's results: each sequence keeps its accepted proposals and the token after them, its
        rejected positions rolled back (their KV slots are rewritten later, never read or registered), then the
        step is taken as one ordinary update per emitted position, the sequence's row moved to that position's (its
        token, logprobs). Returns the outputs (the last per request)."""
        tokens = np.asarray(tokens)
        emitted: list[tuple[ScheduledSequence, list[int]]] = []
        self.num_spec_steps += 1
        for item in output.scheduled:
            drafts = item.draft_token_ids
            if not drafts or item.request.finished:
                continue
            k = len(drafts)
            rows = tokens[item.row : item.row + k + 1]
            match = rows[:k] == np.asarray(drafts)
            accepted = k if match.all() else int(np.argmin(match))
            emitted.append((item, rows[: accepted + 1].tolist()))
            item.request.num_computed_tokens -= k - accepted
            if self.states is not None:  # the state before the row where a guess failed; its tokens run again
                self.states.settle(item.request.seq_id, restore=accepted < k)
                if accepted < k:
                    item.request.num_computed_tokens = item.start
                    self.num_restored += 1
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += accepted
            self.accepted_at[:accepted] += 1
        outputs = list(update(output))
        for j in range(1, 1 + max((len(ids) for _, ids in emitted), default=1)):
            step = []
            for item, ids in emitted:
                req = item.request
                if len(ids) <= j or req.finished:
                    continue
                sub = ScheduledSequence(req, req.num_computed_tokens, 0)
                sub.samples, sub.row = True, item.row + j
                req.output_token_ids.append(PLACEHOLDER)
                req.num_in_flight += 1
                step.append(sub)
            if not step:
                break
            outputs.extend(update(SchedulerOutput(step, [])))
        last = {out.request_id: out for out in outputs}
        return list(last.values())

    def stats(self) -> dict:
        drafts = max(self.num_drafts, 1)
        return {
            "spec_decode_num_steps": self.num_spec_steps,
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
            "spec_decode_mean_accepted_length": 1 + self.num_accepted_tokens / drafts,  # tokens per verifying row
            "spec_decode_proposals_per_step": self.num_drafts / max(self.num_spec_steps, 1),
            "spec_decode_accepted_per_position": self.accepted_at.tolist(),
            **({"spec_decode_num_restored": self.num_restored} if self.states is not None else {}),
            **(self.proposer.stats() if hasattr(self.proposer, "stats") else {}),
        }

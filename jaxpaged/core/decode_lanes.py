"""Decoding sequences as rows of per-slot arrays: a plain decode step advances them all in numpy (issue 33).

At 1,024 decoding sequences a scheduler-only loop spent 1.2 ms a step in Python touching each Request (its
counters, its output list) to schedule it and 0.5 ms to take its token. A sequence whose outputs are read only when it ends (`Request.quiet`),
with plain sampling and nothing held, joins the lanes once it decodes: from then on its computed-token count,
in-flight count, last sampled row and newest output tokens live here, indexed by its scheduler slot, and the
scheduler advances and fills whole lanes at once. Everything else reads the Request as before: its four lane-backed
fields (request.py) read the counts from here, and its output list or any write calls `release` first, which writes
the arrays back into the object and takes it out. A sequence leaves whenever a row of it needs per-row work (it may
stop, it is preempted or finishes) and comes back once it decodes plainly again; a block it fills is hashed and
registered from here without leaving, and its known tokens move to its list once in `width` steps.
"""

from __future__ import annotations

import numpy as np

from jaxpaged.core.request import PLACEHOLDER, Request


class DecodeLanes:
    def __init__(self, num_slots: int, width: int):
        self.width = width  # output tokens a lane holds beyond its request's list, until flushed into it
        self.member = np.zeros(num_slots, bool)
        self.requests: list[Request | None] = [None] * num_slots
        i64 = np.int64
        self.computed = np.zeros(num_slots, i64)
        self.num_outputs = np.zeros(num_slots, i64)  # output tokens, in-flight PLACEHOLDERs included
        self.listed = np.zeros(num_slots, i64)  # of those, the ones in the request's list; the rest are in `pending`
        self.pending = np.full((num_slots, width), PLACEHOLDER, i64)
        self.in_flight = np.zeros(num_slots, i64)
        self.sampled_row = np.full(num_slots, -1, i64)
        self.last_token = np.zeros(num_slots, i64)  # its newest known token: a step's input when none is in flight
        self.num_prompt = np.zeros(num_slots, i64)
        self.max_tokens = np.zeros(num_slots, i64)
        self.capacity = np.zeros(num_slots, i64)  # tokens its blocks hold (the KV cache manager's `writable`)
        self.count = 0

    def enter(self, reqs: list[Request], capacities: list[int]) -> None:
        """From the Requests into the arrays: each list keeps its known tokens, the in-flight ones move here."""
        slots, computed, num_outputs, listed, in_flight, rows, last, num_prompt, max_tokens = ([] for _ in range(9))
        for req in reqs:
            outputs, flying = req._output_token_ids, req._num_in_flight
            known = len(outputs) - flying
            slots.append(req.slot)
            computed.append(req._num_computed_tokens)
            num_outputs.append(len(outputs))
            listed.append(known)
            in_flight.append(flying)
            rows.append(req._sampled_row)
            last.append(outputs[known - 1] if known else req.prompt_token_ids[-1])
            num_prompt.append(len(req.prompt_token_ids))
            max_tokens.append(req.max_tokens)
            del outputs[known:]
            self.requests[req.slot] = req
            req._lanes = self
        self.pending[slots] = PLACEHOLDER
        self.computed[slots], self.num_outputs[slots], self.listed[slots] = computed, num_outputs, listed
        self.in_flight[slots], self.sampled_row[slots], self.last_token[slots] = in_flight, rows, last
        self.num_prompt[slots], self.max_tokens[slots], self.capacity[slots] = num_prompt, max_tokens, capacities
        self.member[slots] = True
        self.count += len(slots)

    def release(self, req: Request) -> None:
        """From the arrays back into the Request, which leaves the lanes."""
        self.release_slots(np.array([req.slot]))

    def release_slots(self, slots: np.ndarray) -> None:
        """release, for the sequences in `slots` at once."""
        if not len(slots):
            return
        extra = (self.num_outputs[slots] - self.listed[slots]).tolist()
        pending, computed = self.pending[slots].tolist(), self.computed[slots].tolist()
        in_flight, rows = self.in_flight[slots].tolist(), self.sampled_row[slots].tolist()
        self.member[slots] = False
        self.count -= len(slots)
        requests = self.requests
        for slot, n, tokens, c, f, r in zip(slots.tolist(), extra, pending, computed, in_flight, rows):
            req = requests[slot]
            requests[slot] = None
            req._lanes = None
            if n:
                req._output_token_ids.extend(tokens[:n])
            req._num_computed_tokens, req._num_in_flight, req._sampled_row = c, f, r

    def tokens_at(self, req: Request, start: int, count: int) -> list[int]:
        """(prompt + outputs)[start:start + count] of a member, all known: from its list and the lane."""
        prompt, listed = req.prompt_token_ids, req._output_token_ids
        lo, hi = start - len(prompt), start + count - len(prompt)  # as output indices
        tokens = prompt[start : start + count] if lo < 0 else []
        tokens += listed[max(lo, 0) : hi]
        if hi > len(listed):
            tokens += self.pending[req.slot, max(lo, len(listed)) - len(listed) : hi - len(listed)].tolist()
        return tokens

    def flush(self, slots: np.ndarray) -> None:
        """Their known tokens into their lists (the in-flight ones, always the newest, stay here): room in the lane."""
        known = self.num_outputs[slots] - self.in_flight[slots] - self.listed[slots]
        moving = known > 0
        if not moving.any():
            return
        slots, known = slots[moving], known[moving]
        rows = self.pending[slots]
        requests = self.requests
        for slot, tokens, n in zip(slots.tolist(), rows.tolist(), known.tolist()):
            requests[slot]._output_token_ids.extend(tokens[:n])
        shift = np.minimum(np.arange(self.width) + known[:, None], self.width - 1)
        self.pending[slots] = np.take_along_axis(rows, shift, axis=1)  # (what moved past the end is never read)
        self.listed[slots] += known

    def advance(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A decode row for each of `slots` (in row order): each gets one token computed and one more to sample,
        in flight. -> (first position fed, output count before, previous step's row of its input or -1)."""
        starts = self.computed[slots]
        num_outputs = self.num_outputs[slots]
        prev = np.where(self.in_flight[slots] > 0, self.sampled_row[slots], -1)
        self.pending[slots, num_outputs - self.listed[slots]] = PLACEHOLDER
        self.computed[slots] = starts + 1
        self.num_outputs[slots] = num_outputs + 1
        self.in_flight[slots] += 1
        self.sampled_row[slots] = np.arange(len(slots))
        return starts, num_outputs, prev

    def take(self, slots: np.ndarray, num_outputs: np.ndarray, tokens: np.ndarray) -> None:
        """Sampled tokens in: output `num_outputs[i]` of the sequence in slots[i] is tokens[i]."""
        self.pending[slots, num_outputs - self.listed[slots]] = tokens
        self.in_flight[slots] -= 1
        self.last_token[slots] = tokens

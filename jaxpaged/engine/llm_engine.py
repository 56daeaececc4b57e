"""LLMEngine.step(): schedule -> pack -> dispatch the jitted step -> read back, append tokens, stop, free.

Requests are validated at the door (a request that could never fit is refused at once, with a
ValueError naming the parameter), so a bad one never reaches the step loop and everyone else
keeps being served.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxpaged import platforms
from jaxpaged.config import EngineConfig
from jaxpaged.core.block_pool import BlockPool
from jaxpaged.core.kv_cache_manager import KVCacheManager, blocks_for
from jaxpaged.core.request import PLACEHOLDER, ParentRequest, Request, RequestStatus
from jaxpaged.core.scheduler import Scheduler, SchedulerOutput
from jaxpaged.engine.beam_search import BeamSearch
from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.models.convert_cache import cache_root
from jaxpaged.models.loader import LoadedModel, load_model
from jaxpaged.outputs import Logprob, RequestOutput
from jaxpaged.pallas_kernels import AttentionMetadata
from jaxpaged.sampling_params import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, SamplingParams
from jaxpaged.utils import compile_monitor
from jaxpaged.worker.model_runner import DispatchedStep, ModelRunner, StepInputs
from jaxpaged.worker.sampler import SamplingRow, build_sampling_metadata

logger = logging.getLogger("jaxpaged.engine")

PromptType = str | Sequence[int] | dict


@dataclasses.dataclass
class InFlightStep:
    """A step dispatched to the device whose results the host has not read yet."""

    sched: SchedulerOutput
    dispatched: DispatchedStep
    sampled_rows: dict[Request, int]  # sequences that sample in it -> their row of its sampled tokens


def _enable_compilation_cache(config: EngineConfig) -> None:
    """JAX's persistent cache, for tensor parallel engines only: one device stores whole executables instead
    (executable_cache.py), and the two together store broken ones."""
    if jax.config.jax_compilation_cache_dir or config.tensor_parallel_size == 1:  # the user chose one, or none needed
        return
    path = config.compilation_cache_dir or str(cache_root(config.cache_dir) / "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        compile_monitor.install()
        self.config = config
        _enable_compilation_cache(config)
        platform = platforms.get(config.platform)
        platform.prepare(config)
        t0 = time.perf_counter()
        self.loaded = loaded or load_model(
            config.model, dtype=config.dtype, attention_backend=config.attention_backend, cache_dir=config.cache_dir,
            batch_invariant=config.batch_invariant, revision=config.revision, platform=platform,
        )
        load_seconds = time.perf_counter() - t0
        self.tokenizer = self.loaded.tokenizer
        model_len = self.loaded.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's context ({model_len})")
        self.max_model_len = config.max_model_len or model_len
        self.eos_token_ids = self._eos_ids()
        self.max_suppress = MAX_STOP_TOKEN_IDS + len(self.eos_token_ids)  # ids min_tokens may forbid per row
        executables = cache_root(config.cache_dir) / "executables"
        self.runner = ModelRunner(self.loaded, config, self.max_model_len, executable_dir=executables)
        self.pool = BlockPool(self.runner.num_blocks, enable_caching=config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, config.block_size)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.groups: dict[str, ParentRequest] = {}
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(config.seed)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MB), up to %d tokens held at once; max_model_len %d",
            self.pool.num_blocks, config.block_size, self.pool.num_blocks * self.runner.block_bytes / 1e6,
            self.pool.num_blocks * config.block_size, self.max_model_len,
        )
        self.warmup_seconds = self.runner.warmup(self._blank_sampling)
        self.startup_seconds = {"load": load_seconds, **self.runner.startup_seconds, "warmup": self.warmup_seconds}
        self.num_compiles_after_warmup = 0  # compiles during step(); anything but 0 is a bug
        self._beam_count = 0
        self.num_computed_tokens_total = 0  # tokens run through the model (prefix-cache hits are not)
        self._in_flight: InFlightStep | None = None  # async scheduling: the step the device is running
        self.num_overlapped_steps = 0  # steps dispatched before the previous step's results were read

    def _eos_ids(self) -> list[int]:
        ids = set(self.loaded.config.eos_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.add(int(eos))
        return sorted(ids)

    def _blank_sampling(self, rows: int, width: int):
        return build_sampling_metadata([], rows, width, self.max_suppress)

    # -- requests ------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict must have 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt_token_ids")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, Sequence) and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"prompt must be a string, a list of token ids or a dict (got {type(prompt).__name__})")

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams (got {type(params).__name__})")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        vocab = self.loaded.config.vocab_size
        if not ids:
            raise ValueError("prompt must not be empty")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt_token_ids must lie in [0, {vocab})")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"prompt has {len(ids)} tokens, which leaves no room in max_model_len ({self.max_model_len})")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ValueError(
                f"max_tokens ({max_tokens}) plus the prompt's {len(ids)} tokens exceeds max_model_len ({self.max_model_len})"
            )
        need = blocks_for(len(ids) + max_tokens, self.config.block_size)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"prompt plus max_tokens needs {need} KV blocks but the whole pool has {self.pool.num_blocks}; "
                "raise num_kv_blocks or lower max_tokens"
            )
        group = ParentRequest(request_id, text, ids, params)
        if params.use_beam_search:
            self._add_beam_search(group, max_tokens)
            self.groups[request_id] = group
            return request_id
        base_seed = params.seed if params.seed is not None else int(self._seeds.integers(0, 2**63 - 1))
        # n > 1: the first sample computes the prompt but its last token, then the others fork from it and
        # share those blocks; each computes the last token itself (copying the shared partial block on write).
        fork = params.n > 1 and len(ids) > 1
        for index in range(params.n):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=params.skip_special_tokens, stop=params.stop or (),
                    include_stop_str_in_output=params.include_stop_str_in_output, prompt_token_ids=ids,
                    min_tokens=params.min_tokens,
                )
            seq = Request(
                seq_id=f"{request_id}#{index}", parent=group, index=index, prompt_token_ids=ids, params=params,
                max_tokens=max_tokens, seed=(base_seed + index) % 2**63, detokenizer=detok,
                logprobs=[] if params.logprobs is not None else None,
                prompt_logprobs=[None] if params.prompt_logprobs is not None and index == 0 else None,
            )
            group.sequences.append(seq)
            if fork and index > 0:
                group.unforked.append(seq)
            else:
                seq.hold_at = len(ids) - 1 if fork else None
                self.scheduler.add(seq)
        self.groups[request_id] = group
        return request_id

    def _add_beam_search(self, group: ParentRequest, max_tokens: int) -> None:
        params = group.params
        eos = [] if params.ignore_eos else self.eos_token_ids
        search = BeamSearch(params.best_of, max_tokens, eos, params.length_penalty, params.early_stopping)
        if search.num_candidates > MAX_LOGPROBS:
            raise ValueError(
                f"best_of (the beam width) must be at most {MAX_LOGPROBS // max(2, 1 + len(eos))} for this model: "
                f"beam search ranks max(2, 1 + {len(eos)} EOS ids) x width candidates per beam (got {params.best_of})"
            )
        group.beam = search
        if self.tokenizer is not None:
            group.decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        root = self._beam_sequence(group, 0, [], 0)
        search.running = [root]
        self.scheduler.add(root)

    def _beam_sequence(self, group: ParentRequest, number: int, outputs: list[int], num_computed: int) -> Request:
        """A running beam: a plain sequence asking for its next position's top candidates, never sampled from."""
        search = group.beam
        row_params = SamplingParams(temperature=0.0, max_tokens=search.max_tokens, logprobs=search.num_candidates,
                                    ignore_eos=True)  # fmt: skip
        return Request(
            seq_id=f"{group.request_id}#beam{number}", parent=group, index=0, prompt_token_ids=group.prompt_token_ids,
            params=row_params, max_tokens=search.max_tokens, seed=0, detokenizer=None, output_token_ids=outputs,
            num_computed_tokens=num_computed,
        )  # fmt: skip

    def _advance_beams(self, group: ParentRequest) -> None:
        """Every running beam has its candidates: pick the next beams, fork them from their parents, free the rest."""
        search = group.beam
        parents = search.running
        chosen = search.advance([p.beam_top for p in parents], [p.output_token_ids for p in parents])
        children = []
        for parent_index, token in chosen:
            parent = parents[parent_index]
            self._beam_count += 1
            child = self._beam_sequence(group, self._beam_count, [*parent.output_token_ids, token],
                                        parent.num_computed_tokens)  # fmt: skip
            child._block_hashes = list(parent._block_hashes)
            self.kv.fork(parent.seq_id, child.seq_id)  # before the parents let go of the shared blocks
            children.append(child)
        for parent in parents:
            self.scheduler.finish(parent, RequestStatus.FINISHED_STOPPED)
        search.running = children
        self.scheduler.add_forked(children)

    def abort_request(self, request_id: str) -> bool:
        group = self.groups.pop(str(request_id), None)
        if group is None:
            return False
        if group.beam is not None:
            group.beam.done = True
        for seq in group.live_sequences:
            if not seq.finished:
                self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # -- the step ------------------------------------------------------------------------------

    def _pack(self, sched: SchedulerOutput, in_flight_rows: dict[Request, int]) -> StepInputs:
        total = sched.num_tokens
        t, s = self.runner.bucket_for(total)
        ids = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        slots = np.full(t, -1, np.int32)
        tables = np.zeros((s, self.runner.table_width), np.int32)
        seq_lens = np.zeros(s, np.int32)
        query_start_loc = np.zeros(s + 1, np.int32)
        logit_rows = np.zeros(s, np.int32)
        prompt_next = prev_rows = None
        rows = []
        cursor = 0
        for j, item in enumerate(sched.scheduled):
            req, start, n = item.request, item.start, item.num_tokens
            table = self.kv.block_table(req.seq_id)
            ids[cursor : cursor + n] = req.tokens_at(start, n)
            if req.num_in_flight and start + n == req.num_tokens:  # its last token is the previous step's output
                prev_rows = np.full(t, -1, np.int32) if prev_rows is None else prev_rows
                prev_rows[cursor + n - 1] = in_flight_rows[req]
            positions[cursor : cursor + n] = np.arange(start, start + n, dtype=np.int32)
            slots[cursor : cursor + n] = self.kv.slots(req.seq_id, start, n)
            tables[j, : len(table)] = table
            prompt_len = len(req.prompt_token_ids)
            if req.prompt_logprobs is not None and start < prompt_len - 1:
                prompt_next = np.full(t, -1, np.int32) if prompt_next is None else prompt_next
                stop = min(start + n, prompt_len - 1)  # rows that predict a prompt token
                prompt_next[cursor : cursor + stop - start] = req.prompt_token_ids[start + 1 : stop + 1]
            seq_lens[j] = start + n
            cursor += n
            query_start_loc[j + 1] = cursor
            logit_rows[j] = cursor - 1
            rows.append(SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids, req.seed, self.eos_token_ids))
        query_start_loc[len(sched.scheduled) + 1 :] = cursor
        sampling = build_sampling_metadata(rows, s, self.runner.history_width, self.max_suppress)
        attn_metadata = AttentionMetadata(slots, tables, seq_lens, query_start_loc)
        return StepInputs(ids, positions, attn_metadata, logit_rows, sampling, prompt_next, prev_rows)

    def step(self) -> list[RequestOutput]:
        """One iteration: returns the outputs of every request that progressed or finished."""
        compiles_before = compile_monitor.unexpected_count()
        try:
            return self._step()
        finally:
            self.num_compiles_after_warmup += compile_monitor.unexpected_count() - compiles_before

    def _fork_ready(self) -> bool:
        """Fork the held samples of every first sample that has computed its prompt but the last token."""
        forked = False
        for first in self.scheduler.running:
            if first.hold_at is None or first.num_computed_tokens < first.hold_at:
                continue
            children = first.parent.unforked
            for child in children:
                self.kv.fork(first.seq_id, child.seq_id)
                child.num_computed_tokens = first.num_computed_tokens
            self.scheduler.add_forked(children)
            first.parent.unforked, first.hold_at, forked = [], None, True
        return forked

    def _step(self) -> list[RequestOutput]:
        """Read back the step in flight (or run one), after dispatching the next one when that is safe.

        With async scheduling the host schedules and packs step N+1 and queues it on the device before it
        waits for step N's tokens: the inputs N+1 takes from N never leave the device (PLACEHOLDER on the
        host until read). Sequences that end in step N cost N+1 one wasted row, whose results are dropped.
        """
        step, self._in_flight = self._in_flight, None
        if step is None:
            step = self._launch(None)
            if step is None:
                return []
        if self.config.async_scheduling and self._can_overlap(step):
            self._in_flight = self._launch(step)
            self.num_overlapped_steps += self._in_flight is not None
        return self._finish(step)

    def _can_overlap(self, step: InFlightStep) -> bool:
        """The next step can be formed without this one's results: no beam search (the host picks the next beams)
        and no penalties on a sequence whose next input is still on the device (they read the token history)."""
        if any(group.beam is not None for group in self.groups.values()):
            return False
        return not any(req.params.has_penalties for req in step.sampled_rows)

    def _launch(self, prev: InFlightStep | None) -> InFlightStep | None:
        """Schedule, pack and dispatch one step; None when nothing can run."""
        self._fork_ready()
        sched = self.scheduler.schedule()
        if not sched.scheduled and self._fork_ready():  # a held sample was admitted with its prefix all cached
            sched = self.scheduler.schedule()
        if not sched.scheduled:
            if prev is None and self.scheduler.has_unfinished() and not sched.preempted:  # admission checks prevent it
                raise RuntimeError("scheduler made no progress: the KV pool cannot hold any waiting request")
            return None
        rows = prev.sampled_rows if prev is not None else {}
        dispatched = self.runner.dispatch(self._pack(sched, rows), self.kv.take_copies(), prev.dispatched if prev else None)
        sampled_rows = {}
        for j, item in enumerate(sched.scheduled):
            req = item.request
            req.num_computed_tokens += item.num_tokens
            if item.samples and req.parent.beam is None:
                req.output_token_ids.append(PLACEHOLDER)
                req.num_in_flight += 1
                sampled_rows[req] = j
        return InFlightStep(sched, dispatched, sampled_rows)

    def _finish(self, step: InFlightStep) -> list[RequestOutput]:
        result = step.dispatched.fetch()
        touched: dict[str, ParentRequest] = {}
        beam_groups: dict[str, ParentRequest] = {}
        cursor = 0
        for j, item in enumerate(step.sched.scheduled):
            req, row = item.request, cursor
            cursor += item.num_tokens
            self.num_computed_tokens_total += item.num_tokens
            if req.finished:  # ended by an earlier step, or aborted, while this one ran: its row is dropped
                continue
            if result.prompt is not None and req.prompt_logprobs is not None:
                self._record_prompt_logprobs(req, item.start, item.num_tokens, row, result.prompt)
            self.kv.register_full_blocks(req, req.num_tokens - req.num_in_flight)
            if not item.samples:
                continue
            if req.parent.beam is not None:
                k = req.parent.beam.num_candidates
                req.beam_top = (result.top_ids[j, :k], result.top_logprobs[j, :k])
                beam_groups[req.parent.request_id] = req.parent
                continue
            self._append_token(req, int(result.tokens[j]), result, j)
            touched[req.parent.request_id] = req.parent
        for group in beam_groups.values():
            if all(seq.beam_top is not None for seq in group.beam.running):
                self._advance_beams(group)
                if group.beam.done:
                    touched[group.request_id] = group
        outputs = []
        for group in touched.values():
            outputs.append(group.output())
            if group.finished:
                self.groups.pop(group.request_id, None)
        return outputs

    def _append_token(self, req: Request, token: int, result, row: int) -> None:
        """Fill in the oldest in-flight output token, then detokenize and check the stop conditions."""
        n_out = req.num_sampled_tokens + 1
        req.output_token_ids[n_out - 1] = token
        req.num_in_flight -= 1
        params = req.params
        if req.logprobs is not None:
            lp = float(result.logprobs[row])
            req.cumulative_logprob += lp
            entry = {token: Logprob(lp, None, self._decode_one(token))}
            if params.logprobs and result.top_ids is not None:
                for rank, (tid, tlp) in enumerate(zip(result.top_ids[row, : params.logprobs], result.top_logprobs[row])):
                    tid = int(tid)
                    if tid == token:
                        entry[token].rank = rank + 1
                    else:
                        entry[tid] = Logprob(float(tlp), rank + 1, self._decode_one(tid))
            req.logprobs.append(entry)
        if req.detokenizer is not None:
            req.detokenizer.push(token)
        status = None
        if req.detokenizer is not None and req.detokenizer.finished:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, req.detokenizer.stop_reason
        elif n_out >= params.min_tokens and not params.ignore_eos and token in self.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif n_out >= params.min_tokens and token in params.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif n_out >= req.max_tokens or len(req.prompt_token_ids) + n_out >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            del req.output_token_ids[n_out:]  # a token the next step sampled for it (async) is dropped
            req.num_in_flight = 0
            if req.detokenizer is not None:
                req.detokenizer.flush()
            self.scheduler.finish(req, status)

    def _record_prompt_logprobs(self, req: Request, start: int, count: int, row: int, prompt) -> None:
        """Entries for the prompt tokens this chunk predicts (recomputed chunks after a preemption add nothing)."""
        chosen, rank, top_ids, top_lps = prompt
        wanted = req.params.prompt_logprobs
        for offset in range(count):
            position = start + offset + 1  # the prompt token row `row + offset` predicts
            if position >= len(req.prompt_token_ids) or position < len(req.prompt_logprobs):
                continue
            token, r = req.prompt_token_ids[position], row + offset
            entry = {token: Logprob(float(chosen[r]), int(rank[r]), self._decode_one(token))}
            for rank_i, (tid, tlp) in enumerate(zip(top_ids[r, :wanted], top_lps[r, :wanted])):
                if int(tid) != token:
                    entry[int(tid)] = Logprob(float(tlp), rank_i + 1, self._decode_one(int(tid)))
            req.prompt_logprobs.append(entry)

    def _decode_one(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    # -- introspection -------------------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        held = {}
        stored = 0
        for req in self.scheduler.running:
            stored += req.num_computed_tokens
            for b in self.kv.block_table(req.seq_id):
                held[b] = True
        slots = len(held) * self.config.block_size
        return {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_free": self.pool.num_free,
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_cached": self.pool.num_cached,
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            "num_computed_tokens": self.num_computed_tokens_total,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_compiles_after_warmup": self.num_compiles_after_warmup,
            "num_overlapped_steps": self.num_overlapped_steps,
            "kv_token_utilization": stored / slots if slots else 0.0,
            "warmup_seconds": self.warmup_seconds,
        }

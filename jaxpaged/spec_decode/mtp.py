"""The `mtp` proposer: the checkpoint's own multi-token-prediction layer drafts (DeepSeek-V3/R1, GLM-4.5, Qwen3-Next
and Qwen3.5), as vLLM runs it; and the `eagle3` proposer, an EAGLE-3 head (spec_decode/eagle3.py) run the same way, its
input the streams entering three of the target's layers instead of the final hidden state.

The MTP layer (spec_decode/mtp_layers.py) at position t takes the target's final hidden state h_t (after its final
norm: vLLM hands its drafts the model's output) and the embedding of token t+1, runs its decoder layer (the target's
own kind, its own one-layer KV cache) at position t, and predicts token t+2. k guesses chain it: each next step takes
the previous step's output hidden state and guess, one position on.

Why a shadow step: the layer needs h_t of every position it will ever attend to, and those exist on the device only
during the target's step. So after every target step (ModelRunner.execute_model) the layer runs over the same tokens
with the same block tables and slots (its cache is the target's pool layout, one layer, so a target block id
is an MTP block id and nothing is allocated or freed apart), its token inputs shifted by one: the next prompt token,
or the token the step sampled at that row (read on the device). It keeps, per sampling row, its greedy guess and
output hidden state on the device; propose() picks the row of each sequence's last accepted position, gathers them
and chains k - 1 one-token steps, reading every guess back once. Guesses past a sequence's allocated blocks write
into scratch blocks beyond the pool (the next shadow step rewrites those positions in the real ones). While no guess
is wanted (disable_by_batch_size or more sequences running, decided on the host) the shadow step writes the layer's
K/V only, so the cache stays whole for the guesses that follow and the block's attention, MLP and head are skipped.

Greedy guesses are point masses, so verification (rejection_sampler.py) keeps the target's output exact whatever
the layer proposes; the layer's cache entries only ever affect how often guesses are accepted.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.models.loader import DTYPES, LoadedModel
from jaxpaged.pallas_kernels import AttentionMetadata, kv_cache_shape
from jaxpaged.spec_decode.mtp_layers import load_mtp_layer
from jaxpaged.worker.kv_memory import kv_pool

logger = logging.getLogger("jaxpaged.spec_decode")


def attention_backend(model):
    """The backend the target's attention layers run (a hybrid's first layers may be linear ones)."""
    return next(layer.self_attn.backend for layer in model.layers if getattr(layer, "self_attn", None) is not None)


def shadow_feed(output, t: int):
    """A target step's MTP inputs: per token row, the next token (host) or the sampled row holding it (-1: host);
    and per sampling sequence (seq_id, its first sampled row, that row's position, rows)."""
    next_ids = np.zeros(t, np.int32)
    take = np.full(t, -1, np.int32)
    records = []
    for item in output.scheduled:
        req, first = item.request, item.first_token_row
        k = len(item.draft_token_ids)
        real = item.num_tokens - k
        host = real - 1 if item.samples else item.num_tokens  # rows whose next token the host knows
        if item.samples:
            take[first + host : first + item.num_tokens] = item.row + np.arange(k + 1)
            records.append((req.seq_id, item.row, item.start + real - 1, k + 1))
        if host:
            p = len(req.prompt_token_ids)
            lo, hi = item.start + 1, item.start + 1 + host
            ids = req.prompt_token_ids[lo:hi] + req.output_token_ids[max(lo - p, 0) : max(hi - p, 0)]
            next_ids[first : first + host] = ids
    return next_ids, take, records


def _gather(acc_tokens, acc_hidden, tokens, hidden, idx):
    """Rows of one step's guesses into the batch being proposed (idx -1: keep)."""
    take = idx >= 0
    safe = jnp.maximum(idx, 0)
    return jnp.where(take, tokens[safe], acc_tokens), jnp.where(take[:, None], hidden[safe], acc_hidden)


def _proposing_rows(config, spec) -> int:
    """Sequences proposing at once: fewer than disable_by_batch_size run when any does."""
    return max(1, min(config.max_num_seqs, spec.disable_by_batch_size - 1))


@dataclasses.dataclass(frozen=True)
class DraftLayer:
    """A drafting layer placed on the device: its graph and weights, and the shapes its cache and inputs take."""

    graphdef: object
    state: object
    kv_dims: tuple[int, int]  # (KV heads, head dim) of its one-layer cache
    hidden_size: int  # what a guess chains from
    input_width: int  # what the target's step hands it: the final hidden state (mtp) or three streams (eagle3)
    aux_layers: tuple[int, ...] = ()  # eagle3: the target layers whose input streams it reads


def _scratch_per_row(config, spec) -> int:
    """Blocks a chained guess may need past a sequence's allocation: k positions on, and the block it starts in."""
    return -(-spec.num_speculative_tokens // config.block_size) + 1


class MtpProposer:
    """Runs the MTP layer beside a ModelRunner (runner.mtp): a shadow step after each target step, and propose()."""

    @staticmethod
    def load(loaded: LoadedModel, config, spec, platform, device) -> DraftLayer:
        """The checkpoint's MTP layer (spec.method "mtp") or the EAGLE-3 head in spec.model ("eagle3") laid out for
        the platform and placed on `device`: before the target's runner, whose KV pool is then sized from the memory
        left."""
        if spec.num_speculative_tokens >= config.max_num_seqs:
            raise ValueError(f"speculative_config.num_speculative_tokens ({spec.num_speculative_tokens}) must be below "
                             f"max_num_seqs ({config.max_num_seqs}): a verifying row samples 1 + k rows of a step")  # fmt: skip
        if spec.method == "eagle3":
            from jaxpaged.spec_decode.eagle3 import load_eagle3_head

            head = load_eagle3_head(spec.model, loaded, attention_backend(loaded.model))
            layer, aux = head.layer, head.aux_layers
            dims, hidden, width = layer.kv_dims, layer.hidden_size, layer.aux_width
        else:
            layer, aux = load_mtp_layer(loaded, attention_backend(loaded.model)), ()
            cfg = loaded.config
            dims, hidden, width = (cfg.num_kv_heads, cfg.head_dim), cfg.hidden_size, cfg.hidden_size
        platform.prepare_model(layer, config.matmul_backend, dtype=DTYPES[loaded.dtype], tensor_parallel_size=1,
                               moe_kernel=config.moe_kernel)  # fmt: skip
        graphdef, state = nnx.split(layer)
        return DraftLayer(graphdef, jax.device_put(state, device), dims, hidden, width, aux)

    @staticmethod
    def mirrored_kv(config, spec) -> tuple[int, int]:
        """(KV layers on the pool's block ids, extra blocks of them): the layer's cache, one layer over the pool's
        blocks plus scratch blocks for guesses past a sequence's allocation (the runner counts them when it sizes
        the pool)."""
        return 1, _proposing_rows(config, spec) * _scratch_per_row(config, spec)

    def __init__(self, weights: DraftLayer, runner, config, spec, source: str = ""):
        # a target with KV cache groups (windowed layers apart): the layer's cache mirrors a global group's tables
        groups = runner.kv_groups
        self.group = None if groups is None else next((g for g, w in enumerate(groups.windows) if w is None), None)
        if groups is not None and self.group is None:
            raise ValueError(f"speculative_config.method {spec.method!r}: every layer of {runner.model_config.architecture} "
                             "is windowed, and the drafting layer attends to the whole history")  # fmt: skip
        self.graphdef, self.state = weights.graphdef, weights.state
        self.hidden_size, self.input_width = weights.hidden_size, weights.input_width
        self.what = "EAGLE-3 head" if spec.method == "eagle3" else "MTP layer"
        self.runner = runner
        self.k = spec.num_speculative_tokens
        self.block_size = config.block_size
        self.width = config.max_num_seqs  # the shadow's outputs: one row per possible sampling row
        self.rows = _proposing_rows(config, spec)  # sequences proposing at once
        self.scratch_per_row = _scratch_per_row(config, spec)
        self.scratch0 = runner.num_blocks
        num_blocks = runner.num_blocks + self.rows * self.scratch_per_row
        shape = kv_cache_shape(1, weights.kv_dims[0], num_blocks, self.block_size, weights.kv_dims[1])
        self.cache, self._write, self._copy = kv_pool(shape, runner.kv_cache_dtype, runner.platform.kv_storage_dtype(runner.dtype),
                                                      None, runner.device)  # fmt: skip
        self.cache = jax.device_put(self.cache, runner.device)  # committed, as it is once a step has written it
        self.kv = None  # the scheduler's KVCacheManager (block tables by sequence id), set by the engine
        self._shadow = jax.jit(self._shadow_impl)
        self._shadow_kv = jax.jit(self._shadow_kv_impl)
        self._chain = jax.jit(self._chain_impl)
        # whether guesses will be wanted (the engine's SpecDecoder.active: fewer than disable_by_batch_size running);
        # while not, the shadow step writes the layer's K/V only
        self.guessing = lambda: True
        self.may_skip = spec.disable_by_batch_size <= config.max_num_seqs  # (else always wanted: not compiled)
        self.num_kv_only = 0  # shadow steps that wrote K/V only
        self._gather = jax.jit(_gather)
        d = self.hidden_size
        self._zeros = (jax.device_put(np.zeros(self.width, np.int32), runner.device),
                       jax.device_put(np.zeros((self.width, d), runner.dtype), runner.device))  # fmt: skip
        self.records: dict[str, tuple] = {}  # seq_id -> ((guesses, hidden) on the device, first row, its position, rows)
        logger.info("%s of %s: its KV cache %d blocks (%d scratch)", self.what, source, num_blocks, num_blocks - runner.num_blocks)

    # -- the device functions ------------------------------------------------------------------

    def _run(self, target_state, state, cache, ids, hidden, positions, attn):
        target = nnx.merge(self.runner.graphdef, target_state)
        layer = nnx.merge(self.graphdef, state)
        return target, layer, *layer(layer.embed(ids, target), hidden, positions, cache, attn)

    def _padded(self, tokens, hidden):
        s = tokens.shape[0]
        out_t = jnp.zeros(self.width, jnp.int32).at[:s].set(tokens.astype(jnp.int32))
        out_h = jnp.zeros((self.width, hidden.shape[-1]), self.runner.dtype).at[:s].set(hidden.astype(self.runner.dtype))
        return out_t, out_h

    def _shadow_impl(self, target_state, state, cache, hidden, sampled, next_ids, take, positions, attn, logit_rows):
        ids = jnp.where(take >= 0, sampled[jnp.maximum(take, 0)], next_ids)
        target, layer, out, new_kv = self._run(target_state, state, cache, ids, hidden, positions, attn)
        rows = out[logit_rows]
        return *self._padded(layer.greedy(rows, target), rows), new_kv

    def _shadow_kv_impl(self, target_state, state, cache, hidden, sampled, next_ids, take, positions, attn):
        ids = jnp.where(take >= 0, sampled[jnp.maximum(take, 0)], next_ids)
        target, layer = nnx.merge(self.runner.graphdef, target_state), nnx.merge(self.graphdef, state)
        return layer.new_kv(layer.embed(ids, target), hidden, positions, cache, attn)

    def _chain_impl(self, target_state, state, cache, tokens, hidden, positions, attn):
        r = positions.shape[0]
        target, layer, out, new_kv = self._run(target_state, state, cache, tokens[:r], hidden[:r], positions, attn)
        return *self._padded(layer.greedy(out, target), out), new_kv

    # -- after each target step ----------------------------------------------------------------

    def shadow(self, output, step, dispatched, hidden) -> None:
        """The layer over the target step's tokens (see the module's docstring); keeps each sampling sequence's rows.
        While no guess is wanted (disable_by_batch_size), its K/V only: the cache stays whole for later guesses, the
        block's attention, MLP and head are skipped (no other compile than warm-up's; decided on the host)."""
        if output.block_copies:  # copy-on-write blocks: the layer's entries go along
            self._copy_blocks(output.block_copies)
        t = step.input_ids.shape[0]
        next_ids, take, records = shadow_feed(output, t)
        attn = self._global_view(step.attention)
        inputs = self._put((hidden, dispatched.sampled, next_ids, take, step.positions, attn))
        if self.may_skip and not self.guessing():
            new_kv = self._shadow_kv(self.runner.state, self.state, self.cache, *inputs)
            self.cache = self._write(self.cache, new_kv, self._put(attn.slot_mapping))
            self.num_kv_only += 1
            self.release(seq_id for seq_id, *_ in records)  # (stale rows would otherwise be read)
            return
        tokens, rows_hidden, new_kv = self._shadow(self.runner.state, self.state, self.cache, *inputs, self._put(step.logit_rows))
        self.cache = self._write(self.cache, new_kv, self._put(attn.slot_mapping))
        for seq_id, row, pos, n in records:
            self.records[seq_id] = ((tokens, rows_hidden), row, pos, n)

    def _global_view(self, attn: AttentionMetadata) -> AttentionMetadata:
        """A step's metadata as the layer reads it: with KV cache groups, a global group's slots and tables."""
        if self.group is None:
            return attn
        return dataclasses.replace(attn, slot_mapping=attn.slot_mapping[self.group],
                                   block_tables=attn.block_tables[self.group], layer_groups=None)  # fmt: skip

    def stats(self) -> dict:
        return {"spec_decode_mtp_kv_only_steps": self.num_kv_only}

    def _put(self, tree):
        """Every input committed to the runner's device, host arrays or not: one signature per shape, so warm-up's
        calls are the ones serving makes."""
        return jax.device_put(tree, self.runner.device)

    def _copy_blocks(self, pairs) -> None:
        width, outside = self.runner.copy_width, self.scratch0 + self.rows * self.scratch_per_row
        for i in range(0, len(pairs), width):
            src, dst = np.zeros(width, np.int32), np.full(width, outside, np.int32)  # padding: out of range, dropped
            src[: len(pairs[i : i + width])], dst[: len(pairs[i : i + width])] = zip(*pairs[i : i + width])
            self.cache = self._copy(self.cache, *self._put((src, dst)))

    # -- the Proposer protocol -------------------------------------------------------------------

    @property
    def held(self) -> Iterable[str]:
        return self.records.keys()

    def release(self, seq_ids: Iterable[str]) -> None:
        for seq_id in list(seq_ids):
            self.records.pop(seq_id, None)

    def propose(self, tokens: Sequence[Sequence[int]], ks: Sequence[int], seq_ids: Sequence[str]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in tokens]
        live = []  # (i, source arrays, row): guess 1 of sequence i is the source's row
        for i, (toks, seq_id) in enumerate(zip(tokens, seq_ids)):
            rec = self.records.get(seq_id)
            if rec is None or len(live) == self.rows:
                continue
            arrays, row, pos, n = rec
            m = len(toks) - 2 - pos  # the row of the last known token's position
            if 0 <= m < n:
                live.append((i, arrays, row + m))
        if not live:
            return out
        acc = self._zeros
        for arrays in {id(a): a for _, a, _ in live}.values():
            idx = np.full(self.width, -1, np.int32)
            for r, (_, a, row) in enumerate(live):
                if a is arrays:
                    idx[r] = row
            acc = self._gather(*acc, *arrays, self._put(idx))
        guesses = [acc[0]]
        for j in range(1, max(ks[i] for i, _, _ in live)):
            positions, attn = self._chain_inputs(tokens, ks, seq_ids, live, j)
            tok, hid, new_kv = self._chain(self.runner.state, self.state, self.cache, *acc, *self._put((positions, attn)))
            self.cache = self._write(self.cache, new_kv, self._put(attn.slot_mapping))
            acc = (tok, hid)
            guesses.append(tok)
        host = jax.device_get(guesses)  # the one wait of a call
        for r, (i, _, _) in enumerate(live):
            out[i] = [int(host[j][r]) for j in range(ks[i])]
        return out

    def _chain_inputs(self, tokens, ks, seq_ids, live, j: int) -> tuple[np.ndarray, AttentionMetadata]:
        """Guess j + 1's step: live row r at position len - 2 + j, its blocks the sequence's table, then scratch."""
        n, bs, width = self.rows, self.block_size, self.runner.table_width
        positions, slots = np.zeros(n, np.int32), np.full(n, -1, np.int32)
        tables, seq_lens = np.zeros((n, width), np.int32), np.zeros(n, np.int32)
        qsl = np.arange(n + 1, dtype=np.int32)
        for r, (i, _, _) in enumerate(live):
            if ks[i] <= j:
                continue
            q = len(tokens[i]) - 2 + j
            table = self.kv.block_table(seq_ids[i])
            table = list(table if self.group is None else table[self.group])[: q // bs + 1]
            scratch = self.scratch0 + r * self.scratch_per_row
            table += list(range(scratch, scratch + q // bs + 1 - len(table)))
            tables[r, : len(table)] = table
            positions[r], seq_lens[r] = q, q + 1
            slots[r] = table[q // bs] * bs + q % bs
        return positions, AttentionMetadata(slots, tables, seq_lens, qsl)

    # -- warm-up ---------------------------------------------------------------------------------

    def warmup(self) -> float:
        """Compile the shadow steps (full, and K/V only where speculation can be off for the batch size) for every
        target bucket, the gather, the chain step and the block copy."""
        import time

        t0 = time.perf_counter()
        runner, d = self.runner, self.input_width
        for t in runner.buckets:
            step = runner.input_batch.blank(t)
            hidden = jax.device_put(np.zeros((t, d), runner.dtype), runner.device)
            inputs = self._put((hidden, runner._no_sampled, np.zeros(t, np.int32), np.full(t, -1, np.int32),
                                step.positions, self._global_view(step.attention)))  # fmt: skip
            if self.may_skip:
                self._shadow_kv(runner.state, self.state, self.cache, *inputs)
            *_, new_kv = self._shadow(runner.state, self.state, self.cache, *inputs, self._put(step.logit_rows))
            self.cache = self._write(self.cache, new_kv, self._put(self._global_view(step.attention).slot_mapping))
        acc = self._gather(*self._zeros, *self._zeros, self._put(np.full(self.width, -1, np.int32)))
        n = self.rows
        attn = AttentionMetadata(np.full(n, -1, np.int32), np.zeros((n, runner.table_width), np.int32),
                                 np.zeros(n, np.int32), np.zeros(n + 1, np.int32))  # fmt: skip
        *_, new_kv = self._chain(runner.state, self.state, self.cache, *acc, *self._put((np.zeros(n, np.int32), attn)))
        self.cache = self._write(self.cache, new_kv, self._put(attn.slot_mapping))
        self._copy_blocks([(0, 0)])  # block 0 onto itself: the copy compiled
        jax.block_until_ready(self.cache)
        return time.perf_counter() - t0

"""Choosing the next token of every row of a padded batch, inside the jitted step.

Every per-request knob arrives as an array (`SamplingMetadata`), so a batch mixing greedy,
seeded, penalised and truncated requests runs one compiled program whatever the values; only
the shapes (rows, history width, suppress width) pick a compile. Features no row uses are
skipped: where a `lax.cond` runs on the device (CPU, TPU), by conds on flags the host sets (the DYNAMIC plan); where
it makes the host wait for the device (XLA:GPU reads the predicate back), by a `SamplerPlan` the host picks for the
step, each plan its own compiled sampler with no cond in it (docs/design.md, "No host waits inside a step").

Randomness is per row: the Gumbel noise of a row comes from `fold_in(key(seed), step_index)`,
so a seeded request draws the same tokens in any batch, at any row, and after a preemption
recomputes it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sampling_params import _GREEDY_EPS, LOGIT_BIAS_WIDTH, MAX_LOGPROBS, SamplingParams

NUM_TOP_LOGPROBS = MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # [S] f32; 0 (below _GREEDY_EPS) means greedy
    top_k: jax.Array  # [S] i32; 0 disabled, > V means no limit
    top_p: jax.Array  # [S] f32; 1.0 disabled
    min_p: jax.Array  # [S] f32; 0 disabled
    presence_penalty: jax.Array  # [S] f32
    frequency_penalty: jax.Array  # [S] f32
    repetition_penalty: jax.Array  # [S] f32
    seeds: jax.Array  # [S] u32 per-row PRNG seed
    step_index: jax.Array  # [S] i32 index of the output token being sampled (0 for the first)
    history: jax.Array  # [S, H] i32 prompt ids then output ids, padded with -1
    prompt_lens: jax.Array  # [S] i32 how many leading history entries are prompt
    suppress_ids: jax.Array  # [S, K] i32 ids forbidden for this row (min_tokens), padded with -1
    any_penalty: jax.Array  # [] bool some row has a non-neutral penalty
    any_top: jax.Array  # [] bool some row uses top_k / top_p / min_p
    want_logprobs: jax.Array  # [] bool some row asked for logprobs (0 included); otherwise none are computed
    bitmask: jax.Array  # [S, ceil(V / 32)] i32 structured outputs: bit i of word w allows token 32 w + i; all ones when free
    any_constrained: jax.Array  # [] bool some row has a structured-outputs constraint (otherwise the mask is not read)
    # [S, 2, B] i32 each row's biased ids (-1 padding), then their float32 biases' bits: logit_bias, and the ids bad
    # words ban (-inf)
    logit_bias: jax.Array
    mask_logprobs: jax.Array  # [S] bool the row's bitmask masks its logprobs too (a grammar's; allowed_token_ids' not)
    draft_ids: jax.Array | None = None  # [S] i32 speculative decoding: the token each row verifies, -1 for none


class SamplerPlan(NamedTuple):
    """The sampler's stages a step runs: True runs a stage for every row (neutral for rows that do not use it), False
    leaves it out, None leaves it to the device (a lax.cond on the flag the host set). Static: each plan compiles
    its own sampler."""

    constrained: bool | None = None  # a structured-outputs bitmask
    suppress: bool | None = None  # ids min_tokens forbids
    bias: bool | None = None  # logit_bias, bad words
    penalty: bool | None = None  # repetition, presence, frequency
    random: bool | None = None  # some row samples (temperature > 0); else the greedy argmax alone
    top: bool | None = None  # top-k / top-p / min-p
    logprobs: bool | None = None
    draft: bool | None = None  # some row verifies a speculative proposal

    @property
    def name(self) -> str:
        """A short tag for the executable's name: one letter per stage, '.' when left out, '?' left to the device."""
        return "".join("?" if v is None else (k[0] if v else ".") for k, v in zip(self._fields, self))


DYNAMIC = SamplerPlan()  # every stage decided on the device: one sampler for every batch
GREEDY = SamplerPlan(*[False] * len(SamplerPlan._fields))  # the argmax alone
FULL = SamplerPlan(*[True] * len(SamplerPlan._fields))  # every stage run: right for any batch, the slowest


def plan_for(metadata: SamplingMetadata, suppress: bool | None = None, bias: bool | None = None) -> SamplerPlan:
    """The stages a step's (host-side, numpy) metadata needs, each one only if some row uses it (`suppress`, `bias`:
    whether some row has ids to suppress or bias, when the caller has looked already)."""
    random = bool((np.asarray(metadata.temperature) >= _GREEDY_EPS).any())
    draft = metadata.draft_ids is not None and bool((np.asarray(metadata.draft_ids) >= 0).any())
    if suppress is None:
        suppress = bool((np.asarray(metadata.suppress_ids) >= 0).any())
    if bias is None:
        bias = bool((np.asarray(metadata.logit_bias)[:, 0] >= 0).any())
    return SamplerPlan(
        constrained=bool(metadata.any_constrained), suppress=suppress, bias=bias,
        penalty=bool(metadata.any_penalty), random=random, top=random and bool(metadata.any_top),
        logprobs=bool(metadata.want_logprobs), draft=random and draft,
    )  # fmt: skip


def _stage(run: bool | None, predicate, stage, skip, *operands):
    """`stage(*operands)` when the plan runs it, `skip(*operands)` when it leaves it out, a lax.cond on `predicate`
    (a traced flag) when the plan leaves the choice to the device."""
    if run is None:
        return jax.lax.cond(predicate, stage, skip, *operands)
    return (stage if run else skip)(*operands)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    tokens: jax.Array  # [S] i32 sampled ids
    logprobs: jax.Array  # [S] f32 logprob of the sampled id under the raw model distribution (zeros unless want_logprobs)
    top_ids: jax.Array  # [S, 20] i32 the raw distribution's top ids (zeros unless want_logprobs)
    top_logprobs: jax.Array  # [S, 20] f32 their logprobs (zeros unless want_logprobs)


def _row_ids(ids: jax.Array, vocab: int) -> jax.Array:
    """-1 padding becomes an out-of-range id, which `mode="drop"` scatters then skip (JAX wraps negatives)."""
    return jnp.where(ids < 0, vocab, ids)


def _log_softmax(logits: jax.Array) -> jax.Array:
    """log_softmax that gives -inf, not NaN, for a row whose logits are all -inf."""
    m = jnp.max(logits, axis=-1, keepdims=True)
    shifted = logits - jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True)
    return jnp.where(total > 0, shifted - jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)


def _softmax(logits: jax.Array) -> jax.Array:
    """softmax that gives zeros, not NaN, for a row whose logits are all -inf."""
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


MASKED_LOGIT = -1e30  # a token the row's grammar forbids: far below any real logit, finite (no inf - inf NaNs)


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Structured outputs: every token whose bit is 0 in its row's packed mask gets MASKED_LOGIT."""
    vocab = logits.shape[1]
    ids = jnp.arange(vocab, dtype=jnp.int32)
    words = jnp.take(bitmask, jnp.minimum(ids // 32, bitmask.shape[1] - 1), axis=1)  # [S, V]
    allowed = ((words >> (ids % 32)) & 1).astype(bool) & (ids < 32 * bitmask.shape[1])
    return jnp.where(allowed, logits, MASKED_LOGIT)


def apply_suppression(logits: jax.Array, suppress_ids: jax.Array) -> jax.Array:
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, _row_ids(suppress_ids, logits.shape[1])].set(-jnp.inf, mode="drop")


def apply_logit_bias(logits: jax.Array, logit_bias: jax.Array) -> jax.Array:
    rows = jnp.arange(logits.shape[0])[:, None]
    values = jax.lax.bitcast_convert_type(logit_bias[:, 1], jnp.float32)
    return logits.at[rows, _row_ids(logit_bias[:, 0], logits.shape[1])].add(values, mode="drop")


def apply_penalties(logits: jax.Array, attn_metadata: SamplingMetadata) -> jax.Array:
    """Repetition (prompt and output tokens, as HF and vLLM), then presence and frequency (output only).

    Always does the work; `sample` calls it only when some row has a penalty.
    """
    num_rows, vocab = logits.shape
    rows = jnp.arange(num_rows)[:, None]
    in_prompt = jnp.arange(attn_metadata.history.shape[1])[None, :] < attn_metadata.prompt_lens[:, None]
    ids = _row_ids(attn_metadata.history, vocab)
    prompt_counts = jnp.zeros((num_rows, vocab), jnp.int32).at[rows, jnp.where(in_prompt, ids, vocab)].add(
        1, mode="drop"
    )
    output_counts = jnp.zeros((num_rows, vocab), jnp.int32).at[rows, jnp.where(in_prompt, vocab, ids)].add(
        1, mode="drop"
    )
    seen = (prompt_counts + output_counts) > 0
    rep = attn_metadata.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - attn_metadata.frequency_penalty[:, None] * output_counts.astype(logits.dtype)
    return logits - attn_metadata.presence_penalty[:, None] * (output_counts > 0).astype(logits.dtype)


def apply_top_k_top_p_min_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Sets every token outside a row's top-k, then top-p nucleus, then min-p floor to -inf.

    One descending sort serves all three. Each keeps a prefix of the sorted row (the most likely
    token always survives), so the kept set is "logit >= the last kept sorted logit"; a token tied
    with that boundary logit is kept too. top-p is measured on the top-k renormalised distribution
    (as HF and vLLM); min-p compares with the most likely token, which renormalising does not change.
    """
    vocab = logits.shape[-1]
    desc = -jnp.sort(-logits, axis=-1)
    position = jnp.arange(vocab)[None, :]
    k = jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)[:, None]
    keep = position < k
    probs = _softmax(jnp.where(keep, desc, -jnp.inf))
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass of the more likely tokens
    keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    num_kept = jnp.sum(keep, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(desc, num_kept - 1, axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def first_argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first maximum; a NaN counts as the maximum), as int32.

    Written as a max and a min over plain arrays: XLA:CPU runs argmax's paired (value, index)
    reduction unvectorised, several times slower.
    """
    nan = jnp.isnan(x)
    peak = jnp.max(jnp.where(nan, -jnp.inf, x), axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where((x == peak) | nan, index, x.shape[-1] - 1), axis=-1)


def _gumbel_argmax(logits: jax.Array, seeds: jax.Array, step_index: jax.Array) -> jax.Array:
    def noise(seed, step):
        return jax.random.gumbel(jax.random.fold_in(jax.random.key(seed), step), logits.shape[1:], logits.dtype)

    return first_argmax(logits + jax.vmap(noise)(seeds, step_index))


def _top_logprobs(raw_logprobs: jax.Array) -> tuple[jax.Array, jax.Array]:
    k = min(NUM_TOP_LOGPROBS, raw_logprobs.shape[-1])
    values, ids = jax.lax.top_k(raw_logprobs, k)
    pad = NUM_TOP_LOGPROBS - k
    if pad:  # a vocabulary smaller than 20 (tests): pad with -inf so the shape never changes
        ids = jnp.pad(ids, ((0, 0), (0, pad)))
        values = jnp.pad(values, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    return ids.astype(jnp.int32), values


def _no_top_logprobs(raw_logprobs: jax.Array) -> tuple[jax.Array, jax.Array]:
    num_rows = raw_logprobs.shape[0]
    return (
        jnp.zeros((num_rows, NUM_TOP_LOGPROBS), jnp.int32),
        jnp.zeros((num_rows, NUM_TOP_LOGPROBS), raw_logprobs.dtype),
    )


def _logprob_outputs(raw_logits: jax.Array, tokens: jax.Array):
    raw_logprobs = _log_softmax(raw_logits)
    raw_logprobs = jnp.where(raw_logits <= MASKED_LOGIT, -jnp.inf, raw_logprobs)  # a token the grammar forbids
    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    return (chosen, *_top_logprobs(raw_logprobs))


def prompt_logprobs(logits: jax.Array, next_ids: jax.Array) -> tuple[jax.Array, ...]:
    """Per row: logprob and 1-based rank of next_ids (the prompt's next token; < 0 for rows nobody asked about), and
    the top-20 ids and logprobs, all under the raw model distribution."""
    logprobs = _log_softmax(logits)
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(next_ids, 0)[:, None], axis=-1)[:, 0]
    rank = jnp.sum(logprobs > chosen[:, None], axis=-1).astype(jnp.int32) + 1
    return (chosen, rank, *_top_logprobs(logprobs))


def _no_logprob_outputs(raw_logits: jax.Array, tokens: jax.Array):
    return (jnp.zeros(tokens.shape, jnp.float32), *_no_top_logprobs(raw_logits))


def sample(logits: jax.Array, attn_metadata: SamplingMetadata, plan: SamplerPlan = DYNAMIC) -> SamplerOutput:
    """Next token of every row: bitmask (a grammar, allowed_token_ids) -> suppress (min_tokens) -> logit bias (and
    bad words) -> repetition -> presence/frequency -> (greedy argmax) -> temperature -> top-k -> top-p -> min-p ->
    Gumbel-max. `logits` is [S, V] float32.

    `plan` says which stages run (SamplerPlan); with DYNAMIC each stage a batch does not use is skipped at run time
    (lax.cond), so an all-greedy batch without penalties or logprobs costs one argmax over the vocabulary. A stage
    is neutral for the rows that do not use it, so any plan that runs at least the stages some row needs gives
    the same tokens.
    """
    md = attn_metadata
    raw = logits.astype(jnp.float32)
    keep = lambda x, *_: x  # noqa: E731
    def constrain(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        masked = apply_bitmask(x, md.bitmask)
        return jnp.where(md.mask_logprobs[:, None], masked, x), masked

    # logprobs are of `raw`: the model's distribution, renormalised over a grammar's allowed tokens (as vLLM)
    raw, logits = _stage(plan.constrained, md.any_constrained, constrain, lambda x: (x, x), raw)
    logits = _stage(plan.suppress, jnp.any(md.suppress_ids >= 0), lambda x: apply_suppression(x, md.suppress_ids), keep, logits)
    logits = _stage(plan.bias, jnp.any(md.logit_bias[:, 0] >= 0), lambda x: apply_logit_bias(x, md.logit_bias), keep, logits)
    logits = _stage(plan.penalty, md.any_penalty, apply_penalties, keep, logits, md)
    greedy_tokens = first_argmax(logits)

    greedy = md.temperature < _GREEDY_EPS

    def processed(x: jax.Array) -> jax.Array:
        x = x / jnp.where(greedy, 1.0, md.temperature)[:, None]
        return _stage(plan.top, md.any_top, lambda y: apply_top_k_top_p_min_p(y, md.top_k, md.top_p, md.min_p), keep, x)

    def plain(x: jax.Array) -> jax.Array:
        return _gumbel_argmax(processed(x), md.seeds, md.step_index)

    random_tokens = plain
    if md.draft_ids is not None:  # speculative decoding: rows with a proposal accept or reject it
        from jaxpaged.spec_decode.rejection_sampler import verify_proposals

        def verify(x: jax.Array) -> jax.Array:
            return verify_proposals(processed(x), md.draft_ids, md.seeds, md.step_index)

        def random_tokens(x: jax.Array) -> jax.Array:
            return _stage(plan.draft, jnp.any(md.draft_ids >= 0), verify, plain, x)

    # An all-greedy batch (the common serving default) draws no noise at all.
    sampled = _stage(plan.random, jnp.logical_not(jnp.all(greedy)), random_tokens, lambda x: greedy_tokens, logits)
    tokens = jnp.where(greedy, greedy_tokens, sampled)

    logprobs, top_ids, top_logprobs = _stage(plan.logprobs, md.want_logprobs, _logprob_outputs, _no_logprob_outputs, raw, tokens)
    return SamplerOutput(tokens=tokens, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs)


class SamplingRow(NamedTuple):
    """What the host knows about one running request when it builds a step's sampling metadata (a tuple: a step
    builds one per row)."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    seed: int  # the request's seed, or one the engine drew for it; any non-negative int
    eos_token_ids: Sequence[int] = ()
    grammar: object | None = None  # structured outputs: a GrammarState (engine/structured_output.py), up to date
    draft: int = -1  # speculative decoding: the proposed token this row verifies (output_ids then end with the
    # proposals before it, as if already output)
    controls: object | None = None  # logit_bias, allowed_token_ids, bad_words: engine/token_controls.TokenControls


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def _seeds_u32(seeds: Sequence[int]) -> np.ndarray:
    """Folds seeds of up to 64 bits into the 32 that `jax.random.key` takes without x64."""
    wide = np.array(seeds, np.uint64)
    return ((wide ^ (wide >> np.uint64(32))) & np.uint64(0xFFFF_FFFF)).astype(np.uint32)


def _constants(params: SamplingParams) -> tuple[float, ...]:
    """A request's per-row sampler values that never change: (temperature, top_k, top_p, min_p, presence,
    frequency, repetition, min_tokens). A greedy row's truncation is neutral already (SamplingParams)."""
    temperature = 0.0 if params.is_greedy else params.temperature
    return (temperature, params.top_k, params.top_p, params.min_p, params.presence_penalty, params.frequency_penalty,
            params.repetition_penalty, params.min_tokens)  # fmt: skip


def _suppressed(row: SamplingRow) -> list[int]:
    """EOS and stop ids are forbidden until the row has min_tokens outputs (as vLLM)."""
    params = row.params
    if len(row.output_ids) >= params.min_tokens:
        return []
    ids = [] if params.ignore_eos else [int(t) for t in row.eos_token_ids]
    return list(dict.fromkeys(ids + params.stop_token_ids))


@functools.lru_cache(maxsize=64)
def _blank(shape: tuple[int, ...]) -> np.ndarray:
    """An all -1 array, shared and read-only: most steps need no history (no penalties) and no bitmask (no grammar),
    and a fresh multi-megabyte array per step costs the host page faults (~1 ms a step at 256 rows of a 128k
    vocabulary's bitmask) for a value the step never reads."""
    blank = np.full(shape, -1, np.int32)
    blank.flags.writeable = False
    return blank


def build_sampling_metadata(
    rows: Sequence[SamplingRow], num_rows: int, history_width: int, max_suppress: int = 64, mask_words: int = 1
) -> SamplingMetadata:
    """Host-side numpy metadata for `sample`, padded to `num_rows` greedy, neutral rows.

    The history is filled only when some row has a penalty; otherwise it is all -1 (same shape,
    so the same compile) and `sample` never reads it. `want_logprobs` is set by any row asking for
    logprobs, 0 included (the sampled id's own logprob). A row with a grammar gets its next allowed tokens in
    `bitmask` (`mask_words` words, covering the model's vocabulary); the others, all ones.
    """
    n = len(rows)
    prompt_lens = np.fromiter((len(r.prompt_ids) for r in rows), np.int32, n)
    step_index = np.fromiter((len(r.output_ids) for r in rows), np.int32, n)
    draft_ids = np.fromiter((r.draft for r in rows), np.int32, n)
    metadata = columns_metadata([r.params for r in rows], prompt_lens, step_index, [r.seed for r in rows], num_rows,
                                history_width, max_suppress, mask_words, draft_ids)  # fmt: skip
    # Only rows with something of their own (min_tokens, a grammar, penalties) are visited.
    min_tokens = np.fromiter((r.params.min_tokens for r in rows), np.int32, n)
    for i in np.flatnonzero(step_index < min_tokens):  # still short of min_tokens
        banned = _suppressed(rows[i])
        if len(banned) > max_suppress:
            raise ValueError(f"max_suppress ({max_suppress}) must be >= the ids row {i} suppresses ({len(banned)})")
        metadata.suppress_ids[i, : len(banned)] = banned
    controlled = [i for i, row in enumerate(rows) if row.controls is not None]
    if controlled:
        metadata = _with_token_controls(metadata, rows, controlled)
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if constrained:
        bitmask = metadata.bitmask if metadata.any_constrained else np.full((num_rows, mask_words), -1, np.int32)
        for i in constrained:
            grammar = rows[i].grammar
            if grammar.num_consumed != len(rows[i].output_ids):  # the engine syncs before such a step (design.md)
                raise RuntimeError(f"row {i}'s grammar has consumed {grammar.num_consumed} of {len(rows[i].output_ids)} outputs")
            allowed = bitmask[i].copy()  # allowed_token_ids' (all ones without)
            grammar.fill_bitmask(bitmask[i])
            bitmask[i] &= allowed
        metadata = dataclasses.replace(metadata, bitmask=bitmask, any_constrained=np.array(True))
    if metadata.any_penalty:
        history = np.full((num_rows, history_width), -1, np.int32)
        for i, row in enumerate(rows):
            k = len(row.prompt_ids)
            history[i, :k] = row.prompt_ids
            history[i, k : k + len(row.output_ids)] = row.output_ids
        metadata = dataclasses.replace(metadata, history=history)
    return metadata


def _with_token_controls(metadata: SamplingMetadata, rows: Sequence[SamplingRow], controlled: list[int]) -> SamplingMetadata:
    """Rows with logit_bias, bad words or allowed_token_ids: their biased ids, and their bitmask rows."""
    num_rows = metadata.temperature.shape[0]
    bias = np.full((num_rows, 2, LOGIT_BIAS_WIDTH), -1, np.int32)
    values = bias[:, 1].view(np.float32)
    bitmask, mask_logprobs = None, metadata.mask_logprobs.copy()
    for i in controlled:
        controls = rows[i].controls
        k = len(controls.bias_ids)
        bias[i, 0, :k] = controls.bias_ids
        values[i, :k] = controls.bias_values
        if controls.bad_words:
            banned = controls.banned(rows[i].output_ids)
            bias[i, 0, k : k + len(banned)] = banned
            values[i, k : k + len(banned)] = -np.inf
        if controls.allowed_mask is not None:
            if bitmask is None:
                bitmask = np.full((num_rows, controls.allowed_mask.shape[0]), -1, np.int32)
            bitmask[i] = controls.allowed_mask
            mask_logprobs[i] = rows[i].grammar is not None  # vLLM's logprobs are of the logits before this mask
    if bitmask is not None:
        metadata = dataclasses.replace(metadata, bitmask=bitmask, any_constrained=np.array(True))
    return dataclasses.replace(metadata, logit_bias=bias, mask_logprobs=mask_logprobs)


def columns_metadata(
    params: Sequence[SamplingParams], prompt_lens: np.ndarray, step_index: np.ndarray, seeds: Sequence[int],
    num_rows: int, history_width: int, max_suppress: int = 64, mask_words: int = 1, draft_ids: np.ndarray | None = None,
) -> SamplingMetadata:  # fmt: skip
    """The metadata of rows given as columns, with nothing suppressed, no grammar mask and no history filled in:
    complete for rows with no min_tokens still to reach, grammar, penalty or proposal (most steps: the input batch
    builds those without a SamplingRow per row); build_sampling_metadata adds the rest."""
    n = len(params)
    # Whole columns at once: each distinct SamplingParams' constants once (a batch usually shares a few), then
    # gathered per row.
    which: dict[int, int] = {}
    index = [which.setdefault(id(p), len(which)) for p in params]
    distinct = list({id(p): p for p in params}.values())
    table = np.array([_constants(p) for p in distinct] or [(0.0,) * 8], np.float64)
    return constants_metadata(
        table[index] if n else table[:0], _seeds_u32(seeds), prompt_lens, step_index, num_rows, history_width,
        np.full((num_rows, max_suppress), -1, np.int32), mask_words,
        any_penalty=any(p.has_penalties for p in distinct),
        any_top=any(p.uses_truncation for p in distinct if not p.is_greedy),
        want_logprobs=any(p.logprobs is not None for p in distinct), draft_ids=draft_ids,
    )  # fmt: skip


NEUTRAL_CONSTANTS = np.array([0.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0, 0])  # a padding row's _constants: greedy, no truncation


def constants_metadata(
    constants: np.ndarray, seeds_u32: np.ndarray, prompt_lens: np.ndarray, step_index: np.ndarray, num_rows: int,
    history_width: int, suppress_ids: np.ndarray, mask_words: int, *, any_penalty: bool, any_top: bool,
    want_logprobs: bool, draft_ids: np.ndarray | None = None,
) -> SamplingMetadata:  # fmt: skip
    """The metadata of n rows from their `_constants` ([n, 8]) and folded seeds, padded to num_rows neutral rows:
    columns_metadata's, and the input batch's from its slots' constants kept across steps."""
    n = len(constants)
    if n > num_rows:
        raise ValueError(f"num_rows ({num_rows}) must be >= the number of rows ({n})")
    longest = int((prompt_lens + step_index).max(initial=0))
    if history_width < longest:
        raise ValueError(f"history_width ({history_width}) must be >= the longest prompt + output ({longest})")

    def padded(column, fill, dtype=np.int32):
        out = np.full(num_rows, fill, dtype)
        if column is not None:
            out[:n] = column
        return out

    per_row = np.empty((num_rows, 8), np.float64)
    per_row[:n] = constants
    per_row[n:] = NEUTRAL_CONSTANTS
    f32 = np.float32
    return SamplingMetadata(
        temperature=per_row[:, 0].astype(f32),
        top_k=per_row[:, 1].astype(np.int32),
        top_p=per_row[:, 2].astype(f32),
        min_p=per_row[:, 3].astype(f32),
        presence_penalty=per_row[:, 4].astype(f32),
        frequency_penalty=per_row[:, 5].astype(f32),
        repetition_penalty=per_row[:, 6].astype(f32),
        seeds=padded(seeds_u32, 0, np.uint32),
        step_index=padded(step_index, 0),
        history=_blank((num_rows, history_width)),
        prompt_lens=padded(prompt_lens, 0),
        suppress_ids=suppress_ids,
        any_penalty=np.array(any_penalty),
        any_top=np.array(any_top),
        want_logprobs=np.array(want_logprobs),
        bitmask=_blank((num_rows, mask_words)),
        any_constrained=np.array(False),
        logit_bias=_blank((num_rows, 2, LOGIT_BIAS_WIDTH)),
        mask_logprobs=np.ones(num_rows, bool),
        draft_ids=padded(draft_ids, -1),
    )

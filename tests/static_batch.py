"""A static-batch generator over the paged KV cache, for parity tests that want raw logits.

Every sequence gets a fixed run of blocks, prompts are prefilled together in one flattened
step and decoded together; the engine's continuous batching replaces this for serving. It
gives every prompt position's logits, which the engine does not return.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxpaged import platforms
from jaxpaged.models.loader import DTYPES, LoadedModel
from jaxpaged.pallas_kernels import AttentionMetadata, kv_cache_shape, write_kv
from jaxpaged.pallas_kernels.state_cache import HybridCache


def _bucket(n: int, minimum: int = 16) -> int:
    """Next power of two: a handful of shapes, so a handful of compiles."""
    return max(minimum, 1 << (n - 1).bit_length())


class StaticBatchRunner:
    def __init__(self, loaded: LoadedModel, block_size: int = 16, matmul_backend: str = "auto"):
        self.loaded = loaded
        self.cfg = loaded.config
        self.block_size = block_size
        self.dtype = DTYPES[loaded.dtype]
        # the engine's matmuls, chosen and packed as ModelRunner does
        platforms.get().prepare_model(loaded.model, matmul_backend, dtype=self.dtype, tensor_parallel_size=1)
        self.graphdef, self.state = nnx.split(loaded.model)
        placed = {d for leaf in jax.tree_util.tree_leaves(self.state) if getattr(leaf, "committed", False) for d in leaf.devices()}
        self._device = placed.pop() if len(placed) == 1 else jax.devices()[0]
        self._model_step = jax.jit(self._model_step_impl)
        self._write_kv = jax.jit(write_kv, donate_argnums=(0,))

    def _forward(self, state, kv_cache, ids, positions, attn_metadata, logit_rows, temperature, key):
        logits, tokens, new_kv = self._model_step(state, kv_cache, ids, positions, attn_metadata, logit_rows, temperature, key)
        return logits, tokens, self._write_kv(kv_cache, new_kv, attn_metadata.slot_mapping)

    def _model_step_impl(self, state, kv_cache, ids, positions, attn_metadata, logit_rows, temperature, key):
        model = nnx.merge(self.graphdef, state)
        hidden, new_kv = model.forward(ids, positions, kv_cache, attn_metadata)
        logits = model.compute_logits(hidden[logit_rows])
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        scaled = logits / jnp.maximum(temperature, 1e-6)
        sampled = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
        return logits, jnp.where(temperature > 0, sampled, greedy), new_kv

    def _committed(self, tree):
        """On the model's device and committed there, as the steps' outputs are: jit keys its cache on that too, so
        a step fed an uncommitted cache (or token) first would compile once more when fed its own output."""
        return jax.device_put(tree, self._device)

    def _kv_cache(self, num_seqs: int, width: int):
        """The paged KV of every layer; a hybrid model's (models/hybrid.py): of its attention layers, beside a state
        slot per sequence (sequence i in slot i)."""
        cfg = self.cfg
        shape = kv_cache_shape(cfg.num_kv_layers, cfg.num_kv_heads, num_seqs * width, self.block_size, cfg.head_dim)
        kv = jnp.zeros(shape, self.dtype)
        spec = getattr(self.loaded.model, "state_spec", None)
        return self._committed(kv if spec is None else HybridCache(kv, spec().empty(num_seqs)))

    @property
    def _hybrid(self) -> bool:
        return hasattr(self.loaded.model, "state_spec")

    def _prefill_inputs(self, prompts: Sequence[Sequence[int]], width: int, start: int = 0, chunk: int | None = None,
                        padded: int | None = None):
        """One step of each prompt's tokens [start, start + chunk) (all of them without a chunk); prompts with none
        left take no row. Padded to `padded` tokens (default: the step's own bucket)."""
        rows = [i for i, p in enumerate(prompts) if len(p) > start]
        ends = np.array([len(prompts[i]) if chunk is None else min(len(prompts[i]), start + chunk) for i in rows], np.int32)
        lens = ends - start
        total = int(lens.sum())
        padded = padded or _bucket(total)
        ids = np.zeros(padded, np.int32)
        positions = np.zeros(padded, np.int32)
        slots = np.full(padded, -1, np.int32)
        query_start_loc = np.zeros(len(prompts) + 1, np.int32)
        query_start_loc[1 : len(rows) + 1] = np.cumsum(lens)
        query_start_loc[len(rows) + 1 :] = total
        seq_lens = np.zeros(len(prompts), np.int32)
        seq_lens[: len(rows)] = ends
        tables = np.zeros((len(prompts), width), np.int32)
        state_slots = np.full(len(prompts), len(prompts), np.int32)  # padded rows: out of range
        for r, i in enumerate(rows):
            at = query_start_loc[r]
            ids[at : at + lens[r]] = prompts[i][start : ends[r]]
            positions[at : at + lens[r]] = np.arange(start, ends[r])
            slots[at : at + lens[r]] = i * width * self.block_size + np.arange(start, ends[r])
            tables[r] = np.arange(i * width, (i + 1) * width)
            state_slots[r] = i
        attn_metadata = AttentionMetadata(
            slot_mapping=jnp.asarray(slots),
            block_tables=jnp.asarray(tables),
            seq_lens=jnp.asarray(seq_lens),
            query_start_loc=jnp.asarray(query_start_loc),
            state_slots=jnp.asarray(state_slots) if self._hybrid else None,
        )
        return jnp.asarray(ids), jnp.asarray(positions), attn_metadata, total, query_start_loc

    def _prefill(self, prompts, width, kv, chunk, all_logits: bool, temperature: float, key):
        """Every prompt through the model, in steps of `chunk` tokens per prompt (one step without): -> (each
        prompt's logits at every position, or None; its next token, the cache). Every step is padded to the first's
        bucket (no later step has more tokens): one compiled step per prefill, not one per step size."""
        longest = max(len(p) for p in prompts)
        logits = [[] for _ in prompts]
        tokens = [None] * len(prompts)
        padded = None
        for start in range(0, longest, chunk or longest):
            ids, positions, attn_metadata, total, qsl = self._prefill_inputs(prompts, width, start, chunk, padded)
            padded = ids.shape[0]
            live = [i for i, p in enumerate(prompts) if len(p) > start]
            rows = jnp.arange(ids.shape[0], dtype=jnp.int32) if all_logits else jnp.asarray(np.maximum(qsl[1:] - 1, 0))
            out, sampled, kv = self._forward(self.state, kv, ids, positions, attn_metadata, rows, temperature, key)
            out, sampled = np.asarray(out), np.asarray(sampled)
            for r, i in enumerate(live):
                if all_logits:
                    logits[i].append(out[qsl[r] : qsl[r + 1]])
                last = qsl[r + 1] - 1 if all_logits else r
                if start + (qsl[r + 1] - qsl[r]) == len(prompts[i]):
                    tokens[i] = int(sampled[last])
        return ([np.concatenate(x) for x in logits] if all_logits else None), tokens, kv

    def _check(self, prompts, max_new_tokens=0):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be non-empty lists of token ids")
        vocab = self.cfg.vocab_size
        for p in prompts:
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        longest = max(len(p) for p in prompts) + max_new_tokens
        if longest > self.cfg.max_position_embeddings:
            raise ValueError(
                f"prompt plus max_tokens ({longest}) exceeds the model's context ({self.cfg.max_position_embeddings})"
            )

    def prompt_logits(self, prompts: Sequence[Sequence[int]], prefill_chunk: int | None = None) -> list[np.ndarray]:
        """Float32 logits at every prompt position, all prompts in one ragged step (or, with prefill_chunk, in steps of
        that many tokens per prompt: the cache, and a hybrid model's states, carried from step to step)."""
        self._check(prompts)
        width = -(-max(len(p) for p in prompts) // self.block_size)
        kv = self._kv_cache(len(prompts), width)
        logits, _, _ = self._prefill(prompts, width, kv, prefill_chunk, True, 0.0, jax.random.key(0))
        return logits

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
        on_token: Callable[[int, int], None] | None = None,
        return_prompt_logits: bool = False,
        prefill_chunk: int | None = None,
    ):
        """Greedy (temperature 0) or sampled continuations; a sequence ends at a stop token or the limit.

        With return_prompt_logits, also the float32 logits at every prompt position (from the same
        prefill step, so a parity test compiles one prefill, not two): -> (outputs, logits per prompt).
        prefill_chunk: prompts go in steps of that many tokens each (chunked prefill).
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (got {temperature})")
        self._check(prompts, max_new_tokens)
        n = len(prompts)
        lens = np.array([len(p) for p in prompts], np.int32)
        width = -(-int((lens + max_new_tokens).max()) // self.block_size)
        kv = self._kv_cache(n, width)
        key = jax.random.key(seed)
        key, sub = jax.random.split(key)
        prompt_logits, tokens, kv = self._prefill(prompts, width, kv, prefill_chunk, return_prompt_logits, temperature, sub)
        tokens = self._committed(jnp.asarray(tokens, jnp.int32))

        outputs: list[list[int]] = [[] for _ in range(n)]
        done = np.zeros(n, bool)
        stops = set(stop_token_ids)
        tables = jnp.arange(n * width, dtype=jnp.int32).reshape(n, width)
        state_slots = jnp.arange(n, dtype=jnp.int32) if self._hybrid else None
        decode_query_start_loc = jnp.arange(n + 1, dtype=jnp.int32)
        rows = jnp.arange(n, dtype=jnp.int32)
        for step in range(max_new_tokens):
            host_tokens = np.asarray(tokens)
            for i in range(n):
                if done[i]:
                    continue
                outputs[i].append(int(host_tokens[i]))
                if on_token is not None:
                    on_token(i, int(host_tokens[i]))
                if host_tokens[i] in stops or len(outputs[i]) >= max_new_tokens:
                    done[i] = True
            if done.all():
                break
            pos = lens + step  # position of the token being fed
            attn_metadata = AttentionMetadata(
                slot_mapping=jnp.asarray(np.arange(n, dtype=np.int32) * width * self.block_size + pos),
                block_tables=tables,
                seq_lens=jnp.asarray(pos + 1),
                query_start_loc=decode_query_start_loc,
                state_slots=state_slots,
            )
            key, sub = jax.random.split(key)
            _, tokens, kv = self._forward(self.state, kv, tokens, jnp.asarray(pos), attn_metadata, rows, temperature, sub)
        return (outputs, prompt_logits) if return_prompt_logits else outputs

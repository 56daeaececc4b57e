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

    def _kv_cache(self, num_seqs: int, width: int):
        cfg = self.cfg
        shape = kv_cache_shape(cfg.num_layers, cfg.num_kv_heads, num_seqs * width, self.block_size, cfg.head_dim)
        return jnp.zeros(shape, self.dtype)

    def _prefill_inputs(self, prompts: Sequence[Sequence[int]], width: int):
        lens = np.array([len(p) for p in prompts], np.int32)
        total = int(lens.sum())
        padded = _bucket(total)
        ids = np.zeros(padded, np.int32)
        positions = np.zeros(padded, np.int32)
        slots = np.full(padded, -1, np.int32)
        query_start_loc = np.zeros(len(prompts) + 1, np.int32)
        query_start_loc[1:] = np.cumsum(lens)
        for i, prompt in enumerate(prompts):
            start = query_start_loc[i]
            ids[start : start + lens[i]] = prompt
            positions[start : start + lens[i]] = np.arange(lens[i])
            slots[start : start + lens[i]] = i * width * self.block_size + np.arange(lens[i])
        attn_metadata = AttentionMetadata(
            slot_mapping=jnp.asarray(slots),
            block_tables=jnp.arange(len(prompts) * width, dtype=jnp.int32).reshape(len(prompts), width),
            seq_lens=jnp.asarray(lens),
            query_start_loc=jnp.asarray(query_start_loc),
        )
        return jnp.asarray(ids), jnp.asarray(positions), attn_metadata, total, query_start_loc

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

    def prompt_logits(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Float32 logits at every prompt position, all prompts in one ragged step."""
        self._check(prompts)
        width = -(-max(len(p) for p in prompts) // self.block_size)
        ids, positions, attn_metadata, total, query_start_loc = self._prefill_inputs(prompts, width)
        rows = jnp.arange(ids.shape[0], dtype=jnp.int32)
        logits, _, _ = self._forward(
            self.state, self._kv_cache(len(prompts), width), ids, positions, attn_metadata, rows, 0.0, jax.random.key(0)
        )
        logits = np.asarray(logits)
        return [logits[query_start_loc[i] : query_start_loc[i + 1]] for i in range(len(prompts))]

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
    ):
        """Greedy (temperature 0) or sampled continuations; a sequence ends at a stop token or the limit.

        With return_prompt_logits, also the float32 logits at every prompt position (from the same
        prefill step, so a parity test compiles one prefill, not two): -> (outputs, logits per prompt).
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
        ids, positions, attn_metadata, _, query_start_loc = self._prefill_inputs(prompts, width)
        key, sub = jax.random.split(key)
        last = jnp.asarray(query_start_loc[1:] - 1)
        if return_prompt_logits:
            rows = jnp.arange(ids.shape[0], dtype=jnp.int32)
            logits, tokens, kv = self._forward(self.state, kv, ids, positions, attn_metadata, rows, temperature, sub)
            logits, tokens = np.asarray(logits), tokens[last]
            prompt_logits = [logits[query_start_loc[i] : query_start_loc[i + 1]] for i in range(n)]
        else:
            _, tokens, kv = self._forward(self.state, kv, ids, positions, attn_metadata, last, temperature, sub)

        outputs: list[list[int]] = [[] for _ in range(n)]
        done = np.zeros(n, bool)
        stops = set(stop_token_ids)
        tables = attn_metadata.block_tables
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
            )
            key, sub = jax.random.split(key)
            _, tokens, kv = self._forward(self.state, kv, tokens, jnp.asarray(pos), attn_metadata, rows, temperature, sub)
        return (outputs, prompt_logits) if return_prompt_logits else outputs

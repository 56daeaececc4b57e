"""Verifying proposals on the device, so sampled output follows the target's distribution exactly.

Proposers here give a point mass q = 1 on their token d, so the standard rule (accept with min(1, p/q), else
sample from max(0, p - q) renormalised) becomes: accept d with probability p(d), else sample from p with d
removed and renormalised. Then P(d) = p(d) and P(x) = (1 - p(d)) p(x) / (1 - p(d)) = p(x) for x != d.

The residual draw uses the same Gumbel noise as an ordinary draw of that row (argmax over the tokens != d), and
the acceptance test a uniform from a key folded off it, so a row without a proposal draws what `sample` would.
A row whose output equals its proposal accepted it; any other output is a rejection's (or a bonus row's) token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACCEPT_STREAM = 0x5EC  # folded into a row's key for its acceptance uniform


def _noise_key(seed, step):
    return jax.random.fold_in(jax.random.key(seed), step)


def verify_proposals(logits: jax.Array, draft_ids: jax.Array, seeds: jax.Array, step_index: jax.Array) -> jax.Array:
    """Tokens for rows of processed logits [S, V] (temperature and truncation applied); draft_ids [S] is each row's
    proposed token or -1. Rows without a proposal get the Gumbel-max draw `sample` gives them."""
    vocab = logits.shape[1]

    def row_noise(seed, step):
        key = _noise_key(seed, step)
        return jax.random.gumbel(key, (vocab,), logits.dtype), jax.random.uniform(jax.random.fold_in(key, ACCEPT_STREAM))

    gumbel, uniform = jax.vmap(row_noise)(seeds, step_index)
    perturbed = logits + gumbel
    has_draft = draft_ids >= 0
    draft = jnp.maximum(draft_ids, 0)
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    residual = _argmax(jnp.where(has_draft[:, None] & (ids == draft[:, None]), -jnp.inf, perturbed))
    probs = jax.nn.softmax(logits, axis=-1)
    p_draft = jnp.take_along_axis(probs, draft[:, None], axis=-1)[:, 0]
    accept = uniform < p_draft
    return jnp.where(has_draft, jnp.where(accept, draft, residual), _argmax(perturbed)).astype(jnp.int32)


def _argmax(x: jax.Array) -> jax.Array:
    from jaxpaged.worker.sampler import first_argmax  # the sampler's (the same tie rule as its own draws)

    return first_argmax(x)

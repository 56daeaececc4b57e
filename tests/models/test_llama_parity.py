"""The Llama port against transformers, in float32: logits within 1e-4, 64 greedy tokens identical."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpaged.models.loader import load_model

from tests.hf_reference import hf_greedy, hf_logits, random_hf_model, random_prompts, save_hf_model, tiny_llama_config
from tests.static_batch import StaticBatchRunner

CONFIGS = {
    "mha-untied": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa3-tied-llama3": dict(
        num_attention_heads=6, num_key_value_heads=2, hidden_size=96, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
    ),
    "gqa4-linear-bias": dict(
        num_attention_heads=8, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    ),
    "mqa-headdim32": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32, num_hidden_layers=3),
}
PROMPT_LENGTHS = [1, 5, 17, 40, 100]


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def pair(request, tmp_path_factory):
    config = tiny_llama_config(**CONFIGS[request.param])
    hf = random_hf_model(config)
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_model(str(folder), dtype="float32")


def test_config_features_reach_the_port(pair):
    hf, loaded = pair
    cfg = loaded.config
    assert cfg.num_kv_heads == hf.config.num_key_value_heads
    assert cfg.head_dim == getattr(hf.config, "head_dim", cfg.hidden_size // cfg.num_heads)
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (loaded.model.lm_head is None) == cfg.tie_word_embeddings


def test_logits_match_transformers(pair):
    hf, loaded = pair
    prompts = random_prompts(hf.config.vocab_size, PROMPT_LENGTHS)
    ours = StaticBatchRunner(loaded).prompt_logits(prompts)  # all prompts in one ragged step
    for prompt, got in zip(prompts, ours):
        want = hf_logits(hf, prompt)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_greedy_64_tokens_match_transformers(pair):
    hf, loaded = pair
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 21, 50, 77], seed=7)
    ours = StaticBatchRunner(loaded, block_size=8).generate(prompts, 64)
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(hf, prompt, 64)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend's fusion is what this guards against")
def test_rope_sin_and_cos_are_computed_once_per_step(pair):
    """Not once per layer and head: fused into the rotation, XLA:CPU recomputed them for every element of q/k."""
    _, loaded = pair
    runner = StaticBatchRunner(loaded)
    ids, positions, attn_metadata, _, _ = runner._prefill_inputs([[3, 4, 5], [6, 7]], width=2)
    cache = runner._kv_cache(2, 2)
    rows = jnp.zeros(2, jnp.int32)
    hlo = runner._model_step.lower(runner.state, cache, ids, positions, attn_metadata, rows, 0.0, jax.random.key(0)).compile().as_text()
    assert loaded.config.num_layers >= 2
    # one merged conditional computes them; its two branches are the same computation
    assert hlo.count(" sine(") <= 2 and hlo.count(" cosine(") <= 2, (hlo.count(" sine("), hlo.count(" cosine("))

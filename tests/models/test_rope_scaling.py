"""RoPE scalings (yarn, dynamic NTK, longrope) against transformers' own rotary embedding and end to end in Llama.

transformers decides dynamic/longrope once per forward from max(position_ids) + 1; jaxpaged decides per token (from
its row's sequence length here, and through the engine by core/rope_regime.py's rule), so each row of a mixed step
must equal transformers' forward of that one request.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from jaxpaged.models.config import rope_from_hf
from jaxpaged.models.layers import rope_table
from jaxpaged.models.loader import load_model
from jaxpaged.pallas_kernels import AttentionMetadata

from tests.hf_reference import hf_greedy, hf_logits, random_hf_model, random_prompts, save_hf_model, tiny_llama_config
from tests.static_batch import StaticBatchRunner

torch = pytest.importorskip("torch")

ORIGINAL = 32  # original_max_position_embeddings (longrope/yarn) and max_position_embeddings (dynamic)
HALF = 8  # head_dim 16 -> 8 frequencies
LONG = [1.0 + 0.7 * i for i in range(HALF)]
SHORT = [1.0 + 0.05 * i for i in range(HALF)]

# name -> (rope_parameters, max_position_embeddings)
ROPES = {
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}, 128),
    "yarn-mscale-untruncated-betas": (
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL, "mscale": 0.707,
         "mscale_all_dim": 1.0, "truncate": False, "beta_fast": 16, "beta_slow": 2}, 256,
    ),
    "yarn-attention-factor": (
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": ORIGINAL, "attention_factor": 0.8}, 64,
    ),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, ORIGINAL),
    "longrope": (
        {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
         "original_max_position_embeddings": ORIGINAL}, 128,
    ),
    "longrope-attention-factor": (
        {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 3.0,
         "original_max_position_embeddings": ORIGINAL, "attention_factor": 1.3}, 128,
    ),
}  # fmt: skip


def _config(name: str, **overrides):
    params, max_pos = ROPES[name]
    kwargs = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos)
    kwargs.update(overrides)
    return tiny_llama_config(rope_parameters={"rope_theta": 10000.0, **params}, **kwargs)


def _reset(module) -> None:
    """transformers' dynamic RoPE keeps the longest length it saw; each reference call starts as a fresh model."""
    for m in module.modules():
        if hasattr(m, "original_inv_freq") and hasattr(m, "max_seq_len_cached"):
            m.register_buffer("inv_freq", m.original_inv_freq.clone(), persistent=False)
            m.max_seq_len_cached = m.original_max_seq_len


def _hf_table(rotary, positions: list[int]):
    _reset(rotary)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, torch.tensor([positions]))
    return cos[0].numpy(), sin[0].numpy()


def _metadata(rows: list[list[int]]) -> AttentionMetadata:
    """One step holding each row's positions (a prefill chunk or a decode token), as the engine lays them out."""
    lens = [len(r) for r in rows]
    return AttentionMetadata(
        slot_mapping=jnp.zeros(sum(lens), jnp.int32), block_tables=jnp.zeros((len(rows), 1), jnp.int32),
        seq_lens=jnp.asarray([r[-1] + 1 for r in rows] + [0], jnp.int32),  # a padded slot, as the engine adds
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(lens), [sum(lens)]]), jnp.int32),
    )  # fmt: skip


@pytest.mark.parametrize("name", list(ROPES))
def test_cos_sin_match_transformers_rotary_embedding_per_row(name):
    """A prefill below the switch, one above, and decode tokens on both sides of it, all in one step."""
    config = _config(name)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    rope, context = rope_from_hf(config), config.max_position_embeddings
    rows = [list(range(20)), list(range(context)), [ORIGINAL - 1], [ORIGINAL], [context - 1], list(range(ORIGINAL + 1))]
    positions = jnp.asarray(sum(rows, []), jnp.int32)
    cos, sin = rope_table(rope, positions, 16, _metadata(rows))
    start = 0
    for row in rows:
        want_cos, want_sin = _hf_table(rotary, row)
        got = slice(start, start + len(row))
        np.testing.assert_allclose(np.asarray(cos[got]), want_cos, atol=2e-6, rtol=0, err_msg=str(row[-1]))
        np.testing.assert_allclose(np.asarray(sin[got]), want_sin, atol=2e-6, rtol=0, err_msg=str(row[-1]))
        start += len(row)


def test_the_long_tables_really_differ_past_the_switch():
    """Guards the test above: the rows it compares straddle a change that matters."""
    for name in ("dynamic", "longrope"):
        rope = rope_from_hf(_config(name))
        rows = [[ORIGINAL - 1], [ORIGINAL]]
        cos, _ = rope_table(rope, jnp.asarray([20, 20], jnp.int32), 16, _metadata(rows))
        assert np.abs(np.asarray(cos[0] - cos[1])).max() > 1e-3, name


def test_bad_rope_parameters_are_value_errors():
    def config(**rope):  # a config.json's fields, unvalidated
        return SimpleNamespace(rope_parameters=rope, max_position_embeddings=128)

    with pytest.raises(ValueError, match="long_factor"):
        rope_from_hf(config(rope_type="longrope", short_factor=SHORT))
    with pytest.raises(ValueError, match="'mrope'"):
        rope_from_hf(config(rope_type="mrope", factor=2.0))
    with pytest.raises(ValueError, match="longrope factors have 3 entries"):
        rope_table(rope_from_hf(config(rope_type="longrope", short_factor=[1.0] * 3, long_factor=[1.0] * 3)),
                   jnp.zeros(2, jnp.int32), 16)


# -- end to end: a Llama with each scaling ------------------------------------------------------------


@pytest.fixture(scope="module", params=["yarn-mscale-untruncated-betas", "dynamic", "longrope"])
def pair(request, tmp_path_factory):
    config = _config(request.param, head_dim=16, hidden_size=64)
    hf = random_hf_model(config)
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_model(str(folder), dtype="float32")


def test_llama_logits_match_transformers(pair):
    """Prompts shorter and longer than the switch length, in one ragged step."""
    hf, loaded = pair
    prompts = random_prompts(hf.config.vocab_size, [5, ORIGINAL, ORIGINAL + 9, 70])
    ours = StaticBatchRunner(loaded, block_size=8).prompt_logits(prompts)
    for prompt, got in zip(prompts, ours):
        _reset(hf)
        np.testing.assert_allclose(got, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_llama_greedy_matches_transformers_across_the_switch(pair):
    """The 25-token prompt crosses the switch while decoding; the 40-token one starts past it."""
    hf, loaded = pair
    prompts = random_prompts(hf.config.vocab_size, [3, 25, 40], seed=7)
    ours = StaticBatchRunner(loaded, block_size=8).generate(prompts, 24)
    for prompt, got in zip(prompts, ours):
        _reset(hf)
        assert got == hf_greedy(hf, prompt, 24)


# -- through the engine: chunked prefill and preemption ---------------------------------------------------------


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_llama_engine_matches_transformers_under_chunks_and_preemption(name, tmp_path):
    """transformers' Llama keeps its cache: a prompt's keys use the prompt's length, each later token its own
    (core/rope_regime.py). The engine gives each key that length however the prompt is split: 16-token chunks
    under a 32-token switch, and recomputes after preemption from a 12-block pool; prompts on both sides of the
    switch, some crossing it while decoding."""
    from jaxpaged import LLM, SamplingParams

    hf = random_hf_model(_config(name, head_dim=16, hidden_size=64))
    folder = save_hf_model(hf, tmp_path / name)
    rng = np.random.default_rng(2)
    prompts = random_prompts(hf.config.vocab_size, [3, 20, 28, ORIGINAL, 40, 55], seed=4)
    max_tokens = rng.integers(10, 20, size=len(prompts)).tolist()
    expected = []
    for prompt, m in zip(prompts, max_tokens):
        _reset(hf)
        expected.append(hf_greedy(hf, prompt, m))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm = LLM(str(folder), dtype="float32", block_size=8, max_num_seqs=4, max_num_batched_tokens=16,
              num_kv_blocks=12, log_level="WARNING")  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and llm.engine.scheduler.num_rope_recomputes == 0

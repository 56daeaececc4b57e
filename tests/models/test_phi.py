"""Phi-2 and Phi-3/3.5/4-mini against transformers, in float32: logits within 1e-4, greedy tokens identical; and
Phi-3 with LongRoPE through the engine, with chunked prefill and with preemption."""

from __future__ import annotations

import types

import numpy as np
import pytest
import transformers
from jaxpaged import LLM, SamplingParams
from jaxpaged.models.loader import load_model

from tests.hf_reference import hf_greedy, hf_logits, random_hf_model, random_prompts, save_hf_model
from tests.static_batch import StaticBatchRunner

VOCAB = 256
ORIGINAL = 24  # original_max_position_embeddings: LongRoPE's switch from short to long factors
CHUNK = 16  # the engine's max_num_batched_tokens in the chunked-prefill test
PHI3_LIKE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=128,
    rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=0,
)  # fmt: skip


def _longrope(rotary_dim: int, **extra) -> dict:
    half = rotary_dim // 2
    return dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.1 * i for i in range(half)],
        long_factor=[1.0 + 1.5 * i for i in range(half)], **extra,
    )  # fmt: skip


PHI_LIKE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=128,
    bos_token_id=0, eos_token_id=1, pad_token_id=0,
)  # fmt: skip

# name -> (config, architecture the loader must pick)
CASES = {
    "phi3-mini-longrope": (
        transformers.Phi3Config(**PHI3_LIKE, num_attention_heads=4, num_key_value_heads=4,
                                original_max_position_embeddings=ORIGINAL, rope_scaling=_longrope(16)),
        "Phi3ForCausalLM",
    ),
    "phi4-mini-like-gqa-partial-rotary-tied": (  # Phi-4-mini: GQA, rotary on 3/4 of each head, tied
        transformers.Phi3Config(**PHI3_LIKE, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75,
                                rope_scaling=_longrope(12, partial_rotary_factor=0.75)),
        "Phi3ForCausalLM",
    ),
    "phi3-window12-default-rope": (
        transformers.Phi3Config(**PHI3_LIKE, num_attention_heads=4, num_key_value_heads=1, sliding_window=12),
        "Phi3ForCausalLM",
    ),
    "phi2-partial-rotary": (
        transformers.PhiConfig(**PHI_LIKE, num_attention_heads=4, partial_rotary_factor=0.5),
        "PhiForCausalLM",
    ),
    "phi-qk-layernorm-gqa-tied": (
        transformers.PhiConfig(**PHI_LIKE, num_attention_heads=4, num_key_value_heads=2, qk_layernorm=True,
                               partial_rotary_factor=0.25, tie_word_embeddings=True, hidden_act="gelu"),
        "PhiForCausalLM",
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def pair(request, tmp_path_factory):
    config, arch = CASES[request.param]
    hf = random_hf_model(config)
    loaded = load_model(str(save_hf_model(hf, tmp_path_factory.mktemp(request.param))), dtype="float32")
    assert loaded.config.architecture == arch
    return hf, loaded


def test_config_features_reach_the_port(pair):
    hf, loaded = pair
    cfg, rope = loaded.config, hf.config.rope_parameters
    assert cfg.rotary_dim == int(cfg.head_dim * rope.get("partial_rotary_factor", 1.0))
    assert cfg.rope.rope_type == rope["rope_type"]
    assert cfg.num_kv_heads == hf.config.num_key_value_heads
    assert cfg.window(0) == getattr(hf.config, "sliding_window", None)


def test_logits_match_transformers(pair):
    """Prompts on both sides of LongRoPE's switch (24), in one ragged step."""
    hf, loaded = pair
    prompts = random_prompts(VOCAB, [1, 9, ORIGINAL, 41])
    ours = StaticBatchRunner(loaded, block_size=8).prompt_logits(prompts)
    for prompt, got in zip(prompts, ours):
        np.testing.assert_allclose(got, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_greedy_matches_transformers(pair):
    """Prompts below LongRoPE's switch that stay below it, and one past it from the start."""
    hf, loaded = pair
    prompts = random_prompts(VOCAB, [3, 6, 33], seed=7)
    ours = StaticBatchRunner(loaded, block_size=8).generate(prompts, 18)
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(hf, prompt, 18)


# -- Phi-3 with LongRoPE through the engine -------------------------------------------------------------


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """The LongRoPE model saved, and a greedy reference from transformers' own Phi-3 generation (which recomputes a
    sequence with the long factors when it first grows past the switch)."""
    config, _ = CASES["phi3-mini-longrope"]
    hf = random_hf_model(config)
    folder = str(save_hf_model(hf, tmp_path_factory.mktemp("phi3-engine")))
    expected = {}

    def reference(prompts, max_tokens) -> list[list[int]]:
        for p, m in zip(prompts, max_tokens):
            if (tuple(p), m) not in expected:
                expected[tuple(p), m] = hf_greedy(hf, p, m)
        return [expected[tuple(p), m] for p, m in zip(prompts, max_tokens)]

    return folder, reference


def _engine_greedy(llm: LLM, prompts, max_tokens) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _llm(folder: str, **kwargs) -> LLM:
    return LLM(folder, dtype="float32", block_size=8, log_level="WARNING", **kwargs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_decoding_across_the_switch_recomputes_as_transformers(phi3, async_scheduling):
    """Prompts under the switch (24) whose outputs cross it: each sequence is recomputed with the long factors once,
    as transformers' Phi-3 generation drops its cache there; tokens equal its greedy ones throughout. Without the
    recompute (the short-factor keys kept) these tokens differ (checked: test_keeping_short_keys_would_differ)."""
    folder, reference = phi3
    prompts, max_tokens = random_prompts(VOCAB, [3, 10, 20, ORIGINAL], seed=7), [30, 24, 12, 6]
    llm = _llm(folder, max_num_seqs=4, max_num_batched_tokens=64, async_scheduling=async_scheduling)  # 57 + outputs
    assert _engine_greedy(llm, prompts, max_tokens) == reference(prompts, max_tokens)
    stats = llm.get_stats()
    assert llm.engine.scheduler.num_rope_recomputes == 4 and stats["num_preemptions"] == 0
    assert stats["num_compiles_after_warmup"] == 0  # the step's shapes are the same in both regimes


def test_keeping_short_keys_would_differ(phi3):
    """The recompute matters for this model: transformers' generic generation, which keeps the short-factor keys
    past the switch, gives other tokens than its Phi-3 generation on the crossing prompt."""
    folder, reference = phi3
    config, _ = CASES["phi3-mini-longrope"]
    hf = random_hf_model(config)
    hf.prepare_inputs_for_generation = types.MethodType(transformers.GenerationMixin.prepare_inputs_for_generation, hf)
    prompt = random_prompts(VOCAB, [3], seed=7)[0]
    assert hf_greedy(hf, prompt, 30) != reference([prompt], [30])[0]


def test_engine_chunked_prefill_matches_transformers(phi3):
    """Prompts past the switch prefilled in 16-token chunks, the first ending before the switch: every chunk uses the
    long factors, as transformers' whole-prompt forward; two sequences at a time, mixing chunks and decode rows."""
    folder, reference = phi3
    rng = np.random.default_rng(3)
    prompts = random_prompts(VOCAB, rng.integers(ORIGINAL + 1, 60, size=6).tolist(), seed=5) + random_prompts(VOCAB, [12, 20], seed=6)
    max_tokens = rng.integers(8, 24, size=8).tolist()
    llm = _llm(folder, max_num_seqs=2, max_num_batched_tokens=CHUNK)
    assert llm.engine.loaded.config.architecture == "Phi3ForCausalLM"
    assert _engine_greedy(llm, prompts, max_tokens) == reference(prompts, max_tokens)


def test_engine_preemption_matches_transformers(phi3):
    """A KV pool too small for the batch: sequences are preempted and recomputed (with their outputs, in the regime
    of their whole length), some prompts long, some crossing the switch while decoding."""
    folder, reference = phi3
    rng = np.random.default_rng(4)
    prompts = random_prompts(VOCAB, rng.integers(4, 50, size=8).tolist(), seed=8)
    max_tokens = rng.integers(12, 28, size=8).tolist()
    llm = _llm(folder, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=16)
    assert _engine_greedy(llm, prompts, max_tokens) == reference(prompts, max_tokens)
    assert llm.get_stats()["num_preemptions"] > 0


def test_engine_prefix_cache_keeps_the_regimes_apart(phi3):
    """Cached blocks computed with the short factors serve only short-regime sequences: a prompt past the switch
    sharing a cached short prompt's first blocks computes them again, a later one finds the long blocks it left."""
    folder, reference = phi3
    short = random_prompts(VOCAB, [20], seed=9)[0]
    long = short + random_prompts(VOCAB, [10], seed=10)[0]
    llm = _llm(folder, max_num_seqs=2, max_num_batched_tokens=32, enable_prefix_caching=True)  # each prompt one step
    stats = llm.engine.scheduler.kv
    for prompt, hits in ((short, 0), (short, 16), (long, 0), (long + [5], 24)):
        before = stats.prefix_cache_hits
        assert _engine_greedy(llm, [prompt], [3]) == reference([prompt], [3])
        assert stats.prefix_cache_hits - before == hits, len(prompt)


def test_engine_speculation_stops_at_the_switch(phi3):
    """ngram proposals for repetitive prompts under the switch: a short-regime sequence verifies no position past it
    (it is recomputed there), so greedy tokens stay transformers' while proposals are accepted on both sides."""
    folder, reference = phi3
    prompts = [p * 3 for p in random_prompts(VOCAB, [3, 4, 5, 6, 7], seed=11)]
    max_tokens = [30] * len(prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = _llm(folder, max_num_seqs=8, max_num_batched_tokens=128, speculative_config=spec)  # the 75 prompt tokens
    scheduler, verified = llm.engine.scheduler, []  # (short regime?, the sequence's length at its last verified row)
    schedule = scheduler.schedule

    def spy():
        output = schedule()
        verified.extend((not item.request.rope_key, item.start + 1 + len(item.draft_token_ids))
                        for item in output.scheduled if item.draft_token_ids)  # fmt: skip
        return output

    scheduler.schedule = spy
    assert _engine_greedy(llm, prompts, max_tokens) == reference(prompts, max_tokens)
    assert llm.get_stats()["spec_decode_num_accepted_tokens"] > 0 and scheduler.num_rope_recomputes == len(prompts)
    assert max(n for short, n in verified if short) == ORIGINAL  # up to the switch, never past it
    assert any(not short for short, _ in verified)  # and in the long regime after the recompute

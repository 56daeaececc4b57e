"""Shared KV blocks: n > 1 forks with copy-on-write, automatic prefix caching, and preemption on top of both."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.core.kv_cache_manager import blocks_for
from tests.hf_reference import hf_greedy, random_hf_model, random_prompts, tiny_llama_config

VOCAB = 256
BS = 16


@pytest.fixture(scope="module")
def hf_model():
    return random_hf_model(tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048))


def _llm(model_dir, **kw) -> LLM:
    kw = {"dtype": "float32", "max_num_seqs": 16, "max_num_batched_tokens": 256, "block_size": BS,
          "log_level": "WARNING", **kw}  # fmt: skip
    return LLM(model_dir, **kw)


@pytest.fixture(scope="module")
def llm(model_dir):
    return _llm(model_dir)


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def _assert_all_blocks_back(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_n8_shares_the_prompt_blocks_once(llm):
    prompt = random_prompts(VOCAB, [1000], seed=1)[0]
    engine = llm.engine
    params = SamplingParams(n=8, temperature=1.0, seed=99, max_tokens=24, ignore_eos=True)
    engine.add_request("fan", {"prompt_token_ids": prompt}, params)
    seqs = engine.output_processor.parents["fan"].sequences
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        computed = {s.num_computed_tokens for s in seqs}
        if all(s.status.value == "running" for s in seqs) and len(computed) == 1 and computed.pop() > 1000:
            tables = [engine.scheduler.kv.block_table(s.seq_id) for s in seqs]
            shared = (len(prompt) - 1) // BS  # full blocks of the prompt but its last token: computed once
            own = blocks_for(seqs[0].num_computed_tokens, BS) - shared
            assert llm.get_stats()["kv_blocks_used"] == shared + 8 * own
            assert all(t[:shared] == tables[0][:shared] for t in tables)
            tails = [b for t in tables for b in t[shared:]]
            assert len(set(tails)) == len(tails) == 8 * own  # the partial block was copied on write
            checked += 1
    assert checked >= 10
    out = engine.output_processor.parents.get("fan")
    assert out is None  # finished and released
    _assert_all_blocks_back(llm)


def test_forked_samples_equal_independent_runs_and_differ(llm):
    prompt = random_prompts(VOCAB, [101], seed=2)[0]  # ends partway through a block
    params = SamplingParams(n=6, temperature=1.0, seed=1234, max_tokens=30, ignore_eos=True)
    forked = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    samples = [c.token_ids for c in forked.outputs]
    assert len(set(map(tuple, samples))) == 6  # temperature > 0: they differ
    again = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == samples  # the seed reproduces them
    for i, tokens in enumerate(samples):  # sample i uses seed + i: the same tokens without any sharing
        alone = SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=30, ignore_eos=True)
        assert llm.generate([{"prompt_token_ids": prompt}], alone, use_tqdm=False)[0].outputs[0].token_ids == tokens
    _assert_all_blocks_back(llm)


def test_shared_512_token_prefix_is_computed_once(model_dir, hf_model):
    llm = _llm(model_dir)
    prefix = random_prompts(VOCAB, [512], seed=3)[0]
    first = prefix + [5, 6, 7]
    second = prefix + random_prompts(VOCAB, [40], seed=4)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate([{"prompt_token_ids": first}], greedy, use_tqdm=False)
    before = llm.get_stats()
    out = llm.generate([{"prompt_token_ids": second}], greedy, use_tqdm=False)[0]
    after = llm.get_stats()
    assert out.num_cached_tokens == 512
    # only the 40 new prompt tokens and the generated ones (all but the last) went through the model
    assert after["num_computed_tokens"] - before["num_computed_tokens"] == 40 + 12 - 1
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == len(second)
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 512
    assert out.outputs[0].token_ids == hf_greedy(hf_model, second, 12)
    assert after["kv_blocks_cached"] > 0 and after["kv_blocks_free"] == after["kv_blocks_total"]  # cached = free

    no_cache = _llm(model_dir, enable_prefix_caching=False)
    no_cache.generate([{"prompt_token_ids": first}], greedy, use_tqdm=False)
    again = no_cache.generate([{"prompt_token_ids": second}], greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == out.outputs[0].token_ids
    assert no_cache.get_stats()["prefix_cache_hits"] == 0 and no_cache.get_stats()["kv_blocks_cached"] == 0


def test_cached_blocks_are_evicted_least_recently_used_first(model_dir):
    llm = _llm(model_dir, num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=64)
    a, b, c = random_prompts(VOCAB, [129, 129, 129], seed=5)  # 8 full blocks each, one token to compute
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for p in (a, b):
        llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)
    # c needs 9 blocks, 6 of which are truly free: the 3 oldest cached ones go, and they are a's.
    llm.generate([{"prompt_token_ids": c}], one, use_tqdm=False)
    hit_b = llm.generate([{"prompt_token_ids": b}], one, use_tqdm=False)[0].num_cached_tokens
    hit_a = llm.generate([{"prompt_token_ids": a}], one, use_tqdm=False)[0].num_cached_tokens
    assert hit_b == 128
    assert hit_a < 128
    _assert_all_blocks_back(llm)


def test_preemption_with_shared_blocks_gives_identical_output(model_dir):
    prefix = random_prompts(VOCAB, [70], seed=6)[0]
    rng = np.random.default_rng(7)
    prompts = [prefix + random_prompts(VOCAB, [int(rng.integers(1, 30))], seed=100 + i)[0] for i in range(10)]
    prompts += random_prompts(VOCAB, rng.integers(5, 60, size=6).tolist(), seed=8)
    params = [
        SamplingParams(n=int(rng.integers(1, 4)), temperature=1.0, seed=10 + i, max_tokens=int(rng.integers(10, 40)),
                       ignore_eos=True)
        for i in range(len(prompts))
    ]  # fmt: skip
    batch = [{"prompt_token_ids": p} for p in prompts]
    roomy = _tokens(_llm(model_dir).generate(batch, params, use_tqdm=False))
    tight = _llm(model_dir, num_kv_blocks=20, max_num_seqs=8, max_num_batched_tokens=64)
    assert _tokens(tight.generate(batch, params, use_tqdm=False)) == roomy
    stats = tight.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    _assert_all_blocks_back(tight)

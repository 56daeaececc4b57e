"""The engine on windowed models whose out-of-window KV blocks go back to the pool: tiny random Mistral (every layer
windowed) and Qwen2 with `layer_types`, float32, sequences several windows long. Greedy output equals transformers
and the engine without freeing, through chunked prefill, preemption, prefix caching, n > 1 and beam search; no
compiles after warm-up; a long sequence holds about its window's blocks; every block comes back."""

from __future__ import annotations

import contextlib

import pytest
import transformers

from jaxpaged import LLM, BeamSearchParams, SamplingParams
from jaxpaged.core.kv_cache_manager import max_blocks_held
from tests.hf_reference import hf_greedy, random_hf_model, random_prompts

VOCAB = 256
WINDOW = 12
BS = 4
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0, sliding_window=WINDOW)  # fmt: skip
CONFIGS = {
    "mistral": lambda: transformers.MistralConfig(**TINY),
    "qwen2-layer-types": lambda: transformers.Qwen2Config(
        **TINY, use_sliding_window=True, max_window_layers=0, layer_types=["sliding_attention"] * 2
    ),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def hf_model(request):
    return random_hf_model(CONFIGS[request.param]())


def _llm(model_dir, **kw) -> LLM:
    kw = {"dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 16, "block_size": BS, "log_level": "WARNING",
          **kw}  # fmt: skip
    return LLM(model_dir, **kw)


@pytest.fixture(scope="module")
def llm(model_dir):
    return _llm(model_dir)


@pytest.fixture(scope="module")
def workload(hf_model):
    """Prompts of up to 3 windows (chunked at 16 tokens a step) and outputs that run several windows past them."""
    lengths, max_tokens = [5, 23, 40, 13], [40, 30, 36, 44]
    prompts = random_prompts(VOCAB, lengths, seed=3)
    return prompts, max_tokens, [hf_greedy(hf_model, p, m) for p, m in zip(prompts, max_tokens)]


def _greedy(m: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)


def _run(llm: LLM, prompts, params) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@contextlib.contextmanager
def _without_freeing(llm: LLM):
    """The same engine keeping every block (the window only a mask), between requests."""
    kv = llm.engine.scheduler.kv
    window, kv.sliding_window = kv.sliding_window, None
    try:
        yield
    finally:
        kv.sliding_window = window


def _assert_clean(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_compiles_after_warmup"] == 0


def _spy_blocks(llm: LLM) -> list[tuple[int, int]]:
    """(blocks in use, tokens of the longest scheduled sequence) after every schedule()."""
    scheduler, seen = llm.engine.scheduler, []
    original = scheduler.schedule

    def spy():
        out = original()
        longest = max((s.start + s.num_tokens for s in out.scheduled), default=0)
        seen.append((scheduler.kv.pool.num_used, longest))
        return out

    scheduler.schedule = spy
    return seen


def test_greedy_equals_transformers_and_the_engine_without_freeing(llm, workload):
    prompts, max_tokens, expected = workload
    assert llm.engine.scheduler.kv.sliding_window == WINDOW
    got = _run(llm, prompts, [_greedy(m) for m in max_tokens])
    assert [g[0] for g in got] == expected
    _assert_clean(llm)
    with _without_freeing(llm):
        assert [g[0] for g in _run(llm, prompts, [_greedy(m) for m in max_tokens])] == expected
    _assert_clean(llm)


def test_a_long_sequence_holds_about_its_window(llm, hf_model):
    prompt = random_prompts(VOCAB, [30], seed=8)[0]
    seen = _spy_blocks(llm)
    try:
        out = _run(llm, [prompt], [_greedy(120)])
    finally:
        del llm.engine.scheduler.schedule
    assert out[0][0] == hf_greedy(hf_model, prompt, 120)
    decode_bound = -(-WINDOW // BS) + 1
    assert max(used for used, _ in seen) <= max_blocks_held(150, BS, WINDOW, 16)
    assert max(used for used, n in seen if n > 30 + 16) <= decode_bound  # 150 tokens would be 38 blocks
    _assert_clean(llm)


def test_prefix_cache_hit_on_a_windowed_prompt(llm, hf_model):
    prompt = random_prompts(VOCAB, [45], seed=21)[0]
    want = hf_greedy(hf_model, prompt, 10)
    hits = llm.get_stats()["prefix_cache_hits"]
    assert _run(llm, [prompt], [_greedy(10)])[0][0] == want
    assert _run(llm, [prompt], [_greedy(10)])[0][0] == want  # served from the window's cached blocks
    assert llm.get_stats()["prefix_cache_hits"] > hits
    _assert_clean(llm)


def test_n_samples_and_beams_equal_the_engine_without_freeing(llm):
    prompts = random_prompts(VOCAB, [9, 26], seed=5)
    sampled = [SamplingParams(n=3, temperature=1.0, seed=7 + i, max_tokens=40, ignore_eos=True) for i in range(2)]
    beams = BeamSearchParams(beam_width=3, max_tokens=30, ignore_eos=True)

    def both():
        beam_out = llm.beam_search([{"prompt_token_ids": p} for p in prompts], beams, use_tqdm=False)
        return _run(llm, prompts, sampled), [[s.output_token_ids for s in o.sequences] for o in beam_out]

    freeing = both()
    _assert_clean(llm)
    with _without_freeing(llm):
        assert both() == freeing
    assert len(set(map(tuple, freeing[0][0]))) > 1  # the samples differ, so forks really diverged
    _assert_clean(llm)


def test_a_pool_smaller_than_one_history_serves_it_and_preempts(model_dir, workload):
    """12 blocks hold 48 tokens: one sequence of 236 tokens (59 blocks' history) runs alone, and the workload's four
    (60 to 76 tokens each) hold 4 blocks each while decoding, so they preempt one another."""
    prompts, max_tokens, expected = workload
    tight = _llm(model_dir, num_kv_blocks=12)
    long_prompt = random_prompts(VOCAB, [20], seed=13)[0]
    assert _run(tight, [long_prompt], [SamplingParams(temperature=0.0, ignore_eos=True)])  # 236 tokens, 59 blocks
    assert [g[0] for g in _run(tight, prompts, [_greedy(m) for m in max_tokens])] == expected
    assert tight.get_stats()["num_preemptions"] > 0
    _assert_clean(tight)

"""KV cache groups for hybrid models (windowed and global layers): each group has its own block tables, a block id
serves one layer of one group, and windowed groups give back what their window left, so a long sequence holds its
history on the global layers and about the window on the local ones. Tiny random Qwen2 (alternating layer types:
2 groups of 2 layers) and Gemma 3 (5 local layers, 1 global: 6 groups of one), float32. Greedy output equals
transformers and the same engine without groups (disable_hybrid_kv_cache_manager) through chunked prefill,
preemption, prefix caching, n > 1 and beam search; no compiles after warm-up; every block comes back."""

from __future__ import annotations

import copy

import pytest
import transformers

from jaxpaged import LLM, BeamSearchParams, SamplingParams
from jaxpaged.core.kv_cache_coordinator import KVCacheCoordinator
from tests.engine.test_sliding_window_engine import _assert_clean, _greedy, _run
from tests.hf_reference import hf_greedy, random_hf_model, random_prompts, save_hf_model

VOCAB = 256
WINDOW = 12
BS = 4
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=0, sliding_window=WINDOW)  # fmt: skip
CONFIGS = {
    "qwen2-alternating": lambda: transformers.Qwen2Config(
        **TINY, num_hidden_layers=4, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        use_sliding_window=True, max_window_layers=0, layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "gemma3-5-local-1-global": lambda: transformers.Gemma3TextConfig(
        **TINY, num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters=copy.deepcopy({"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                                       "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    ),
}  # fmt: skip
GROUPS = {"qwen2-alternating": (2, 2), "gemma3-5-local-1-global": (6, 1)}  # (groups, layers per group)


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    hf = random_hf_model(CONFIGS[request.param]())
    return request.param, hf, str(save_hf_model(hf, tmp_path_factory.mktemp(request.param)))


def _llm(folder, **kw) -> LLM:
    kw = {"dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 16, "block_size": BS, "log_level": "WARNING",
          **kw}  # fmt: skip
    return LLM(folder, **kw)


@pytest.fixture(scope="module")
def engines(case):
    _, _, folder = case
    return _llm(folder), _llm(folder, disable_hybrid_kv_cache_manager=True)


@pytest.fixture(scope="module")
def workload(case):
    """Prompts of up to 3 windows (chunked at 16 tokens a step) and outputs that run several windows past them."""
    _, hf, _ = case
    lengths, max_tokens = [5, 23, 40, 13], [40, 30, 36, 44]
    prompts = random_prompts(VOCAB, lengths, seed=3)
    return prompts, max_tokens, [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]


def test_the_cache_is_laid_out_by_group(case, engines):
    name, _, _ = case
    grouped, plain = engines
    num_groups, size = GROUPS[name]
    runner = grouped.engine.runner
    assert isinstance(grouped.engine.scheduler.kv, KVCacheCoordinator) and len(runner.kv_groups.layers) == num_groups
    assert runner.kv_cache.shape[0] == size and plain.engine.runner.kv_cache.shape[0] == runner.model_config.num_layers
    assert runner.block_bytes * runner.model_config.num_layers == plain.engine.runner.block_bytes * size
    assert "KV cache groups" in runner.memory_plan()


def test_greedy_equals_transformers_and_the_engine_without_groups(engines, workload):
    prompts, max_tokens, expected = workload
    for llm in engines:
        assert [g[0] for g in _run(llm, prompts, [_greedy(m) for m in max_tokens])] == expected
        _assert_clean(llm)


def _bytes_held(llm: LLM, prompt, max_tokens: int) -> int:
    """The most KV bytes in use after any schedule() while one sequence runs."""
    scheduler, runner, most = llm.engine.scheduler, llm.engine.runner, [0]
    original = scheduler.schedule

    def spy():
        out = original()
        most[0] = max(most[0], scheduler.kv.pool.num_used * runner.block_bytes)
        return out

    scheduler.schedule = spy
    try:
        out = _run(llm, [prompt], [_greedy(max_tokens)])
    finally:
        del scheduler.schedule
    _assert_clean(llm)
    return most[0], out


def test_a_long_sequence_holds_its_history_on_global_layers_only(case, engines):
    """At 150 tokens the global layers hold all 38 blocks of history, each local layer about its window's 4-9."""
    name, hf, _ = case
    grouped, plain = engines
    prompt = random_prompts(VOCAB, [30], seed=8)[0]
    held, out = _bytes_held(grouped, prompt, 120)
    held_plain, out_plain = _bytes_held(plain, prompt, 120)
    assert out == out_plain == [[hf_greedy(hf, prompt, 120)]]
    cfg = grouped.engine.runner.model_config
    num_global = sum(w is None for w in cfg.sliding_windows)
    per_layer_block = grouped.engine.runner.block_bytes // GROUPS[name][1]
    history = -(-150 // BS)
    window_blocks = -(-(WINDOW - 1 + 16) // BS) + 1  # what a 16-token step's window reads, plus alignment
    assert held <= per_layer_block * (num_global * history + (cfg.num_layers - num_global) * window_blocks)
    assert held_plain == per_layer_block * cfg.num_layers * history
    assert held < 0.7 * held_plain


def test_prefix_cache_hit_on_a_hybrid_prompt(case, engines):
    _, hf, _ = case
    llm = engines[0]
    prompt = random_prompts(VOCAB, [45], seed=21)[0]
    want = hf_greedy(hf, prompt, 10)
    hits = llm.get_stats()["prefix_cache_hits"]
    assert _run(llm, [prompt], [_greedy(10)])[0][0] == want
    assert _run(llm, [prompt], [_greedy(10)])[0][0] == want  # every group finds what it needs cached
    assert llm.get_stats()["prefix_cache_hits"] > hits
    _assert_clean(llm)


def test_n_samples_and_beams_equal_the_engine_without_groups(engines):
    prompts = random_prompts(VOCAB, [9, 26], seed=5)
    sampled = [SamplingParams(n=3, temperature=1.0, seed=7 + i, max_tokens=40, ignore_eos=True) for i in range(2)]
    beams = BeamSearchParams(beam_width=3, max_tokens=30, ignore_eos=True)

    def both(llm):
        beam_out = llm.beam_search([{"prompt_token_ids": p} for p in prompts], beams, use_tqdm=False)
        return _run(llm, prompts, sampled), [[s.output_token_ids for s in o.sequences] for o in beam_out]

    grouped = both(engines[0])
    assert grouped == both(engines[1])
    assert len(set(map(tuple, grouped[0][0]))) > 1  # the samples differ, so forks really diverged
    for llm in engines:
        _assert_clean(llm)


def test_a_small_pool_preempts_and_serves_a_long_sequence(case, workload):
    """A pool just large enough for one 170-token sequence's global history and local windows (fewer bytes than its
    history on every layer: the engine without groups could not run it) serves it, and the workload preempts."""
    name, _, folder = case
    prompts, max_tokens, expected = workload
    num_groups, size = GROUPS[name]
    global_groups = 1
    need = global_groups * -(-170 // BS) + (num_groups - global_groups) * (-(-(WINDOW - 1 + 16) // BS) + 1)
    tight = _llm(folder, num_kv_blocks=need + 4)
    assert (need + 4) * size < -(-170 // BS) * tight.engine.runner.model_config.num_layers
    long_prompt = random_prompts(VOCAB, [20], seed=13)[0]
    long_out = _run(tight, [long_prompt], [SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)])
    assert len(long_out[0][0]) == 150
    assert [g[0] for g in _run(tight, prompts, [_greedy(m) for m in max_tokens])] == expected
    assert tight.get_stats()["num_preemptions"] > 0
    _assert_clean(tight)

"""fused_kv_write: one executable a step attends and writes the step's K/V into the donated cache. Greedy output equals
transformers and the engine with a separate write, through chunked prefill, prefix-cache hits, preemption and async
scheduling, over a float and an 8-bit cache; the runner compiles "step" executables and no forward or write, nothing
compiles after warm-up, a second start loads them, and pipeline parallelism refuses the option by name."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, SamplingParams
from tests.hf_reference import hf_greedy, random_prompts

VOCAB = 256
MAX_TOKENS = 20


def _llm(folder, **kw) -> LLM:
    kw = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 16, "block_size": 8, "log_level": "WARNING", **kw}
    return LLM(folder, **kw)


def _greedy(llm, prompts, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    base = random_prompts(VOCAB, [5, 23, 37, 11], seed=3)
    return base + [base[2][:32] + [7, 9, 11]]  # shares 4 full blocks with the third: a prefix-cache hit


def _assert_fused(llm):
    runner = llm.engine.runner
    names = {name for name, _ in runner._compiled}
    assert "step" in names and not names & {"forward", "write"}, names
    stats = llm.get_stats()
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0  # every block came back


def test_greedy_equals_transformers_and_the_separate_write(model_dir, hf_model, prompts):
    fused = _llm(model_dir, fused_kv_write=True)
    tokens = _greedy(fused, prompts)
    assert tokens == [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]
    assert tokens == _greedy(_llm(model_dir), prompts)
    assert fused.get_stats()["prefix_cache_hits"] > 0 and fused.get_stats()["num_overlapped_steps"] > 0
    _assert_fused(fused)


def test_preemption_over_a_small_pool(model_dir, hf_model, prompts):
    """A pool of 12 blocks of 8 tokens for 5 sequences of up to 57 tokens: some are preempted and recomputed."""
    fused = _llm(model_dir, fused_kv_write=True, num_kv_blocks=12)
    assert _greedy(fused, prompts) == [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]
    assert fused.get_stats()["num_preemptions"] > 0
    _assert_fused(fused)


def test_a_step_that_copies_the_cache_is_reported(model_dir, capfd):
    """XLA:CPU copies the donated cache into the fused step's temporaries: start-up says so, naming the sizes."""
    runner = _llm(model_dir, fused_kv_write=True, block_size=4).engine.runner
    megabytes = runner.kv_cache.nbytes / 1e6
    err = capfd.readouterr().err
    assert f"fused_kv_write: the 4-token step copies the KV cache ({megabytes:.1f} MB of temporaries for a {megabytes:.1f} MB" in err


def test_an_8_bit_cache_gives_the_separate_writes_tokens(model_dir, prompts):
    fused = _llm(model_dir, fused_kv_write=True, kv_cache_dtype="int8")
    assert _greedy(fused, prompts) == _greedy(_llm(model_dir, kv_cache_dtype="int8"), prompts)
    _assert_fused(fused)


def test_a_second_start_loads_the_fused_executables(model_dir, prompts, tmp_path):
    """Block size 16: step programs no earlier test compiled in this process (a process stores only its first compile
    of a program, so the samplers other tests compiled are compiled again, unstored)."""
    first = _llm(model_dir, fused_kv_write=True, cache_dir=str(tmp_path), block_size=16)
    stored = len(list(tmp_path.rglob("*.exe")))
    second = _llm(model_dir, fused_kv_write=True, cache_dir=str(tmp_path), block_size=16)
    executables = second.engine.runner.executables
    assert stored >= 2 and executables.num_loaded == stored  # at least the two buckets' step executables
    assert executables.num_compiled == first.engine.runner.executables.num_compiled - stored
    assert _greedy(second, prompts) == _greedy(first, prompts)


def test_pipeline_parallel_refuses_it_by_name(model_dir):
    with pytest.raises(ValueError, match="fused_kv_write needs pipeline_parallel_size 1"):
        _llm(model_dir, fused_kv_write=True, pipeline_parallel_size=2)

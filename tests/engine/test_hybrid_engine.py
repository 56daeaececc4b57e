"""Hybrid models through the engine: the attention layers' paged KV and the linear layers' state slots
(core/state_slots.py, pallas_kernels/state_cache.py). Tiny random Qwen3.5 and Nemotron-H (tests/models/test_hybrid_models.py),
float32, 8-token steps (buckets 4 and 8), so prompts prefill in chunks beside other sequences' decode rows.

- Greedy output equals transformers through chunked prefill and preemption (recomputed from prompt and outputs).
- A slot per running sequence, returned at once by a finished or aborted one; the step's decode writes the states
  in place (the donated write's output aliases its input).
- n > 1 and beams: the children get the parent's state at the fork (seeded samples equal the same seeds run alone;
  beams equal transformers' beam search); with no slot free a fork falls back to computing the child from scratch.
- Speculative decoding (ngram): a rejected guess restores the state saved before its row, and greedy output still
  equals transformers (the MTP layer of Qwen3-Next: tests/spec_decode/test_mtp_families.py).
- Prefix caching is off (said in the memory plan), pipeline parallelism and a hybrid draft model are refused.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, BeamSearchParams, SamplingParams
from jaxpaged.core.state_slots import HybridKVCacheManager
from tests.engine.test_beam_search import hf_beams
from tests.engine.test_sliding_window_engine import _assert_clean, _greedy, _run
from tests.hf_reference import hf_greedy, random_prompts, save_hf_model
from tests.models.test_hybrid_models import CASES, hybrid_hf_model

VOCAB = 256


def _llm(folder, **kw) -> LLM:
    kw = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 8, "block_size": 8, "max_model_len": 256,
          "log_level": "WARNING", **kw}  # fmt: skip
    return LLM(folder, **kw)


@pytest.fixture(scope="module", params=["qwen3.5-dense-tied", "nemotron-h"])
def case(request, tmp_path_factory):
    config_cls, kwargs, _ = CASES[request.param]
    hf = hybrid_hf_model(config_cls(**kwargs))
    return request.param, hf, str(save_hf_model(hf, tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def llm(case):
    return _llm(case[2])


@pytest.fixture(scope="module")
def workload(case):
    """Six prompts (more than the 4 slots), up to ten 8-token chunks each."""
    _, hf, _ = case
    lengths, max_tokens = [5, 40, 77, 3, 20, 33], [14, 20, 8, 24, 12, 16]
    prompts = random_prompts(VOCAB, lengths, seed=3)
    return prompts, max_tokens, [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]


def _free_states(llm: LLM) -> int:
    kv = llm.engine.scheduler.kv
    assert isinstance(kv, HybridKVCacheManager)
    return kv.num_free_states


def test_greedy_equals_transformers_through_chunked_prefill(llm, workload):
    prompts, max_tokens, expected = workload
    assert [g[0] for g in _run(llm, prompts, [_greedy(m) for m in max_tokens])] == expected
    assert _free_states(llm) == llm.engine.runner.num_state_slots == 4
    _assert_clean(llm)


def test_preemption_recomputes_the_state(case, workload):
    prompts, max_tokens, expected = workload
    tight = _llm(case[2], num_kv_blocks=16)  # 128 tokens: four sequences of up to 101 cannot all stay
    assert [g[0] for g in _run(tight, prompts, [_greedy(m) for m in max_tokens])] == expected
    assert tight.get_stats()["num_preemptions"] > 0
    assert _free_states(tight) == 4
    _assert_clean(tight)


def test_the_cache_holds_attention_kv_and_a_state_slot_per_sequence(llm):
    runner = llm.engine.runner
    cache, spec = runner.kv_cache, runner.state_spec
    assert cache.kv.shape[0] == runner.model_config.num_kv_layers < runner.model_config.num_layers
    for array in spec.arrays:
        assert cache.states[array.name].shape == (spec.num_layers, 4, *array.shape)
    assert "linear layers' states" in runner.memory_plan() and "prefix caching off" in runner.memory_plan()
    assert not llm.engine.scheduler.kv.pool.enable_caching


def test_decode_writes_the_states_in_place(llm):
    """The write donates the cache: its state arrays are updated where they lie (a copy would be a new buffer while
    the old one is still referenced), through a prefill step and five decode steps."""
    runner = llm.engine.runner
    before = {name: a.unsafe_buffer_pointer() for name, a in runner.kv_cache.states.items()}
    _run(llm, [[5, 6, 7]], [_greedy(6)])
    assert {name: a.unsafe_buffer_pointer() for name, a in runner.kv_cache.states.items()} == before


def test_a_finished_or_aborted_sequence_frees_its_slot_at_once(llm):
    engine = llm.engine
    engine.add_request("long", {"prompt_token_ids": [3] * 30}, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    engine.add_request("short", {"prompt_token_ids": [4] * 5}, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:  # its slot is back before the next step is formed
                held.append(4 - _free_states(llm))
        if engine.scheduler.running and all(r.num_computed_tokens > 30 for r in engine.scheduler.running):
            assert engine.abort_request("long")
            assert _free_states(llm) == 4  # nothing runs: every slot is free
    assert held == [1]  # when "short" ended, only "long" held one
    _assert_clean(llm)


def test_n_samples_and_beams_copy_the_parents_state_at_the_fork(case, llm):
    name, hf, _ = case
    prompt = random_prompts(VOCAB, [37], seed=21)[0]
    sampled = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    engine = llm.engine
    computed = engine.scheduler.num_computed_tokens_total
    (together,) = _run(llm, [prompt], sampled)
    # the prompt is computed once (but its last token, by each sample), then each sample decodes
    assert engine.scheduler.num_computed_tokens_total - computed == len(prompt) - 1 + 3 * 10
    alone = [_run(llm, [prompt], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=10, ignore_eos=True))[0][0]
             for i in range(3)]  # fmt: skip
    assert together == alone and len(set(map(tuple, together))) > 1
    beams = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=8), use_tqdm=False)
    want, _ = hf_beams(hf, prompt, 3, 8, 1.0, False, eos=[1])
    assert [s.output_token_ids for s in beams[0].sequences] == want
    _assert_clean(llm)
    assert _free_states(llm) == 4


def test_a_fork_without_a_free_slot_computes_the_child_from_scratch(case):
    """One slot: the first sample holds it, so its siblings cannot fork and compute the prompt themselves."""
    _, _, folder = case
    one = _llm(folder, max_num_seqs=1, max_num_batched_tokens=4)  # one bucket: the 21-token prompt in 4-token chunks
    prompt = random_prompts(VOCAB, [21], seed=4)[0]
    (together,) = _run(one, [prompt], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))
    alone = [_run(one, [prompt], SamplingParams(temperature=1.0, seed=5 + i, max_tokens=6, ignore_eos=True))[0][0]
             for i in range(2)]  # fmt: skip
    assert together == alone
    _assert_clean(one)


def test_speculative_decoding_restores_the_state_of_a_rejected_row(case, workload):
    """ngram guesses on Mamba-2 layers: each rejected row's linear layers go back to the state saved before it
    (core/state_slots.py), its kept tokens computed again; every spare slot back. (Gated DeltaNet's, with guesses
    both kept and rejected: tests/spec_decode/test_mtp_families.py.)"""
    if case[0] != "nemotron-h":
        pytest.skip("Gated DeltaNet's restore is checked with Qwen3-Next's MTP layer")
    prompts, max_tokens, expected = workload
    spec = _llm(case[2], speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert [g[0] for g in _run(spec, prompts, [_greedy(m) for m in max_tokens])] == expected
    stats = spec.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_restored"] > 0, stats
    kv = spec.engine.scheduler.kv
    assert _free_states(spec) == 4 and len(kv._spares) == spec.engine.runner.num_state_slots - 4 and not kv._snapshots
    _assert_clean(spec)


def test_pipeline_parallelism_and_a_hybrid_draft_model_are_refused(case):
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        _llm(case[2], pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_config.model .* hybrid model"):
        _llm(case[2], speculative_config={"method": "draft_model", "model": case[2], "num_speculative_tokens": 2})


def test_state_slot_manager_rules():
    """Slots come with a sequence's first blocks, go back with them; a fork queues a copy (from its source when the
    parent's own is still queued); freeing a child voids the copy into its slot; no slot, no fork."""
    from jaxpaged.core.block_pool import BlockPool

    kv = HybridKVCacheManager(BlockPool(32, enable_caching=False), 4, 2)
    assert kv.allocate_slots("a", 0, 5) and kv.state_slot("a") == 0 and kv.num_free_states == 1
    assert kv.fork("a", "b") and kv.take_state_copies() == [(0, 1)]
    assert not kv.allocate_slots("c", 0, 3) and not kv.block_table("c")  # no slot left: nothing taken
    assert kv.fork("b", "d") is False and not kv.block_table("d")
    kv.free("a")
    assert kv.fork("b", "e") and kv.take_state_copies() == [(1, 0)]
    assert kv.fork("e", "f") is False
    kv.free("e")
    kv.free("b")
    assert kv.num_free_states == 2 and kv.pool.num_free == 32
    assert kv.allocate_slots("g", 0, 1) and kv.fork("g", "h")
    chained = kv.state_slot("h")
    kv.free("g")
    assert kv.allocate_slots("i", 0, 1)  # takes g's slot; h's copy still reads g's state first
    assert kv.take_state_copies() == [(kv.state_slot("i"), chained)]
    with pytest.raises(ValueError, match="num_state_slots"):
        HybridKVCacheManager(BlockPool(4, enable_caching=False), 4, 0)


def test_snapshots_of_verifying_rows():
    """A verifying row's state goes to a spare first; settle copies it back where a guess failed, and the spare is
    free again either way (also when the sequence ends first); no spare, no snapshot."""
    from jaxpaged.core.block_pool import BlockPool

    kv = HybridKVCacheManager(BlockPool(32, enable_caching=False), 4, 2, num_spare_slots=1)
    assert kv.allocate_slots("a", 0, 5) and kv.allocate_slots("b", 0, 5)
    a, b = kv.state_slot("a"), kv.state_slot("b")
    assert kv.snapshot("a") and not kv.snapshot("b")  # one spare
    assert kv.take_state_copies() == [(a, 2)]
    kv.settle("a", restore=True)
    assert kv.take_state_copies() == [(2, a)] and kv.state_slot("a") == a
    assert kv.snapshot("b") and kv.take_state_copies() == [(b, 2)]
    kv.settle("b", restore=False)
    assert kv.take_state_copies() == [] and kv.snapshot("a")
    kv.free("a")  # ended before its row was verified: the spare is back
    assert kv.snapshot("b") and not kv.snapshot("x")


def test_state_slots_reach_the_step(llm):
    """Each row's state slot is its sequence's; padded rows get the out-of-range count (writes dropped)."""
    engine = llm.engine
    engine.add_request("x", {"prompt_token_ids": [7] * 9}, _greedy(3))
    output = engine.scheduler.schedule()
    step = engine.runner.input_batch.build(output)
    (req,) = [item.request for item in output.scheduled]
    slots = np.asarray(step.attention.state_slots)
    assert slots[0] == req.state_slot == engine.scheduler.kv.state_slot(req.seq_id) >= 0
    assert (slots[1:] == engine.runner.num_state_slots).all()
    engine.abort_request("x")

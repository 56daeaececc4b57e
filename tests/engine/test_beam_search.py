"""Beam search equals transformers' generate(num_beams=k), on beams that share KV blocks.

A 32-token vocabulary with two EOS ids makes beams end on EOS often, so finished hypotheses,
length penalties and every early-stopping mode are exercised, not just max_tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, BeamSearchParams, SamplingParams
from tests.hf_reference import random_hf_model, random_prompts, save_hf_model, tiny_llama_config, torch

VOCAB = 32
EOS = [1, 2]


@pytest.fixture(scope="module")
def hf_model():
    return random_hf_model(
        tiny_llama_config(vocab_size=VOCAB, eos_token_id=EOS, num_attention_heads=4, num_key_value_heads=2), seed=3
    )


@pytest.fixture(scope="module")
def model_dir(hf_model, tmp_path_factory):
    return str(save_hf_model(hf_model, tmp_path_factory.mktemp("tiny-llama-beams")))


def _llm(model_dir, **kw) -> LLM:
    kw = {"dtype": "float32", "max_num_seqs": 16, "max_num_batched_tokens": 64, "block_size": 8, "log_level": "WARNING",
          **kw}  # fmt: skip
    return LLM(model_dir, **kw)


@pytest.fixture(scope="module")
def llm(model_dir):
    return _llm(model_dir)


PROMPTS = random_prompts(VOCAB, [3, 9, 17, 30], seed=5)
MODES = [(2, 1.0, False), (3, 1.0, True), (4, 0.5, "never"), (3, 2.0, False), (4, -1.0, True), (2, 0.0, "never")]


def hf_beams(model, prompt, width, max_tokens, length_penalty, early_stopping, eos=EOS):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), num_beams=width,
            num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens, length_penalty=length_penalty,
            early_stopping=early_stopping, eos_token_id=eos, pad_token_id=-1, return_dict_in_generate=True,
            output_scores=True,
        )  # fmt: skip
    sequences = [[t for t in seq[len(prompt) :].tolist() if t != -1] for seq in out.sequences]
    return sequences, out.sequences_scores.tolist()


@pytest.mark.parametrize("width,length_penalty,early_stopping", MODES)
def test_beams_equal_transformers(llm, hf_model, width, length_penalty, early_stopping):
    params = BeamSearchParams(beam_width=width, max_tokens=24, length_penalty=length_penalty,
                              early_stopping=early_stopping)  # fmt: skip
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        want, scores = hf_beams(hf_model, prompt, width, 24, length_penalty, early_stopping)
        assert out.sequences[0].output_token_ids == want[0]  # the best beam, token for token
        assert [s.output_token_ids for s in out.sequences] == want  # and the whole ranking
        np.testing.assert_allclose([s.score for s in out.sequences], scores, rtol=1e-4, atol=1e-5)
        assert out.sequences[0].tokens == prompt + want[0]
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    assert llm.get_stats()["kv_blocks_free"] == llm.get_stats()["kv_blocks_total"]


def test_eos_ends_hypotheses_and_early_stopping_modes_differ(llm):
    """The test model really does end beams on EOS, and the three modes make different decisions on it."""
    results = {}
    for mode in (True, False, "never"):
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                               BeamSearchParams(beam_width=3, max_tokens=24, length_penalty=2.0, early_stopping=mode),
                               use_tqdm=False)  # fmt: skip
        results[mode] = [[s.output_token_ids for s in o.sequences] for o in outs]
        assert any(s.finish_reason == "stop" and s.output_token_ids[-1] in EOS for o in outs for s in o.sequences)
    assert results[True] != results["never"]


def test_old_style_sampling_params_beam_search(llm, hf_model):
    prompt = PROMPTS[2]
    params = SamplingParams(use_beam_search=True, best_of=4, n=2, temperature=0.0, max_tokens=20, length_penalty=0.7)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    want, _ = hf_beams(hf_model, prompt, 4, 20, 0.7, False)
    assert [c.token_ids for c in out.outputs] == want[:2]
    assert all(c.cumulative_logprob < 0 for c in out.outputs)


def test_ignore_eos_runs_to_max_tokens(llm, hf_model):
    prompt = PROMPTS[1]
    out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)[0]  # fmt: skip
    want, _ = hf_beams(hf_model, prompt, 3, 16, 1.0, False, eos=None)
    assert [s.output_token_ids for s in out.sequences] == want
    assert all(len(s.output_token_ids) == 16 for s in out.sequences)


def test_beams_share_blocks_and_give_them_all_back(llm):
    engine = llm.engine
    prompt = random_prompts(VOCAB, [45], seed=9)[0]
    params = SamplingParams(use_beam_search=True, best_of=4, n=4, temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("beams", {"prompt_token_ids": prompt}, params)
    search = engine.output_processor.beams["beams"]
    most_shared = 0
    while engine.has_unfinished_requests():
        engine.step()
        tables = [engine.scheduler.kv.block_table(s.seq_id) for s in search.running]
        held = [b for t in tables for b in t]
        if len(tables) == 4:
            most_shared = max(most_shared, len(held) - len(set(held)))
            assert llm.get_stats()["kv_blocks_used"] == len(set(held))
    assert most_shared >= 3 * (45 // 8)  # the prompt's full blocks are held once by all four beams
    assert llm.get_stats()["kv_blocks_free"] == llm.get_stats()["kv_blocks_total"]


def test_beam_search_under_preemption_is_identical(model_dir, llm):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = BeamSearchParams(beam_width=4, max_tokens=24, length_penalty=1.0)
    roomy = [[s.output_token_ids for s in o.sequences] for o in llm.beam_search(prompts, params, use_tqdm=False)]
    tight = _llm(model_dir, num_kv_blocks=14, max_num_seqs=8, max_num_batched_tokens=32)
    got = [[s.output_token_ids for s in o.sequences] for o in tight.beam_search(prompts, params, use_tqdm=False)]
    assert got == roomy
    assert tight.get_stats()["num_preemptions"] > 0
    assert tight.get_stats()["kv_blocks_free"] == tight.get_stats()["kv_blocks_total"]


def test_width_too_large_for_the_candidate_budget_is_refused(llm):
    with pytest.raises(ValueError, match="best_of"):
        llm.beam_search([{"prompt_token_ids": [3, 4]}], BeamSearchParams(beam_width=8, max_tokens=4), use_tqdm=False)
    assert llm.get_stats()["num_waiting"] == 0


@pytest.mark.parametrize("fields, name", [
    ({"length_penalty": float("nan")}, "length_penalty"), ({"length_penalty": "1"}, "length_penalty"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"beam_width": 0}, "beam_width"), ({"early_stopping": "yes"}, "early_stopping"),
])  # fmt: skip
def test_bad_beam_search_params_name_their_field(fields, name):
    with pytest.raises(ValueError, match=name):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})

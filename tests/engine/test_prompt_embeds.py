"""Prompts given as embeddings (enable_prompt_embeds, vLLM's {"prompt_embeds": [T, hidden]}) on a tiny random Llama
in float32: the same greedy tokens as the token prompt and as transformers' generate(inputs_embeds=...), mixed with
token prompts, in 8-token chunks, under preemption, n = 3 seeded samples as the token prompt's, in bfloat16 too; no
compile after warm-up; every KV block back; the refusals."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.hf_reference import random_prompts, torch

HIDDEN = 64
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, block_size=8, log_level="WARNING")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, enable_prompt_embeds=True, **ENGINE)


def _greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kwargs)


def _table(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model.get_input_embeddings()(torch.tensor(ids))


def _hf_greedy_embeds(hf_model, embeds: torch.Tensor, n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(embeds), dtype=torch.long),
                                do_sample=False, max_new_tokens=n, min_new_tokens=n)  # fmt: skip
    return out[0, -n:].tolist()


def _random_embeds(length: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(0.0, 0.15, (length, HIDDEN)).astype(np.float32))


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _all_blocks_back(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_compiles_after_warmup"] == 0


def test_table_embeddings_equal_token_prompt_and_transformers(llm, hf_model):
    ids = random_prompts(256, [21], seed=3)[0]
    embeds = _table(hf_model, ids)
    by_ids, by_embeds, batch_of_one = llm.generate(
        [{"prompt_token_ids": ids}, {"prompt_embeds": embeds}, {"prompt_embeds": embeds[None].numpy()}], _greedy(12),
        use_tqdm=False,
    )  # fmt: skip
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids == _hf_greedy_embeds(hf_model, embeds, 12)
    assert batch_of_one.outputs[0].token_ids == by_ids.outputs[0].token_ids
    # nothing of the engine's placeholders is reported; the text is the generated tokens' alone
    assert by_embeds.prompt_token_ids == [] and by_embeds.prompt is None
    assert by_embeds.outputs[0].text == by_ids.outputs[0].text
    _all_blocks_back(llm)


def test_random_embeddings_mixed_with_token_prompts_equal_transformers(llm, hf_model):
    lengths = [5, 30, 17, 9]
    embeds = [_random_embeds(n, seed=i) for i, n in enumerate(lengths)]
    token_prompts = random_prompts(256, [12, 40], seed=5)
    prompts = [{"prompt_embeds": embeds[0]}, {"prompt_token_ids": token_prompts[0]}, {"prompt_embeds": embeds[1].numpy()},
               {"prompt_embeds": embeds[2]}, {"prompt_token_ids": token_prompts[1]}, {"prompt_embeds": embeds[3]}]
    got = _tokens(llm.generate(prompts, _greedy(10), use_tqdm=False))
    expected_embeds = [_hf_greedy_embeds(hf_model, e, 10) for e in embeds]
    expected_tokens = [_hf_greedy_embeds(hf_model, _table(hf_model, p), 10) for p in token_prompts]
    assert got == [expected_embeds[0], expected_tokens[0], expected_embeds[1], expected_embeds[2], expected_tokens[1],
                   expected_embeds[3]]  # fmt: skip
    _all_blocks_back(llm)


def test_prefix_cache_keeps_embeds_and_token_prompts_apart(llm, hf_model):
    """Token 0 is the placeholder id: a token prompt of zeros must not reuse an embeds prompt's blocks, and the same
    embeddings sent twice reuse theirs."""
    llm.reset_prefix_cache()
    embeds = _random_embeds(24, seed=9)
    first = llm.generate({"prompt_embeds": embeds}, _greedy(6), use_tqdm=False)[0]
    zeros = llm.generate({"prompt_token_ids": [0] * 24}, _greedy(6), use_tqdm=False)[0]
    again = llm.generate({"prompt_embeds": embeds}, _greedy(6), use_tqdm=False)[0]
    assert zeros.num_cached_tokens == 0
    assert again.num_cached_tokens > 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == _hf_greedy_embeds(hf_model, embeds, 6)
    assert zeros.outputs[0].token_ids == _hf_greedy_embeds(hf_model, _table(hf_model, [0] * 24), 6)


@pytest.mark.filterwarnings("ignore:Passing `repetition_penalty` with `inputs_embeds`")
def test_penalties_count_generated_tokens_only(llm, hf_model):
    """The placeholder ids are no tokens: an embeds prompt's repetition penalty sees only its outputs, so it samples
    as the token prompt does under presence/frequency penalties (which count outputs only either way)."""
    ids = random_prompts(256, [16], seed=4)[0]
    params = _greedy(10, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.0)
    by_ids, by_embeds = llm.generate([{"prompt_token_ids": ids}, {"prompt_embeds": _table(hf_model, ids)}], params,
                                     use_tqdm=False)  # fmt: skip
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
    # a repetition penalty on [0] * 16's placeholder would, if counted, penalize token 0: here it must not
    rep = _greedy(10, repetition_penalty=1.8)
    out = llm.generate({"prompt_embeds": _table(hf_model, ids)}, rep, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        hf = hf_model.generate(inputs_embeds=_table(hf_model, ids)[None], do_sample=False, max_new_tokens=10,
                               min_new_tokens=10, repetition_penalty=1.8)  # fmt: skip
    assert out == hf[0, -10:].tolist()  # transformers' inputs_embeds path also penalizes generated tokens only


def test_chunks_and_preemption(model_dir, hf_model):
    """8-token chunks and a pool too small for all: embeds prompts recomputed after preemption."""
    small = LLM(model_dir, enable_prompt_embeds=True, dtype="float32", max_num_seqs=4, max_num_batched_tokens=8,
                block_size=8, num_kv_blocks=14, log_level="WARNING")  # fmt: skip
    embeds = [_random_embeds(n, seed=20 + n) for n in (19, 27, 11, 23)]
    prompts = [{"prompt_embeds": e} for e in embeds] + [{"prompt_token_ids": random_prompts(256, [15], seed=6)[0]}]
    got = _tokens(small.generate(prompts, _greedy(16), use_tqdm=False))
    expected = [_hf_greedy_embeds(hf_model, e, 16) for e in embeds]
    assert got[:4] == expected
    assert got[4] == _hf_greedy_embeds(hf_model, _table(hf_model, prompts[4]["prompt_token_ids"]), 16)
    assert small.get_stats()["num_preemptions"] > 0
    _all_blocks_back(small)


@pytest.mark.parametrize("value, words", [
    (np.zeros((4, HIDDEN + 1), np.float32), "hidden size"),
    (np.zeros((0, HIDDEN), np.float32), "empty"),
    (np.zeros(HIDDEN, np.float32), "shape"),
    (np.zeros((2, 3, HIDDEN), np.float32), "shape"),
    (np.full((3, HIDDEN), np.nan, np.float32), "non-finite"),
    (np.zeros((3, HIDDEN), np.int32), "floats"),
    (np.zeros((600, HIDDEN), np.float32), "max_model_len"),
    ([[0.0] * HIDDEN], "array"),
])  # fmt: skip
def test_bad_embeddings_are_refused_and_the_engine_serves_on(llm, value, words):
    with pytest.raises(ValueError, match="prompt_embeds") as info:
        llm.generate({"prompt_embeds": value}, _greedy(2), use_tqdm=False)
    assert words in str(info.value)
    assert len(llm.generate({"prompt_token_ids": [3, 4, 5]}, _greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_conflicting_requests_are_refused(llm):
    embeds = np.zeros((3, HIDDEN), np.float32)
    for prompt, params, name in [
        ({"prompt_embeds": embeds, "prompt_token_ids": [1, 2]}, _greedy(2), "prompt_token_ids"),
        ({"prompt_embeds": embeds}, _greedy(2, prompt_logprobs=1), "prompt_logprobs"),
    ]:
        with pytest.raises(ValueError, match=name):
            llm.generate(prompt, params, use_tqdm=False)


def test_n_samples_equal_the_token_prompts(llm, hf_model):
    """n = 3 seeded samples of the table's embeddings: the token prompt's samples (the forks share the prompt's
    embedding rows as they share its blocks), not all alike; beam search is refused, naming it."""
    ids = random_prompts(256, [19], seed=8)[0]
    embeds = _table(hf_model, ids)
    sampled = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, n=3, seed=7)
    by_ids, by_embeds = llm.generate([{"prompt_token_ids": ids}, {"prompt_embeds": embeds}], sampled, use_tqdm=False)
    samples = [c.token_ids for c in by_ids.outputs]
    assert [c.token_ids for c in by_embeds.outputs] == samples and len({tuple(x) for x in samples}) == 3
    with pytest.raises(ValueError, match="use_beam_search"):
        llm.generate({"prompt_embeds": embeds}, SamplingParams(use_beam_search=True, n=2, max_tokens=4), use_tqdm=False)
    _all_blocks_back(llm)


def test_bfloat16_embeddings_equal_the_token_prompt(model_dir, hf_model):
    """In bfloat16 the given float32 rows are cast as the table is: the table's rows give the token prompt's tokens."""
    llm = LLM(model_dir, enable_prompt_embeds=True, **{**ENGINE, "dtype": "bfloat16"})
    prompts = random_prompts(256, [7, 26], seed=9)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts] + [{"prompt_embeds": _table(hf_model, p)} for p in prompts],
                        _greedy(10), use_tqdm=False)  # fmt: skip
    assert _tokens(outs[2:]) == _tokens(outs[:2])
    _all_blocks_back(llm)


def test_truncate_prompt_tokens_keeps_the_last_rows(llm, hf_model):
    embeds = _random_embeds(20, seed=30)
    out = llm.generate({"prompt_embeds": embeds}, _greedy(5, truncate_prompt_tokens=8), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == _hf_greedy_embeds(hf_model, embeds[-8:], 5)


def test_refused_without_the_flag(model_dir):
    plain = LLM(model_dir, **ENGINE)
    assert plain.engine.runner.prompt_embeds is None  # no extra input in the step
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        plain.generate({"prompt_embeds": np.zeros((3, HIDDEN), np.float32)}, _greedy(2), use_tqdm=False)


def test_refused_where_unsupported(model_dir, tmp_path):
    import transformers

    from jaxpaged.config import EngineConfig
    from tests.hf_reference import random_hf_model, save_hf_model

    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        EngineConfig(model=model_dir, enable_prompt_embeds=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    # GPT-2 adds learned positions to the token embedding: not an embed-only port
    gpt2 = random_hf_model(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=64))
    with pytest.raises(ValueError, match="enable_prompt_embeds: GPT2"):
        LLM(str(save_hf_model(gpt2, tmp_path / "gpt2")), enable_prompt_embeds=True, **ENGINE)

"""logprobs and prompt_logprobs equal transformers' log_softmax (float32, within 1e-4), top-N included."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.hf_reference import random_prompts, torch

VOCAB = 256


@pytest.fixture(scope="module")
def llm(model_dir):
    # a 16-token budget splits the longer prompts into chunks, so prompt logprobs are gathered across steps
    return LLM(model_dir, dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, block_size=8,
               log_level="WARNING")  # fmt: skip


def hf_logprobs(model, tokens: list[int]) -> np.ndarray:
    """[len(tokens), vocab]: row i is log p(. | tokens[:i + 1])."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def _check_entry(entry, token, row: np.ndarray, top_n: int):
    assert entry[token].logprob == pytest.approx(row[token], abs=1e-4)
    rank = 1 + int(np.sum(row > row[token] + 1e-6))
    # the chosen token's rank is known whatever top_n (vLLM's), in the top 20 at least (a sampled one's: None beyond)
    assert entry[token].rank == rank or (rank > 20 and entry[token].rank is None)
    order = np.argsort(-row)[:top_n]
    others = {t: lp for t, lp in entry.items() if t != token}
    want = {int(t) for t in order if int(t) != token}
    assert set(others) == want
    for t, lp in others.items():
        assert lp.logprob == pytest.approx(row[t], abs=1e-4)
        assert lp.rank == 1 + list(order).index(t)


@pytest.mark.parametrize("top_n", [0, 5, 20])
def test_sample_and_prompt_logprobs_match_transformers(llm, hf_model, top_n):
    prompts = random_prompts(VOCAB, [1, 7, 40], seed=top_n)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=top_n,
                            prompt_logprobs=top_n)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        ref = hf_logprobs(hf_model, prompt + completion.token_ids)
        for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            _check_entry(entry, token, ref[len(prompt) - 1 + i], top_n)
        assert completion.cumulative_logprob == pytest.approx(sum(ref[len(prompt) - 1 + i, t]
                                                                  for i, t in enumerate(completion.token_ids)), abs=1e-3)  # fmt: skip
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for position in range(1, len(prompt)):
            entry = out.prompt_logprobs[position]
            _check_entry(entry, prompt[position], ref[position - 1], top_n)
            assert entry[prompt[position]].rank == 1 + int(np.sum(ref[position - 1] > ref[position - 1, prompt[position]]))


def test_prompt_logprobs_bypass_the_prefix_cache(llm, hf_model):
    prompt = random_prompts(VOCAB, [50], seed=9)[0]
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)  # now cached
    assert llm.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)[0].num_cached_tokens == 48
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                       use_tqdm=False)[0]  # fmt: skip
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == 50
    ref = hf_logprobs(hf_model, prompt)
    got = [e[prompt[p]].logprob for p, e in enumerate(out.prompt_logprobs) if e is not None]
    np.testing.assert_allclose(got, [ref[p - 1, prompt[p]] for p in range(1, 50)], atol=1e-4)
    assert llm.get_stats()["num_compiles_after_warmup"] == 0

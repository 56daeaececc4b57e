"""get_per_token_logps (issue 47 step 4): completions scored by the engine's own steps equal transformers' log-softmax
within 1e-4 in float32, as lists or as Tunix pads them (left-padded prompts, right-padded completions, pad = EOS);
the sampled tokens' logprobs from generate equal their scores; in batch-invariant mode a row's scores do not depend
on the batch; on the GPU's path (prompt logprobs their own executable) the scores are the same; nothing compiles."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.async_engine import AsyncLLMEngine
from jaxpaged.platforms.cpu.platform import ComputedOnce, CpuPlatform

from tests.hf_reference import random_prompts

ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=8, num_kv_blocks=96, log_level="WARNING")
PROMPTS = random_prompts(256, [5, 11, 3, 8], seed=51)
COMPLETIONS = random_prompts(256, [7, 2, 12, 5], seed=52)
PAD = 1  # the tiny model's EOS, as Tunix often pads with it


def hf_logps(model, prompt, completion):
    """transformers' per-token logprobs of the completion after the prompt."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return np.array([logp[len(prompt) + j - 1, t].item() for j, t in enumerate(completion)], np.float32)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, **ENGINE)


def test_lists_and_padded_arrays_equal_transformers(llm, hf_model):
    got = llm.get_per_token_logps(PROMPTS, COMPLETIONS)
    assert got.shape == (4, 12) and got.dtype == np.float32
    for b, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        np.testing.assert_allclose(got[b, : len(c)], hf_logps(hf_model, p, c), atol=1e-4)
        assert not got[b, len(c):].any()
    # Tunix's shapes: [B, P] left-padded, [B, C] right-padded with the pad id (here the EOS id, which no row holds)
    p_width, c_width = 12, 14
    prompts = np.full((4, p_width), PAD, np.int32)
    completions = np.full((4, c_width), PAD, np.int32)
    clean = [[t if t != PAD else 2 for t in row] for row in PROMPTS], [[t if t != PAD else 2 for t in row] for row in COMPLETIONS]
    for b, (p, c) in enumerate(zip(*clean)):
        prompts[b, p_width - len(p):] = p
        completions[b, : len(c)] = c
    padded = llm.get_per_token_logps(prompts, completions, pad_id=PAD)
    assert padded.shape == (4, c_width)
    for b, (p, c) in enumerate(zip(*clean)):
        np.testing.assert_allclose(padded[b, : len(c)], hf_logps(hf_model, p, c), atol=1e-4)
        # the first trailing pad is the EOS a finished completion ends with: its logprob after the whole text
        np.testing.assert_allclose(padded[b, len(c):], hf_logps(hf_model, p + c, [PAD])[0], atol=1e-4)
    with pytest.raises(ValueError, match="prompt_tokens row 0"):
        llm.get_per_token_logps([[PAD, PAD]], [[3]], pad_id=PAD)
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_sampled_tokens_logprobs_are_their_scores(llm):
    params = SamplingParams(temperature=1.0, max_tokens=9, seed=3, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    completions = [list(o.outputs[0].token_ids) for o in outs]
    sampled = np.array([[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])
    np.testing.assert_allclose(sampled, llm.get_per_token_logps(PROMPTS, completions), atol=1e-4)


def test_async_engine_scores_beside_other_requests(llm):
    engine = AsyncLLMEngine(llm.engine)

    async def main():
        other = asyncio.ensure_future(engine.add_request("other", {"prompt_token_ids": PROMPTS[0]},
                                                         SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))  # fmt: skip
        scores = await engine.get_per_token_logps(PROMPTS, COMPLETIONS)
        async for _ in await other:
            pass
        return scores

    try:
        got = asyncio.run(main())
    finally:
        engine.shutdown()
    np.testing.assert_allclose(got, llm.get_per_token_logps(PROMPTS, COMPLETIONS), atol=1e-5)


def test_batch_invariant_scores_do_not_depend_on_the_batch(model_dir):
    llm = LLM(model_dir, batch_invariant=True, **ENGINE)
    alone = [llm.get_per_token_logps([p], [c])[0] for p, c in zip(PROMPTS, COMPLETIONS)]
    together = llm.get_per_token_logps(PROMPTS + PROMPTS[::-1], COMPLETIONS + COMPLETIONS[::-1])
    for b, row in enumerate(alone):
        assert np.array_equal(together[b, : len(row)], row)
        assert np.array_equal(together[7 - b, : len(row)], row)


def test_on_the_gpu_path_the_prompt_executable_scores(model_dir, llm, tmp_path):
    patch = pytest.MonkeyPatch()
    patch.setattr(CpuPlatform, "device_conditionals", False)  # as on a GPU: prompt logprobs their own executable
    patch.setattr(ComputedOnce, "__call__", lambda self, compute, operand: compute())
    try:
        gpu_like = LLM(model_dir, cache_dir=str(tmp_path), **ENGINE)
        assert gpu_like.engine.runner._prompt_apart
        got = gpu_like.get_per_token_logps(PROMPTS, COMPLETIONS)
    finally:
        patch.undo()
    np.testing.assert_allclose(got, llm.get_per_token_logps(PROMPTS, COMPLETIONS), atol=1e-5)
    assert gpu_like.get_stats()["num_compiles_after_warmup"] == 0

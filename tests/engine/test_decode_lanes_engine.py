"""The scheduler's DecodeLanes inside the engine: quiet requests (LLM.generate's) decode in them beside requests that
cannot (penalties, min_tokens, stop ids, n > 1, logprobs), whose sampling rows are then built row by row with the
lanes' members in the same step, and every request's tokens equal its tokens alone, with async scheduling and
without. batch_invariant makes "alone" and "in a batch" comparable bit for bit."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, SamplingParams
from tests.hf_reference import random_hf_model, random_prompts, save_hf_model, tiny_llama_config

VOCAB = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    hf = random_hf_model(tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))
    return str(save_hf_model(hf, tmp_path_factory.mktemp("tiny-llama-lanes")))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_requests_beside_the_lanes_equal_themselves_alone(model_dir, async_scheduling):
    llm = LLM(model_dir, dtype="float32", max_num_seqs=16, max_num_batched_tokens=64, block_size=8, batch_invariant=True,
              async_scheduling=async_scheduling, log_level="WARNING")  # fmt: skip
    prompts = random_prompts(VOCAB, [7, 30, 12, 50, 3, 21, 40, 9, 16, 26], seed=5)
    plain = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    params = [plain] * 5 + [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.2),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=20, stop_token_ids=[3, 7, 11]),
        SamplingParams(n=2, temperature=0.9, seed=4, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.7, top_p=0.8, seed=9, max_tokens=40, ignore_eos=True),
    ]  # fmt: skip
    scheduler = llm.engine.scheduler
    most = []
    lane_rows = scheduler._lane_rows

    def counting(rows):
        most.append(scheduler.lanes.count)
        return lane_rows(rows)

    scheduler._lane_rows = counting
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert max(most) >= 6  # the five plain ones and the top-p one, at least
    for prompt, p, out in zip(prompts, params, batched):
        alone = llm.generate([{"prompt_token_ids": prompt}], p, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs], p
        assert [c.finish_reason for c in out.outputs] == [c.finish_reason for c in alone.outputs]
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_compiles_after_warmup"] == 0
    assert scheduler.lanes.count == 0

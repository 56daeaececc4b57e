"""scheduling_policy "priority" through the engine on a tiny random Llama: LLM.generate's priority list, the same greedy
tokens as fcfs under preemption, the urgent served first, AsyncLLMEngine's priority, and vLLM's refusals."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import EngineConfig
from jaxpaged.engine.async_engine import AsyncLLMEngine
from tests.hf_reference import random_prompts

VOCAB = 256
# a small pool: the 12-request workload below preempts
ARGS = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 64, "block_size": 8, "num_kv_blocks": 16,
        "log_level": "WARNING"}  # fmt: skip


@pytest.fixture(scope="module")
def priority_llm(model_dir):
    return LLM(model_dir, scheduling_policy="priority", **ARGS)


@pytest.fixture(scope="module")
def fcfs_llm(model_dir):
    return LLM(model_dir, **ARGS)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(llm: LLM, prompts, max_tokens, **kw) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [_greedy(m) for m in max_tokens], use_tqdm=False, **kw)
    return [o.outputs[0].token_ids for o in outs]


def _idle(llm: LLM) -> bool:
    stats = llm.get_stats()
    return stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0


def test_same_greedy_tokens_as_fcfs_under_preemption(priority_llm, fcfs_llm):
    rng = np.random.default_rng(3)
    prompts = random_prompts(VOCAB, rng.integers(10, 40, size=12).tolist(), seed=4)
    max_tokens = rng.integers(16, 30, size=12).tolist()
    before = priority_llm.get_stats()["num_preemptions"]
    ranked = _tokens(priority_llm, prompts, max_tokens, priority=[(7 * i) % 5 for i in range(12)])
    assert priority_llm.get_stats()["num_preemptions"] > before  # the pool ran dry: victims were recomputed
    assert ranked == _tokens(fcfs_llm, prompts, max_tokens)
    assert _idle(priority_llm)


def _finish_order(llm: LLM, priorities: list[int]) -> list[int]:
    """Eight equal requests queued at once (4 run at a time): the indices in the order they finish."""
    engine, order = llm.engine, []
    prompts = random_prompts(VOCAB, [8] * len(priorities), seed=5)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, _greedy(8), **({"priority": k} if k else {}))
           for p, k in zip(prompts, priorities)]  # fmt: skip
    while engine.has_unfinished_requests():
        order += [ids.index(out.request_id) for out in engine.step() if out.finished]
    return order


def test_lower_priority_values_are_served_first(priority_llm, fcfs_llm):
    assert set(_finish_order(priority_llm, [7, 6, 5, 4, 3, 2, 1, 0])[:4]) == {4, 5, 6, 7}
    assert set(_finish_order(priority_llm, [0] * 8)[:4]) == {0, 1, 2, 3}  # ties: arrival order
    assert set(_finish_order(fcfs_llm, [0] * 8)[:4]) == {0, 1, 2, 3}


def test_async_generate_takes_a_priority(priority_llm):
    seen = []
    scheduler = priority_llm.engine.scheduler
    add = scheduler.add
    scheduler.add = lambda req: (seen.append(req.parent.priority), add(req))
    engine = AsyncLLMEngine(priority_llm.engine)
    prompt = {"prompt_token_ids": random_prompts(VOCAB, [12], seed=6)[0]}

    async def run():
        return [out async for out in engine.generate(prompt, _greedy(5), "urgent", priority=-3)][-1]

    try:
        out = asyncio.run(run())
    finally:
        engine.shutdown()
        del scheduler.add
    assert seen == [-3] and out.finished
    assert out.outputs[0].token_ids == _tokens(priority_llm, [prompt["prompt_token_ids"]], [5])[0]


def test_bad_priorities_are_refused_and_nothing_is_queued(priority_llm, fcfs_llm):
    prompts = [{"prompt_token_ids": [1, 2, 3]}] * 2
    with pytest.raises(ValueError, match="^priority 1 needs scheduling_policy 'priority'"):
        fcfs_llm.generate(prompts, _greedy(2), use_tqdm=False, priority=[0, 1])  # vLLM refuses it under fcfs too
    with pytest.raises(ValueError, match="^priority has 1 entries for 2 prompts"):
        priority_llm.generate(prompts, _greedy(2), use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match="^priority must be a list"):
        priority_llm.generate(prompts, _greedy(2), use_tqdm=False, priority=3)
    for bad in ("1", 1.5, True, None):
        with pytest.raises(ValueError, match="^priority must be an int"):
            priority_llm.engine.add_request(None, prompts[0], _greedy(2), priority=bad)
    assert _idle(priority_llm) and _idle(fcfs_llm)
    assert [o.outputs[0].token_ids for o in fcfs_llm.generate(prompts, _greedy(2), use_tqdm=False, priority=[0, 0])]


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")

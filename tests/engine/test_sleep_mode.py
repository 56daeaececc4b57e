"""sleep / wake_up (issue 47): the KV pool freed and the weights moved to host memory (level 1) or dropped (level 2),
each brought back on its own in either order, nothing compiled on wake, requests refused (or queued) meanwhile, and
after level 2 refused until update_weights has given every parameter again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.weight_sync import ABORT_REASON, EngineAsleepError
from jaxpaged.utils import compile_monitor

from tests.hf_reference import hf_greedy, random_prompts

PROMPTS = random_prompts(256, [9, 17], seed=31)
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=8, num_kv_blocks=64,
               log_level="WARNING")  # fmt: skip


def _tokens(llm):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]


def test_level_1_either_order_compiles_nothing(llm, hf_model):
    want = [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
    assert _tokens(llm) == want
    runner = llm.engine.runner
    for order in (["kv_cache", "weights"], ["weights", "kv_cache"]):
        kv = jax.tree_util.tree_leaves(runner.kv_cache)
        asleep = llm.sleep(1)
        assert llm.is_sleeping() and runner.kv_cache is None and runner.state is None
        assert all(x.is_deleted() for x in kv)
        assert asleep["engine_bytes_asleep"] == 0 < asleep["engine_bytes_before"]
        host = jax.tree_util.tree_leaves(llm.engine.weight_sync.sleeper._host_state)
        assert host and all(x.sharding.memory_kind == "pinned_host" for x in host)
        with pytest.raises(EngineAsleepError, match="wake_up"):
            _tokens(llm)
        before = compile_monitor.compile_count()
        for tag in order:
            awake = llm.wake_up([tag])
            assert llm.is_sleeping() == (tag == order[0])
        assert compile_monitor.compile_count() == before  # nothing compiled on wake
        assert awake["engine_bytes"] == asleep["engine_bytes_before"]
        assert _tokens(llm) == want
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_level_2_needs_every_weight_again(llm, hf_model):
    weights = {name: jnp.asarray(t.detach().numpy()) for name, t in hf_model.state_dict().items()}
    llm.sleep(2)
    assert llm.engine.weight_sync.sleeper._host_state is None
    llm.wake_up(["weights"])
    with pytest.raises(EngineAsleepError):
        _tokens(llm)
    llm.wake_up(["kv_cache"])
    with pytest.raises(EngineAsleepError, match="sleep.level=2. dropped the weights"):
        _tokens(llm)
    llm.update_weights({"model.norm.weight": weights["model.norm.weight"]})  # some: still refused
    with pytest.raises(EngineAsleepError, match="have not been given again"):
        _tokens(llm)
    llm.update_weights(weights)
    assert _tokens(llm) == [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]


def test_queue_while_asleep_and_abort_in_flight(llm, hf_model):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("running", {"prompt_token_ids": PROMPTS[0]}, params)
    engine.step()
    result = engine.sleep(1, in_flight="abort", queue_requests=True)
    assert [o.outputs[0].stop_reason for o in result["outputs"]] == [ABORT_REASON]
    engine.add_request("queued", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert not engine.has_unfinished_requests() and engine.step() == []
    engine.wake_up()
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert list(outs[-1].outputs[0].token_ids) == hf_greedy(hf_model, PROMPTS[1], MAX_TOKENS)


def test_bad_arguments_name_themselves(llm):
    with pytest.raises(ValueError, match="level"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(["everything"])
    assert not llm.is_sleeping()

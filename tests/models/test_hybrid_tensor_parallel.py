"""Hybrid models under tensor parallelism on 4 CPU devices: TP=4 gives one device's greedy tokens and states (and
transformers' tokens), through chunked prefill and decode, with the linear layers' heads (their projections, convolution
channels, per-head parameters and states) split over the devices and each device running its own heads' recurrence;
sizes that do not split are clear errors. Like tests/models/test_tensor_parallel.py, the first test re-runs this
file in a subprocess with 4 devices."""

from __future__ import annotations

import numpy as np
import pytest

from tests.multi_device import needs_devices, rerun_with_devices


def test_hybrid_tp_suite_on_four_cpu_devices():
    rerun_with_devices(__file__)


# -- below: only with 4 devices ------------------------------------------------------------------

VOCAB = 256
PROMPT_LENGTHS = [3, 29, 40]
MAX_TOKENS = 16
SPLIT = dict(linear_num_key_heads=4, linear_num_value_heads=8)  # 4 key heads: 1 per device at TP=4


def _configs():
    from tests.models.test_hybrid_models import CASES

    def case(name, **changes):
        config_cls, kwargs, _ = CASES[name]
        return config_cls(**{**kwargs, **changes})

    return {
        "qwen3.5-dense": case("qwen3.5-dense-tied", **SPLIT),  # 2 KV heads: TP=4 repeats each on two devices
        "qwen3next-moe": case("qwen3next-moe-shared-dense-layer0", **SPLIT),  # 4 experts: one per device
        "nemotron-h": case("nemotron-h"),  # 8 Mamba heads in 2 groups: B and C whole on every device
    }


_PREPARED: dict = {}


def _prepare(name, tmp_path_factory):
    from tests.hf_reference import hf_greedy, random_prompts, save_hf_model
    from tests.models.test_hybrid_models import hybrid_hf_model

    if name not in _PREPARED:
        hf = hybrid_hf_model(_configs()[name])
        prompts = random_prompts(VOCAB, PROMPT_LENGTHS, seed=5)
        folder = save_hf_model(hf, tmp_path_factory.mktemp(name))
        _PREPARED[name] = folder, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return _PREPARED[name]


def _llm(folder, n):
    from jaxpaged import LLM

    return LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, block_size=8, max_model_len=128,
               tensor_parallel_size=n, attention_backend="reference", log_level="WARNING")  # fmt: skip


def _greedy(llm, prompts):
    from jaxpaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@needs_devices
@pytest.mark.parametrize("name,n", [("qwen3next-moe", 4), ("nemotron-h", 4)])
def test_tp_greedy_equals_transformers(name, n, tmp_path_factory):
    """(One device gives transformers' tokens too: tests/engine/test_hybrid_engine.py, and test_tp4_equals_one_device.)"""
    folder, prompts, expected = _prepare(name, tmp_path_factory)
    llm = _llm(folder, n)
    assert _greedy(llm, prompts) == expected
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    _check_states_split(llm, n)


def _check_states_split(llm, n):
    """Each state array with a split axis holds 1/n of it on each device; the others are whole on every device."""
    runner = llm.engine.runner
    for array in runner.state_spec.arrays:
        cache = runner.kv_cache.states[array.name]
        shards = cache.addressable_shards
        assert len(shards) == n
        for shard in shards:
            want = list(cache.shape)
            if array.split_axis is not None:
                want[2 + array.split_axis] //= n
            assert list(shard.data.shape) == want, array.name


@needs_devices
def test_linear_heads_that_do_not_split_are_an_error(tmp_path_factory):
    from tests.hf_reference import save_hf_model
    from tests.models.test_hybrid_models import CASES, hybrid_hf_model

    config_cls, kwargs, _ = CASES["qwen3.5-dense-tied"]  # 2 key heads, 4 value heads
    folder = save_hf_model(hybrid_hf_model(config_cls(**kwargs)), tmp_path_factory.mktemp("unsplittable"))
    with pytest.raises(ValueError, match="num_k_heads=2"):
        _llm(folder, 4)


@needs_devices
def test_tp4_equals_one_device(tmp_path_factory):
    """TP=4 and one device: the same greedy tokens, and the same states left in the cache after prefill chunks,
    decode rows beside them and a few decode steps."""
    from jaxpaged import SamplingParams

    folder, prompts, expected = _prepare("qwen3.5-dense", tmp_path_factory)
    states = []
    for n in (1, 4):
        llm = _llm(folder, n)
        assert _greedy(llm, prompts) == expected
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                     use_tqdm=False)  # fmt: skip
        states.append({k: np.asarray(v) for k, v in llm.engine.runner.kv_cache.states.items()})
    for name in states[0]:
        np.testing.assert_allclose(states[1][name], states[0][name], atol=1e-5, rtol=0)

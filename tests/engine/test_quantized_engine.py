"""Quantized weights and KV cache under the engine: an odd workload (prefix hits, forks, penalties, logprobs, random
stops, async scheduling) compiles nothing after warm-up and returns every KV block."""

from __future__ import annotations

import pytest

from jaxpaged.pallas_kernels.kv_quant import QuantizedKV

from tests.engine.test_async_scheduling import _assert_clean, _llm, _workload, model_dir  # noqa: F401 - the fixture


@pytest.mark.parametrize(("quantization", "kv_cache_dtype", "activations"), [("int8", "int8", False), ("fp8", "fp8", False),
                                                                           ("fp8", "auto", True)])  # fmt: skip
def test_odd_workload_compiles_nothing_after_warmup(model_dir, quantization, kv_cache_dtype, activations):  # noqa: F811
    prompts, params = _workload(seed=4)
    llm = _llm(model_dir, True, quantization=quantization, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=60,
               quantize_activations=activations)  # fmt: skip
    runner = llm.engine.runner
    assert runner.state["layers"][0]["self_attn"]["q_proj"]["kernel"][...].dtype.itemsize == 1
    assert ("x 8-bit activations" in runner.memory_plan()) == activations
    # the platform picks the fp8 dot's operands (the CPU widens them to bfloat16; fp8 GPUs take them as stored)
    assert ("fp8_operands='bfloat16'" in repr(runner.graphdef)) == activations
    assert kv_cache_dtype == "auto" or isinstance(runner.kv_cache, QuantizedKV) and runner.kv_cache.kind == kv_cache_dtype
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [p.n for p in params]
    assert all(len(c.token_ids) >= 1 for o in outs for c in o.outputs)
    _assert_clean(llm)


def test_quantize_activations_needs_per_channel_weights(model_dir):  # noqa: F811
    with pytest.raises(ValueError, match="quantize_activations needs int8 or fp8 weights"):
        _llm(model_dir, True, quantize_activations=True, num_kv_blocks=8)

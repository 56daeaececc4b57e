"""kv_cache_dtype="int8" | "fp8" through the engine: the pool holds 8-bit values and a scale per token and head,
every attention backend reads it, the logits stay within a bound of the float cache's, and blocks, forks and
preemption work as with floats."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.pallas_kernels.kv_quant import QuantizedKV
from jaxpaged.platforms.cpu import attention as cpu_attention

from tests.hf_reference import random_hf_model, random_prompts, save_hf_model, tiny_llama_config

VOCAB = 256
KINDS = ["int8", "fp8"]
# |logprob| differences of the prompt tokens against the float cache (a 2-layer random Llama, head_dim 32, whose
# logprobs average -6.9; prompts prefilled 16 tokens a step, so later chunks read earlier ones from the cache),
# (mean, max). Measured: int8 (0.021, 0.18), fp8 (0.097, 0.55): fp8 keeps 3 mantissa bits, int8 ~7 over a
# vector's range. A missing scale or a misread value gives errors of the logprobs' own size.
LOGPROB_BOUND = {"int8": (0.05, 0.4), "fp8": (0.2, 1.2)}
BACKENDS = ["reference", "native"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    hf = random_hf_model(tiny_llama_config(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2))
    return str(save_hf_model(hf, tmp_path_factory.mktemp("tiny-llama-kv")))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(VOCAB, [70, 33, 5, 120], seed=11)


def _llm(model_dir, backend="reference", **kw) -> LLM:
    if backend == "native" and not cpu_attention.available():
        pytest.skip("no C++ compiler: the native CPU kernel is not built")
    kw = {"dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 16, "block_size": 8, "log_level": "WARNING",
          "attention_backend": backend, **kw}  # fmt: skip
    return LLM(model_dir, **kw)


def _prompt_logprobs(llm, prompts) -> list[np.ndarray]:
    """Each prompt token's logprob given the tokens before it (chunked prefill: later chunks read the cache)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [np.array([lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p[1:])]) for o, p in zip(outs, prompts)]


def _greedy(llm, prompts, max_tokens=24):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]


@pytest.fixture(scope="module")
def float_run(model_dir, prompts):
    llm = _llm(model_dir)
    return _prompt_logprobs(llm, prompts)


@pytest.mark.parametrize("kind", KINDS)
def test_the_pool_holds_8_bit_values_and_scales(model_dir, kind, capfd):
    llm = _llm(model_dir, kv_cache_dtype=kind, log_level="INFO")
    runner = llm.engine.runner
    cache = runner.kv_cache
    assert isinstance(cache, QuantizedKV) and cache.kind == kind
    assert cache.data.dtype == {"int8": jnp.int8, "fp8": jnp.uint8}[kind]  # fp8 as its bits
    assert cache.scale.shape == cache.data.shape[:-1] and cache.scale.dtype == jnp.float32
    cfg = runner.model_config
    head_dim = cfg.head_dim
    assert runner.block_bytes == cfg.num_layers * 2 * cfg.num_kv_heads * 8 * (head_dim + 4)
    assert runner.block_bytes == cache.data.nbytes // runner.num_blocks + cache.scale.nbytes // runner.num_blocks
    float_runner = _llm(model_dir, kv_cache_dtype="auto").engine.runner
    assert float_runner.block_bytes / runner.block_bytes == pytest.approx(4 * head_dim / (head_dim + 4))
    plan = next(line for line in capfd.readouterr().err.splitlines() if "memory plan" in line)  # start-up says it
    assert f"in {kind}" in plan and f"up to {runner.num_blocks * 8} tokens held" in plan


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_stay_near_the_float_cache(model_dir, prompts, float_run, kind, backend):
    float_logprobs = float_run
    llm = _llm(model_dir, backend, kv_cache_dtype=kind)
    error = np.abs(np.concatenate(_prompt_logprobs(llm, prompts)) - np.concatenate(float_logprobs))
    mean_bound, max_bound = LOGPROB_BOUND[kind]
    assert 0 < error.mean() <= mean_bound and error.max() <= max_bound  # 0: the cache was never read quantized
    _greedy(llm, prompts)  # decode steps over the quantized cache, then the checks below
    stats = llm.get_stats()
    assert stats["num_compiles_after_warmup"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_backend_reads_the_same_cache_the_same_way(model_dir, prompts, kind):
    """The native kernel and the reference over one quantized cache: the same tokens, the same logprobs up to
    rounding (float32's, through the steps; a last-bit difference in a written K/V can move its 8-bit rounding,
    hence 1e-3 rather than the float cache's 1e-4)."""
    runs = {b: _greedy(_llm(model_dir, b, kv_cache_dtype=kind), prompts) for b in BACKENDS}
    assert runs["native"][0] == runs["reference"][0]
    np.testing.assert_allclose(np.concatenate(runs["native"][1]), np.concatenate(runs["reference"][1]), atol=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_forks_prefix_hits_and_preemption_over_a_quantized_cache(model_dir, prompts, kind):
    """Copy-on-write copies a block's scales with its values; a tiny pool preempts and recomputes. Seeded samples
    of n=3 over a shared prompt and greedy repeats of a cached prefix equal those of a roomy pool."""
    shared = prompts[0]
    requests = [{"prompt_token_ids": shared}, {"prompt_token_ids": shared + [5, 6, 7]}, {"prompt_token_ids": prompts[3]}]
    params = [SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=20), SamplingParams(temperature=0.0, max_tokens=20),
              SamplingParams(temperature=0.0, max_tokens=20)]  # fmt: skip
    runs, preemptions = [], []
    for blocks in (None, 24):
        llm = _llm(model_dir, kv_cache_dtype=kind, num_kv_blocks=blocks)
        outs = llm.generate(requests, params, use_tqdm=False)
        runs.append([[list(c.token_ids) for c in o.outputs] for o in outs])
        stats = llm.get_stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_compiles_after_warmup"] == 0
        preemptions.append(stats["num_preemptions"])
    assert preemptions[0] == 0 and preemptions[1] > 0
    assert runs[0] == runs[1]

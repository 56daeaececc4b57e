"""LLM(batch_invariant=True): a request's greedy tokens, and their logprobs bit for bit, are the same alone and
inside any batch (without the mode, this tiny model's logprobs already differ in the last bits: 0 of 8 bitwise
identical in float32 when this was written; see scripts/bench_batch_invariance.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jaxpaged.pallas_kernels import AttentionSpec, stack_new_kv, write_kv
from jaxpaged.pallas_kernels.reference import naive_paged_attention, reference_paged_attention

from jaxpaged import LLM, SamplingParams
from tests.attention_cases import random_case
from tests.hf_reference import random_hf_model, random_prompts, save_hf_model, tiny_llama_config

VOCAB = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    hf = random_hf_model(tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))
    return str(save_hf_model(hf, tmp_path_factory.mktemp("tiny-llama-invariant")))


def test_invariant_attention_equals_the_definition():
    case = random_case(np.random.default_rng(0), seq_lens=[37, 5, 300, 129], q_lens=[1, 5, 40, 1], num_heads=8,
                       num_kv_heads=2, head_dim=32, block_size=16)  # fmt: skip
    written = write_kv(case.kv_cache, stack_new_kv([(case.k, case.v)]), case.attn_metadata.slot_mapping)
    for window in (None, 9):
        want = naive_paged_attention(case.q, written, 0, case.attn_metadata, AttentionSpec(0.2, window))
        got = jax.jit(lambda q, k, v, c, attn_metadata, w=window: reference_paged_attention(
            q, k, v, c, 0, attn_metadata, AttentionSpec(0.2, w), batch_invariant=True))(case.q, case.k, case.v, case.kv_cache, case.attn_metadata)  # fmt: skip
        n = case.num_real_tokens
        np.testing.assert_allclose(np.asarray(got[:n]), np.asarray(want[:n]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_tokens_alone_and_in_any_batch(model_dir, dtype):
    llm = LLM(model_dir, dtype=dtype, max_num_seqs=16, max_num_batched_tokens=64, block_size=8, batch_invariant=True,
              log_level="WARNING")  # fmt: skip
    assert llm.engine.runner.buckets == [64]
    assert llm.engine.loaded.model.layers[0].self_attn.backend.name == "reference_invariant"
    targets = random_prompts(VOCAB, [3, 20, 45, 90], seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)

    def tokens_and_logprobs(out):
        c = out.outputs[0]
        return c.token_ids, [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)]

    alone = [tokens_and_logprobs(o) for o in llm.generate([{"prompt_token_ids": t} for t in targets], greedy,
                                                          use_tqdm=False)]  # fmt: skip
    rng = np.random.default_rng(2)
    for size in (8, 32):
        for i, target in enumerate(targets):
            others = random_prompts(VOCAB, rng.integers(2, 120, size=size).tolist(), seed=int(rng.integers(1 << 30)))
            params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True)
                      for m in rng.integers(4, 40, size=size)]  # fmt: skip
            place = int(rng.integers(0, size + 1))
            batch = [{"prompt_token_ids": p} for p in others]
            batch.insert(place, {"prompt_token_ids": target})
            params.insert(place, greedy)
            got = tokens_and_logprobs(llm.generate(batch, params, use_tqdm=False)[place])
            assert got == alone[i], (dtype, size, i)  # the logprobs compared exactly, not approximately
    assert llm.get_stats()["num_compiles_after_warmup"] == 0

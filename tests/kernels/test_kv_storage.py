"""16-bit KV caches on CPU are stored as uint16 bits, so writing a step's K/V stays in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpaged import platforms
from jaxpaged.pallas_kernels import AttentionMetadata, AttentionSpec, ReferenceAttention, kv_cache_shape, paged_attention, write_kv
from jaxpaged.pallas_kernels.reference import naive_paged_attention

SHAPE = kv_cache_shape(2, 2, 8, 4, 16)  # layers, KV heads, blocks, block size, head dim


def kv_storage_dtype(dtype, platform):
    return platforms.get(platform).kv_storage_dtype(dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cpu_stores_16_bit_floats_as_bits_and_reads_them_back_exactly(dtype):
    assert kv_storage_dtype(dtype, "cpu") == jnp.uint16
    assert kv_storage_dtype(dtype, "gpu") == jnp.dtype(dtype) and kv_storage_dtype(jnp.float32, "cpu") == jnp.float32
    rng = np.random.default_rng(0)
    new = jnp.asarray(rng.normal(size=(5, 2, 2, 2, 16)), dtype)  # [T, L, 2, H_kv, D]
    slots = jnp.asarray([0, 1, 2, 9, -1], jnp.int32)
    as_bits = write_kv(jnp.zeros(SHAPE, jnp.uint16), new, slots)
    as_floats = write_kv(jnp.zeros(SHAPE, dtype), new, slots)
    assert as_bits.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(as_bits, dtype)), np.asarray(as_floats))
    # attention over either cache gives the same bits
    q = jnp.asarray(rng.normal(size=(1, 4, 16)), dtype)
    attn_metadata = AttentionMetadata(
        slot_mapping=jnp.asarray([10], jnp.int32), block_tables=jnp.asarray([[0, 3, 2]], jnp.int32),
        seq_lens=jnp.asarray([11], jnp.int32), query_start_loc=jnp.asarray([0, 1], jnp.int32),
    )
    k_new, v_new = new[3:4, 0, 0], new[3:4, 0, 1]
    outs = [paged_attention(q, k_new, v_new, cache, 0, attn_metadata, AttentionSpec(0.25), backend=ReferenceAttention()) for cache in (as_bits, as_floats)]
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
    assert not np.allclose(np.asarray(outs[0], np.float32), 0)
    with_new = write_kv(as_floats, new[3:4], attn_metadata.slot_mapping)  # the naive form reads this step's K/V from the cache
    ref = naive_paged_attention(q, with_new, 0, attn_metadata, AttentionSpec(0.25))
    np.testing.assert_allclose(np.asarray(outs[0], np.float32), np.asarray(ref, np.float32), atol=2e-2)


def test_bf16_write_does_not_convert_the_whole_cache():
    """XLA:CPU upcasts a bfloat16 scatter through float32 (a full copy each way); the uint16 form must not."""
    shape = kv_cache_shape(4, 2, 256, 16, 64)
    new = jax.ShapeDtypeStruct((16, 4, 2, 2, 64), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((16,), jnp.int32)
    full = "[" + ",".join(map(str, shape)) + "]"

    def compiled(cache_dtype) -> str:
        cache = jax.ShapeDtypeStruct(shape, cache_dtype)
        return jax.jit(write_kv, donate_argnums=(0,)).lower(cache, new, slots).compile().as_text()

    assert f"f32{full}" in compiled(jnp.bfloat16)  # the problem this storage avoids, still there
    assert f"f32{full}" not in compiled(jnp.uint16)


def test_bf16_engine_gives_the_same_bits_with_either_storage(tmp_path, monkeypatch):
    """The uint16 storage changes where the bits live, never the arithmetic: a bfloat16 engine's greedy tokens and
    logprobs are bit-identical to the same engine storing bfloat16 (chunked prefill, cached context, decode)."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.platforms.cpu import CpuPlatform
    from tests.hf_reference import random_hf_model, random_prompts, save_hf_model, tiny_llama_config

    model_dir = str(save_hf_model(random_hf_model(tiny_llama_config(max_position_embeddings=256)), tmp_path / "m"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(256, [5, 40, 90], seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)

    def run():
        llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=32, block_size=8, log_level="WARNING")
        outs = llm.generate(prompts, params, use_tqdm=False)
        dtype = llm.engine.runner.kv_cache.dtype
        return dtype, [(c.token_ids, [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)]) for c in (o.outputs[0] for o in outs)]

    bits_dtype, as_bits = run()
    monkeypatch.setattr(CpuPlatform, "kv_storage_dtype", lambda self, dtype: dtype)
    float_dtype, as_floats = run()
    assert (bits_dtype, float_dtype) == (jnp.uint16, jnp.bfloat16)
    assert as_bits == as_floats


@pytest.mark.parametrize("dtype,tied", [("bfloat16", True), ("bfloat16", False), ("float32", True)])
def test_tied_16_bit_head_on_cpu_keeps_a_transposed_table(tmp_path, dtype, tied):
    """XLA:CPU converts the table of a 16-bit `x @ E.T` to float32 on every call; a tied 16-bit head on CPU
    reads a transposed copy instead, with the same logits."""
    from flax import nnx
    from jaxpaged.models.loader import load_model

    from tests.hf_reference import random_hf_model, save_hf_model, tiny_llama_config

    model_dir = save_hf_model(random_hf_model(tiny_llama_config(tie_word_embeddings=tied)), tmp_path / "m")
    model = load_model(str(model_dir), dtype=dtype).model
    platforms.get("cpu").prepare_model(model, "xla", dtype=dtype, tensor_parallel_size=1)
    emb = model.embed_tokens
    emb.output_kernel = getattr(emb, "output_kernel", None)
    assert (emb.output_kernel is not None) == (tied and dtype != "float32")
    hidden = jnp.asarray(np.random.default_rng(0).normal(size=(8, 64)), dtype)
    logits = nnx.jit(lambda m, h: m.compute_logits(h))(model, hidden)
    assert logits.dtype == jnp.float32
    if emb.output_kernel is not None:
        table = emb.embedding[...]
        np.testing.assert_array_equal(np.asarray(emb.output_kernel[...]), np.asarray(table.T))
        want = jnp.dot(hidden, table.T, preferred_element_type=jnp.float32)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)
        def compiled(fn, weight):
            return jax.jit(lambda h, w: jnp.dot(h, fn(w), preferred_element_type=jnp.float32)).lower(hidden, weight).compile().as_text()

        assert "f32[256,64]" in compiled(lambda w: w.T, table)  # the problem: E converted to float32
        assert "f32[64,256]" not in compiled(lambda w: w, emb.output_kernel[...])  # [in, out]: no float32 copy

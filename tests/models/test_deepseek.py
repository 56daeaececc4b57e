"""DeepSeek-V2/V3 (multi-head latent attention) against transformers in float32: logits within 1e-4 at every position of
prompts of 1-77 tokens and greedy tokens identical (V3: q low-rank, YaRN with mscale and mscale_all_dim, the sigmoid
router with groups, correction bias and scaling; V2-Lite's shape: q_proj, the softmax router, group-limited, attention
biases); the MLA reference against its definition; the router against transformers'; through the engine with chunked
prefill, preemption and prefix caching, compiling nothing after warm-up; the latent cache's bytes per token."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import transformers
from jaxpaged.models.loader import load_model

from tests.hf_reference import (
    engine_matches_transformers, hf_greedy, hf_logits, random_hf_model, random_prompts, save_hf_model,
)
from tests.static_batch import StaticBatchRunner

torch = pytest.importorskip("torch")

VOCAB = 256
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=32,
    num_experts_per_tok=2, n_routed_experts=8, first_k_dense_replace=1, max_position_embeddings=512,
    bos_token_id=0, eos_token_id=1, pad_token_id=0,
)  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.8,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0}  # fmt: skip


def _configs():
    return {
        # DeepSeek-V3 / Kimi K2 / Moonlight: q low-rank, YaRN (prompts run past its original 64), 4 groups of 2 experts
        "v3": transformers.DeepseekV3Config(**BASE, q_lora_rank=48, n_shared_experts=1, routed_scaling_factor=2.5,
                                            n_group=4, topk_group=2, rope_parameters=YARN),
        # DeepSeek-V2-Lite's shape (no q low-rank) with V2's group-limited softmax router (a group's best score
        # ranks it: with top-2 experts, one group of 2 binds) and attention biases
        "v2": transformers.DeepseekV2Config(**BASE, q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.5,
                                            n_group=4, topk_group=1, topk_method="group_limited_greedy",
                                            attention_bias=True),
        # a latent row of 48 + 16: planes of 32, which the MLA GPU kernel takes (tiles of 16 or more)
        "v3-kernel": transformers.DeepseekV3Config(**{**BASE, "kv_lora_rank": 48}, q_lora_rank=48, n_shared_experts=1,
                                                   n_group=4, topk_group=2),
        # V3 with rotate-half RoPE (rope_interleave false) and no groups
        "v3-half": transformers.DeepseekV3Config(**BASE, q_lora_rank=48, n_shared_experts=1, n_group=1, topk_group=1,
                                                 rope_interleave=False),
    }  # fmt: skip


def deepseek_hf(name: str):
    """A random model; V3's e_score_correction_bias (a buffer random_hf_model leaves at zero) random too."""
    hf = random_hf_model(_configs()[name])
    with torch.no_grad():
        for buffer_name, b in hf.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return hf


_SAVED: dict = {}


def _saved(name, tmp_path_factory):
    if name not in _SAVED:
        hf = deepseek_hf(name)
        _SAVED[name] = hf, save_hf_model(hf, tmp_path_factory.mktemp(name))
    return _SAVED[name]


@pytest.mark.parametrize("name", ["v3", "v2"])
def test_logits_and_greedy_match_transformers(name, tmp_path_factory):
    hf, folder = _saved(name, tmp_path_factory)
    loaded = load_model(str(folder), dtype="float32")
    cfg = loaded.config
    assert cfg.architecture == ("DeepseekV3ForCausalLM" if name == "v3" else "DeepseekV2ForCausalLM")
    assert (cfg.num_kv_heads, 2 * cfg.head_dim) == (1, 32 + 16)  # the cache row: latent and RoPE key
    prompts = random_prompts(VOCAB, [1, 9, 40, 77], seed=7)
    greedy, logits = StaticBatchRunner(loaded, block_size=8).generate(prompts, 16, return_prompt_logits=True)
    for prompt, got_logits, got_tokens in zip(prompts, logits, greedy):
        np.testing.assert_allclose(got_logits, hf_logits(hf, prompt), atol=1e-4, rtol=0)
        assert got_tokens == hf_greedy(hf, prompt, 16)


def test_rotate_half_rope_and_chunked_prefill(tmp_path_factory):
    """rope_interleave false; prompts in 16-token chunks, so later chunks read earlier ones' latents absorbed."""
    hf, folder = _saved("v3-half", tmp_path_factory)
    loaded = load_model(str(folder), dtype="float32")
    assert not loaded.config.rope_interleaved
    prompts = random_prompts(VOCAB, [5, 40, 77], seed=3)
    for got, prompt in zip(StaticBatchRunner(loaded, block_size=8).prompt_logits(prompts, prefill_chunk=16), prompts):
        np.testing.assert_allclose(got, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_yarn_mscale_reaches_softmax_scale():
    """The softmax scale is qk_head_dim^-0.5 times mscale(factor, mscale_all_dim)^2, transformers' own number."""
    from jaxpaged.models.deepseek import DeepseekForCausalLM, MlaOptions

    hf_config = _configs()["v3"]
    cfg = DeepseekForCausalLM.config_from_hf(hf_config, "DeepseekV3ForCausalLM")
    attn = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(hf_config, 0)
    assert MlaOptions.of(cfg).scale == pytest.approx(attn.scaling, rel=1e-12)
    assert attn.scaling != pytest.approx(48**-0.5)  # the correction is in play


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_router_matches_transformers(version):
    """grouped_route against transformers' router on 64 random tokens (group limits and the bias change choices)."""
    from jaxpaged.models.deepseek import router_options_from_hf
    from jaxpaged.models.moe import MoeOptions, grouped_route

    hf_config = _configs()[version]
    module = transformers.models.deepseek_v3.modeling_deepseek_v3 if version == "v3" else transformers.models.deepseek_v2.modeling_deepseek_v2
    router = (module.DeepseekV3TopkRouter if version == "v3" else module.DeepseekV2TopkRouter)(hf_config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5)
        if version == "v3":
            router.e_score_correction_bias.copy_(0.3 * torch.randn(8))
    x = torch.randn(64, 64)
    with torch.no_grad():
        logits, want_w, want_ids = router(x)
    moe = MoeOptions(8, 2, 32, renormalize=version == "v3")
    logits = logits.numpy()  # transformers' own float32 logits: the routing alone is compared
    bias = router.e_score_correction_bias.numpy() if version == "v3" else None
    opts = router_options_from_hf(hf_config, version == "v3", moe)
    got_w, got_ids = grouped_route(logits, 2, opts, bias)
    order = np.argsort(want_ids.numpy(), axis=1)  # transformers' top-k is unsorted
    want_ids_sorted, want_w_sorted = np.take_along_axis(want_ids.numpy(), order, 1), np.take_along_axis(want_w.numpy(), order, 1)
    mine = np.argsort(np.asarray(got_ids), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(got_ids), mine, 1), want_ids_sorted)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(got_w), mine, 1), want_w_sorted, rtol=1e-6, atol=1e-7)
    # without the group limit some tokens would choose differently: the limit is exercised
    free_ids = np.asarray(grouped_route(logits, 2, dataclasses.replace(opts, num_groups=1), bias)[1])
    assert (np.sort(free_ids, 1) != want_ids_sorted).any()


def test_mla_reference_equals_its_definition():
    """A ragged step: a decode row over 150 cached tokens (two context chunks), a 5-token chunk after 20 cached, a
    fresh 9-token prompt, padding; the reference (this step's latents not yet written) against the expanded definition."""
    import jax
    import jax.numpy as jnp
    from jaxpaged.pallas_kernels import AttentionMetadata, kv_cache_shape, write_kv
    from jaxpaged.pallas_kernels.attention import stack_new_kv
    from jaxpaged.pallas_kernels.mla import latent_planes, mla_reference, naive_mla_attention

    rank, rope, nope, heads, vdim, bs = 32, 16, 24, 4, 20, 4
    rng = np.random.default_rng(0)
    cached, new = [150, 20, 0], [1, 5, 9]
    width = -(-max(c + n for c, n in zip(cached, new)) // bs)
    tables = np.arange(3 * width, dtype=np.int32).reshape(3, width)[:, ::-1].copy()  # blocks out of order
    cache = jnp.asarray(rng.standard_normal(kv_cache_shape(2, 1, 3 * width, bs, (rank + rope) // 2)), jnp.float32)
    t = 16
    qsl = np.array([0, 1, 6, 15], np.int32)
    slots = np.full(t, -1, np.int32)
    for s, (c, n) in enumerate(zip(cached, new)):
        p = np.arange(c, c + n)
        slots[qsl[s] : qsl[s] + n] = tables[s][p // bs] * bs + p % bs
    md = AttentionMetadata(jnp.asarray(slots), jnp.asarray(tables), jnp.asarray(np.add(cached, new), np.int32), jnp.asarray(qsl))
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = f(t, heads, nope), f(t, heads, rope), f(t, rank), f(t, rope), f(rank, heads, nope), f(rank, heads, vdim)
    scale = 0.1
    # each side one compiled program (op by op, their hundreds of small ops each compiled alone)
    got = jax.jit(mla_reference, static_argnums=(7, 9))(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, cache, 1, md, scale)
    written = write_kv(cache, stack_new_kv([latent_planes(c_kv, k_pe)] * 2), md.slot_mapping)
    want = jax.jit(naive_mla_attention, static_argnums=(5, 7))(q_nope, q_pe, w_uk, w_uv, written, 1, md, scale)
    np.testing.assert_allclose(np.asarray(got)[:15], np.asarray(want)[:15], rtol=2e-5, atol=2e-5)
    assert not np.asarray(got)[15:].any()  # padding rows
    assert np.abs(np.asarray(want)).max() > 0.1
    jax.clear_caches()


def test_latent_cache_holds_latent_and_rope_key_per_token():
    """DeepSeek-V3's real shapes: 576 values (kv_lora_rank 512 + qk_rope_head_dim 64) a token and layer, against
    128 heads x (192 + 128) = 40,960 expanded."""
    from jaxpaged.models.deepseek import DeepseekForCausalLM, MlaOptions

    cfg = DeepseekForCausalLM.config_from_hf(transformers.DeepseekV3Config(), "DeepseekV3ForCausalLM")
    mla = MlaOptions.of(cfg)
    assert cfg.num_kv_heads * 2 * cfg.head_dim == mla.latent_width == 576  # what the pool's block holds per token
    assert mla.expanded_width(cfg.num_heads) == 128 * (128 + 64 + 128)


def test_engine_chunked_prefill_preemption_prefix_cache(tmp_path_factory):
    """Through jaxpaged.LLM: 8-token steps (buckets 4 and 8: prompts in chunks beside decode rows), a pool small enough
    to preempt (28 blocks of 4), repeated prompts hitting the prefix cache; greedy tokens equal transformers', nothing
    compiles after warm-up, and a token costs (R + P) values a layer."""
    hf, folder = _saved("v3", tmp_path_factory)
    llm = engine_matches_transformers(hf, folder, VOCAB, max_num_seqs=4, max_num_batched_tokens=8, num_kv_blocks=28)
    stats = llm.get_stats()
    assert stats["kv_bytes_per_token"] == 2 * (32 + 16) * 4  # 2 layers x (latent + RoPE key) x float32
    assert llm.engine.runner.kv_cache.shape[3] == 1  # one latent "head"


def test_batch_invariant_attention_is_refused():
    """MLA has no batch-invariant path: asking for one is a ValueError, not a silently variant result."""
    from jaxpaged.models.deepseek import DeepseekForCausalLM, MlaAttention
    from jaxpaged.pallas_kernels import ReferenceAttention

    cfg = DeepseekForCausalLM.config_from_hf(_configs()["v3"], "DeepseekV3ForCausalLM")
    MlaAttention(cfg, 0, dtype=np.float32, attention=ReferenceAttention())
    with pytest.raises(ValueError, match="batch_invariant"):
        MlaAttention(cfg, 0, dtype=np.float32, attention=ReferenceAttention(batch_invariant=True))


def test_engine_with_the_mla_kernel_interpreted(tmp_path_factory):
    """attention_backend="pallas" on the CPU: the absorbed part runs pallas_kernels/mla_gpu.py's Triton kernel in
    interpret mode (its own test checks it against the reference); greedy tokens equal transformers' through 8-token
    chunks and decode (buckets 4 and 8)."""
    from jaxpaged.pallas_kernels import TritonAttention

    from jaxpaged import LLM, SamplingParams

    hf, folder = _saved("v3-kernel", tmp_path_factory)
    prompts = random_prompts(VOCAB, [45, 5, 30], seed=4)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, block_size=4,
              attention_backend="pallas", log_level="WARNING")  # fmt: skip
    assert isinstance(llm.engine.loaded.model.layers[0].self_attn.backend, TritonAttention)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in prompts]
    assert llm.get_stats()["num_compiles_after_warmup"] == 0

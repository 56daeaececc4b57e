"""The open-weight families of 2025-26 against transformers in float32: logits within 1e-4 at every position of
prompts of 1-77 tokens (whole and in 32-token chunks) and greedy tokens identical after either, on tiny random configs
written by transformers (2 layers, hidden 64); the MoE families also through jaxpaged.LLM with 8-token steps (prompts
in chunks beside decode rows), preemption and prefix-cache hits, compiling nothing after warm-up. Every weight is
random (std 0.15), the routers' correction biases too (random_hf_model leaves buffers alone)."""

from __future__ import annotations

import json

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
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-5,
    bos_token_id=0, eos_token_id=1, pad_token_id=0,
)  # fmt: skip

# name -> (config class, kwargs, architecture the loader must pick)
CASES = {
    # GLM-4.5's layout: layer 0 dense, layer 1 routed (8 experts in 4 groups, 2 groups a token, top-2, renormalized,
    # scaled 2.5) with a shared expert; q/k/v biases, per-head q/k norm, rotary on half of each 32-wide head
    "glm4moe-groups-qknorm-bias": (
        transformers.Glm4MoeConfig,
        dict(BASE, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
             first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
             attention_bias=True, tie_word_embeddings=False),
        "Glm4MoeForCausalLM",
    ),
    # MiniMax-M2's layout: every layer routed (8 experts, top-2, sigmoid + correction bias, renormalized), q/k norm
    # over the whole projection, rotary on 16 of 32 dims in the released spelling (`rotary_dim`), GQA 2:1
    "minimax-m2-qknorm-rotary16": (
        transformers.MiniMaxM2Config,
        dict(BASE, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=16,
             num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False),
        "MiniMaxM2ForCausalLM",
    ),
    # OLMo 2: post-norm, q/k norm over the whole projection, biases on all four projections, GQA 2:1, tied
    "olmo2-bias-gqa2-tied": (
        transformers.Olmo2Config,
        dict(BASE, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
             tie_word_embeddings=True),
        "Olmo2ForCausalLM",
    ),
    # OLMo 3: a sliding layer (window 16, shorter than the prompts) and a full one with YaRN past 64 positions (the
    # sliding layer's RoPE unscaled, as released configs have it), untied
    "olmo3-sliding-full-yarn": (
        transformers.Olmo3Config,
        dict(BASE, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, sliding_window=16,
             layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
             rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                           "attention_factor": 1.2, "rope_theta": 10000.0}),
        "Olmo3ForCausalLM",
    ),
    # SmolLM3: layer 1 of 2 without RoPE (no_rope_layers), GQA 2:1, tied, as the released 3B (every fourth layer NoPE)
    "smollm3-nope-layer1-tied": (
        transformers.SmolLM3Config,
        dict(BASE, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, no_rope_layers=[1, 0],
             tie_word_embeddings=True),
        "SmolLM3ForCausalLM",
    ),
    # Seed-OSS: q/k/v biases without an o_proj bias (attention_out_bias false, as released), head_dim 32, untied
    "seed-oss-qkv-bias": (
        transformers.SeedOssConfig,
        dict(BASE, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             attention_bias=True, attention_out_bias=False, tie_word_embeddings=False),
        "SeedOssForCausalLM",
    ),
    # Granite 3.x: the four multipliers at values like the released 3.x models' (embedding 12, attention 1/64 here,
    # residual 0.22, logits divided by 8), GQA 2:1, tied
    "granite-multipliers-tied": (
        transformers.GraniteConfig,
        dict(BASE, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=12.0,
             attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=8.0, tie_word_embeddings=True),
        "GraniteForCausalLM",
    ),
}

PROMPT_LENGTHS = [1, 9, 33, 77]
GREEDY_TOKENS = 32
CHUNK = 32  # the first chunked step (74 tokens) pads to the whole step's 128: both run one compiled step


def hf_model(case: str):
    """A random model of the case, its routers' e_score_correction_bias random too."""
    config_cls, kwargs, _ = CASES[case]
    hf = random_hf_model(config_cls(**kwargs))
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return hf


_SAVED: dict = {}


def saved(case: str, tmp_path_factory):
    if case not in _SAVED:
        hf = hf_model(case)
        _SAVED[case] = hf, save_hf_model(hf, tmp_path_factory.mktemp(case))
    return _SAVED[case]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_match_transformers(case, tmp_path_factory):
    hf, folder = saved(case, tmp_path_factory)
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.config.architecture == CASES[case][2]
    assert set(loaded.skipped_tensors) <= {"the rotary cache: recomputed from the config"}
    prompts = random_prompts(VOCAB, PROMPT_LENGTHS, seed=7)
    runner = StaticBatchRunner(loaded, block_size=8)
    greedy, logits = runner.generate(prompts, GREEDY_TOKENS, return_prompt_logits=True)
    greedy_chunked, chunked = runner.generate(prompts, GREEDY_TOKENS, return_prompt_logits=True, prefill_chunk=CHUNK)
    assert greedy_chunked == greedy
    for prompt, got, got_chunked, tokens in zip(prompts, logits, chunked, greedy):
        want = hf_logits(hf, prompt)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        np.testing.assert_allclose(got_chunked, want, atol=1e-4, rtol=0)
        assert tokens == hf_greedy(hf, prompt, GREEDY_TOKENS)


def engine_case(case, tmp_path_factory):
    """Through jaxpaged.LLM: 8-token steps (buckets 4 and 8: prompts in chunks beside decode rows), a pool small
    enough to preempt (28 blocks of 4), prompts sharing prefixes."""
    hf, folder = saved(case, tmp_path_factory)
    engine_matches_transformers(hf, folder, VOCAB, max_num_seqs=4, max_num_batched_tokens=8, num_kv_blocks=28)


# -- GLM-4.5 ------------------------------------------------------------------------------------------------------


def test_glm4_moe_engine(tmp_path_factory):
    engine_case("glm4moe-groups-qknorm-bias", tmp_path_factory)


def test_glm4_moe_router_is_transformers_and_its_group_limit_binds():
    """grouped_route with GLM's options against Glm4MoeTopkRouter on 64 random tokens; without the group limit some
    tokens would choose otherwise."""
    import dataclasses

    from jaxpaged.models.glm4_moe import Glm4MoeForCausalLM
    from jaxpaged.models.moe import RouterOptions, grouped_route

    config = CASES["glm4moe-groups-qknorm-bias"][0](**CASES["glm4moe-groups-qknorm-bias"][1])
    router = transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5)
        router.e_score_correction_bias.copy_(0.3 * torch.randn(8))
        logits, want_w, want_ids = router(torch.randn(64, 64))
    opts = RouterOptions(**dict(Glm4MoeForCausalLM.config_from_hf(config, "Glm4MoeForCausalLM").option("router")))
    assert (opts.num_groups, opts.topk_groups, opts.scaling, opts.renormalize) == (4, 2, 2.5, True)
    bias = router.e_score_correction_bias.numpy()
    got_w, got_ids = (np.asarray(a) for a in grouped_route(logits.numpy(), 2, opts, bias))
    order, mine = np.argsort(want_ids.numpy(), 1), np.argsort(got_ids, 1)
    want_sorted = np.take_along_axis(want_ids.numpy(), order, 1)
    np.testing.assert_array_equal(np.take_along_axis(got_ids, mine, 1), want_sorted)
    np.testing.assert_allclose(np.take_along_axis(got_w, mine, 1), np.take_along_axis(want_w.numpy(), order, 1),
                               rtol=1e-6, atol=1e-7)  # fmt: skip
    free = np.asarray(grouped_route(logits.numpy(), 2, dataclasses.replace(opts, num_groups=1), bias)[1])
    assert (np.sort(free, 1) != want_sorted).any()


def test_glm4_moe_mtp_layer_is_skipped_unread(tmp_path_factory, tmp_path):
    """GLM-4.5 checkpoints store their MTP layer as model.layers.{num_hidden_layers}.*: skipped, named, not read."""
    import shutil

    from jaxpaged.models.deepseek import MTP_LAYERS
    from safetensors.numpy import load_file, save_file

    hf, folder = saved("glm4moe-groups-qknorm-bias", tmp_path_factory)
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    extra = {f"model.layers.2.{n}": np.ones((4, 4), np.float32) for n in ("eh_proj.weight", "enorm.weight",
                                                                           "mlp.experts.0.up_proj.weight")}  # fmt: skip
    save_file(tensors | extra, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_model(str(tmp_path), dtype="float32")
    assert sorted(loaded.skipped_tensors[MTP_LAYERS]) == sorted(extra)
    prompt = random_prompts(VOCAB, [12], seed=2)[0]
    got = StaticBatchRunner(loaded, block_size=8).prompt_logits([prompt])[0]
    np.testing.assert_allclose(got, hf_logits(hf, prompt), atol=1e-4, rtol=0)


# -- MiniMax-M2 ---------------------------------------------------------------------------------------------------


def test_minimax_m2_engine(tmp_path_factory):
    engine_case("minimax-m2-qknorm-rotary16", tmp_path_factory)


def test_minimax_m2_released_spellings_load(tmp_path_factory, tmp_path):
    """The hub's layout: block_sparse_moe.{gate, e_score_correction_bias, experts.N.w1/w2/w3} (transformers renames
    them on load) and MTP modules after the last layer (skipped, named); rotary_dim read (16 of 32 dims)."""
    import shutil

    from jaxpaged.models.deepseek import MTP_LAYERS
    from safetensors.numpy import load_file, save_file

    hf, folder = saved("minimax-m2-qknorm-rotary16", tmp_path_factory)
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_mtp_modules": 1}))
    out = {}
    for name, w in load_file(str(tmp_path / "model.safetensors")).items():
        name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, D] -> per expert w1 (gate), w3 (up)
            for e, (g, u) in enumerate(zip(*np.split(w, 2, axis=1))):
                out[name.replace("gate_up_proj", f"{e}.w1.weight")] = g
                out[name.replace("gate_up_proj", f"{e}.w3.weight")] = u
        elif name.endswith("experts.down_proj"):
            out |= {name.replace("down_proj", f"{e}.w2.weight"): d for e, d in enumerate(w)}
        else:
            out[name] = w
    assert any(".block_sparse_moe.experts.7.w2.weight" in n for n in out)
    mtp = {"model.layers.2.eh_proj.weight": np.ones((4, 4), np.float32)}
    save_file(out | mtp, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_model(str(tmp_path), dtype="float32")
    assert loaded.config.rotary_dim == 16
    assert sorted(loaded.skipped_tensors[MTP_LAYERS]) == sorted(mtp)
    prompt = random_prompts(VOCAB, [20], seed=2)[0]
    got = StaticBatchRunner(loaded, block_size=8).prompt_logits([prompt])[0]
    np.testing.assert_allclose(got, hf_logits(hf, prompt), atol=1e-4, rtol=0)


# -- OLMo 2 / 3 ---------------------------------------------------------------------------------------------------


def test_olmo3_ropes_per_layer_type(tmp_path_factory):
    """The full layer's YaRN and the sliding layer's plain RoPE are both read (and the window)."""
    _, folder = saved("olmo3-sliding-full-yarn", tmp_path_factory)
    cfg = load_model(str(folder), dtype="float32").config
    assert cfg.rope.rope_type == "yarn" and cfg.option("sliding_rope").rope_type == "default"
    assert cfg.sliding_windows == (16, None) and cfg.max_position_embeddings == 512


# -- SmolLM3 ------------------------------------------------------------------------------------------------------


def test_smollm3_nope_layer_matters(tmp_path_factory):
    """The NoPE layer is read as such, and rotating there would change transformers' logits (so the flag is tested)."""
    import copy

    hf, folder = saved("smollm3-nope-layer1-tied", tmp_path_factory)
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.config.option("nope_layers") == (1,)
    prompt = random_prompts(VOCAB, [20], seed=2)[0]
    hf = copy.deepcopy(hf)  # the shared model stays as saved
    for layer in hf.model.layers:
        layer.self_attn.use_rope = 1
    assert np.abs(hf_logits(hf, prompt) - StaticBatchRunner(loaded, block_size=8).prompt_logits([prompt])[0]).max() > 1e-2


def test_olmo3_engine_with_kv_cache_groups(tmp_path_factory):
    """OLMo 3's sliding layer (window 16) beside a full one: KV cache groups, chunks, preemption, the prefix cache."""
    engine_case("olmo3-sliding-full-yarn", tmp_path_factory)

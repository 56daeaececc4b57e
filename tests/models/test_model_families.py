"""Every supported family against transformers, in float32: logits within 1e-4 and 64 greedy tokens identical.

Each case is a tiny random config built with transformers (2 layers, hidden 64) varied the way real
checkpoints vary: tied and untied embeddings, GQA/MQA ratios, biases, partial rotary, the layer-norm
layouts, ALiBi. Weights are random with std 0.15 (biases and norms too), so a wrong mapping shows.
"""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from jaxpaged.models.loader import load_model

from tests.hf_reference import hf_greedy, hf_logits, random_hf_model, random_prompts, save_hf_model
from tests.static_batch import StaticBatchRunner

VOCAB = 256
LLAMA_LIKE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=512,
    rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=0,
)  # fmt: skip

GPT_LIKE = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_positions=256, bos_token_id=0, eos_token_id=1)
NEOX_LIKE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256,
    bos_token_id=0, eos_token_id=1,
)  # fmt: skip
OPT_LIKE = dict(
    vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, max_position_embeddings=256,
    bos_token_id=0, eos_token_id=1, pad_token_id=0,
)  # fmt: skip

FALCON_LIKE = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
)  # fmt: skip
BLOOM_LIKE = dict(vocab_size=VOCAB, n_layer=2, bos_token_id=0, eos_token_id=1, pad_token_id=0)
MPT_LIKE = dict(vocab_size=VOCAB, n_layers=2, max_seq_len=256, bos_token_id=0, eos_token_id=1)

# name -> (config class, kwargs, architecture the loader must pick)
CASES = {
    "mistral-gqa2-window16": (
        transformers.MistralConfig,
        dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, sliding_window=16, tie_word_embeddings=False),
        "MistralForCausalLM",
    ),
    "mistral-mqa-tied-window40": (
        transformers.MistralConfig,
        dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=40,
             tie_word_embeddings=True),
        "MistralForCausalLM",
    ),
    "qwen2-gqa4-tied": (
        transformers.Qwen2Config,
        dict(LLAMA_LIKE, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
        "Qwen2ForCausalLM",
    ),
    "qwen2-window-on-layer-1": (
        transformers.Qwen2Config,
        dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=4, use_sliding_window=True, sliding_window=12,
             max_window_layers=1, tie_word_embeddings=False),
        "Qwen2ForCausalLM",
    ),
    "qwen3-gqa2-qknorm": (
        transformers.Qwen3Config,
        dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
        "Qwen3ForCausalLM",
    ),
    "qwen3-bias-untied": (
        transformers.Qwen3Config,
        dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=4, attention_bias=True, tie_word_embeddings=False),
        "Qwen3ForCausalLM",
    ),
    "gpt2-tied": (transformers.GPT2Config, dict(GPT_LIKE, n_head=4), "GPT2LMHeadModel"),
    "gpt2-untied-inner96-layer-scaled": (
        transformers.GPT2Config,
        dict(GPT_LIKE, n_head=8, n_inner=96, activation_function="gelu", scale_attn_by_inverse_layer_idx=True,
             tie_word_embeddings=False),
        "GPT2LMHeadModel",
    ),
    "bigcode-mqa-tied": (
        transformers.GPTBigCodeConfig, dict(GPT_LIKE, n_head=4, multi_query=True), "GPTBigCodeForCausalLM",
    ),
    "bigcode-mha-untied": (
        transformers.GPTBigCodeConfig,
        dict(GPT_LIKE, n_head=2, multi_query=False, tie_word_embeddings=False, activation_function="gelu_pytorch_tanh"),
        "GPTBigCodeForCausalLM",
    ),
    "gptj-untied-rotary8": (
        transformers.GPTJConfig, dict(GPT_LIKE, n_head=4, rotary_dim=8, tie_word_embeddings=False), "GPTJForCausalLM",
    ),
    "gptj-tied-full-rotary": (
        transformers.GPTJConfig, dict(GPT_LIKE, n_head=2, rotary_dim=32, tie_word_embeddings=True), "GPTJForCausalLM",
    ),
    "pythia-parallel-rotary25": (
        transformers.GPTNeoXConfig,
        dict(NEOX_LIKE, num_attention_heads=4, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False),
        "GPTNeoXForCausalLM",
    ),
    "neox-sequential-tied-nobias": (
        transformers.GPTNeoXConfig,
        dict(NEOX_LIKE, num_attention_heads=2, rotary_pct=1.0, use_parallel_residual=False, attention_bias=False,
             tie_word_embeddings=True, hidden_act="gelu_new"),
        "GPTNeoXForCausalLM",
    ),
    "opt350m-like-postnorm-projected": (
        transformers.OPTConfig,
        dict(OPT_LIKE, num_attention_heads=4, word_embed_proj_dim=32, do_layer_norm_before=False),
        "OPTForCausalLM",
    ),
    "opt-untied-nobias-nonaffine": (
        transformers.OPTConfig,
        dict(OPT_LIKE, num_attention_heads=8, enable_bias=False, layer_norm_elementwise_affine=False,
             tie_word_embeddings=False),
        "OPTForCausalLM",
    ),
    "falcon7b-like-mqa-parallel": (
        transformers.FalconConfig,
        dict(FALCON_LIKE, num_attention_heads=4, new_decoder_architecture=False, multi_query=True, parallel_attn=True),
        "FalconForCausalLM",
    ),
    "falcon40b-like-gqa4-two-norms-untied": (
        transformers.FalconConfig,
        dict(FALCON_LIKE, num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True, tie_word_embeddings=False),
        "FalconForCausalLM",
    ),
    "falcon2-like-mqa-one-norm-bias": (
        transformers.FalconConfig,
        dict(FALCON_LIKE, num_attention_heads=4, num_kv_heads=1, new_decoder_architecture=True,
             num_ln_in_parallel_attn=1, bias=True),
        "FalconForCausalLM",
    ),
    "falcon-rw-like-alibi-sequential": (
        transformers.FalconConfig,
        dict(FALCON_LIKE, num_attention_heads=8, new_decoder_architecture=False, multi_query=False,
             parallel_attn=False, bias=True, alibi=True),
        "FalconForCausalLM",
    ),
    "bloom-tied": (transformers.BloomConfig, dict(BLOOM_LIKE, hidden_size=64, n_head=4), "BloomForCausalLM"),
    "bloom-6heads-residual-post-norm-untied": (
        transformers.BloomConfig,
        dict(BLOOM_LIKE, hidden_size=96, n_head=6, apply_residual_connection_post_layernorm=True,
             tie_word_embeddings=False),
        "BloomForCausalLM",
    ),
    "mpt-tied": (transformers.MptConfig, dict(MPT_LIKE, d_model=64, n_heads=4), "MptForCausalLM"),
    "mpt-6heads-clip-scale-untied": (
        transformers.MptConfig,
        dict(MPT_LIKE, d_model=96, n_heads=6, tie_word_embeddings=False,
             attn_config={"clip_qkv": 0.6, "softmax_scale": 0.2}),
        "MptForCausalLM",
    ),
}

PROMPT_LENGTHS = [1, 9, 33, 77]  # one ragged prefill: a lone token, partial blocks, a long prompt


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def run(request, tmp_path_factory):
    """(HF's and our prompt logits, HF's and our 64 greedy tokens) for one case."""
    config_cls, kwargs, arch = CASES[request.param]
    hf = random_hf_model(config_cls(**kwargs))
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.config.architecture == arch
    prompts = random_prompts(VOCAB, PROMPT_LENGTHS, seed=7)
    greedy, logits = StaticBatchRunner(loaded, block_size=8).generate(prompts, 64, return_prompt_logits=True)
    theirs = [(hf_logits(hf, p), hf_greedy(hf, p, 64)) for p in prompts]
    return list(zip(logits, greedy)), theirs


def test_logits_match_transformers(run):
    ours, theirs = run
    for (got, _), (want, _) in zip(ours, theirs):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_greedy_64_tokens_match_transformers(run):
    ours, theirs = run
    for (_, got), (_, want) in zip(ours, theirs):
        assert got == want


def _resave(folder, rename):
    """Rewrite model.safetensors with names changed by `rename` (None drops the tensor)."""
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = {rename(k): v for k, v in load_file(str(path)).items()}
    save_file({k: v for k, v in tensors.items() if k is not None}, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "name,config,rename",
    [
        # openai-community/gpt2 and bigscience/bloom-*: no "transformer." prefix
        ("gpt2", transformers.GPT2Config(**GPT_LIKE, n_head=4), lambda k: k.removeprefix("transformer.")),
        ("bloom", transformers.BloomConfig(**BLOOM_LIKE, hidden_size=64, n_head=4), lambda k: k.removeprefix("transformer.")),
        # Pythia on the hub says embed_out; a transformers-5 save may say lm_head
        ("neox", transformers.GPTNeoXConfig(**NEOX_LIKE, num_attention_heads=4, tie_word_embeddings=False),
         lambda k: k.replace("embed_out.", "lm_head.")),
        # some OPT checkpoints: "decoder.*" without "model."; GPT-style buffers are ignored
        ("opt", transformers.OPTConfig(**OPT_LIKE, num_attention_heads=4), lambda k: k.removeprefix("model.")),
    ],
)
def test_checkpoint_spellings_found_on_the_hub_load(name, config, rename, tmp_path):
    hf = random_hf_model(config)
    folder = save_hf_model(hf, tmp_path / name)
    _resave(folder, rename)
    prompt = random_prompts(VOCAB, [12])[0]
    got = StaticBatchRunner(load_model(str(folder), dtype="float32")).prompt_logits([prompt])[0]
    np.testing.assert_allclose(got, hf_logits(hf, prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["falcon40b-like-gqa4-two-norms-untied", "gpt2-tied", "mpt-tied", "opt350m-like-postnorm-projected"])
def test_bare_config_json_gets_random_weights_in_every_fused_layout(case, tmp_path):
    config_cls, kwargs, arch = CASES[case]
    config_cls(**kwargs).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path / "config.json"), dtype="float32")
    assert loaded.config.architecture == arch
    out = StaticBatchRunner(loaded).generate([[5, 6, 7]], 4)
    assert len(out[0]) == 4


def test_remote_code_families_are_refused_with_the_reason():
    from jaxpaged.models.registry import resolve_architecture

    for arch in ("BaichuanForCausalLM", "InternLMForCausalLM", "AquilaForCausalLM", "QWenLMHeadModel"):
        with pytest.raises(ValueError, match="trust_remote_code"):
            resolve_architecture([arch])

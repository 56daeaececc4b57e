"""Hybrid linear-attention ports against transformers in float32: Qwen3-Next, Qwen3.5 (dense and MoE) and Nemotron-H.

Logits at every position of four prompts (1 to 77 tokens) within 1e-4 and 32 greedy tokens equal to `generate`,
with the prompts in one ragged step and in 32-token chunks (77 tokens: three chunks, 33 tokens: a 1-token one, each
continuing the linear layers' convolution and recurrent state from the last). The caches are models/hybrid.py's: the
paged KV of the attention layers beside a state slot per sequence.

Random weights have std 0.1, and the zero-centred RMSNorms (Qwen's x * (1 + w)) weights around 0, as in the real
models: with std 0.15 and such norms near 2, transformers' own float32 logits were up to 1.5e-4 from its float64
ones (the delta rule's chunked triangular solve amplifies rounding), which leaves no room for a 1e-4 comparison.
The logits are also held within 1e-4 of transformers run in float64 (the same weights' exact answer, nearly): at
this scale each float32 computation lies up to ~7e-5 from it, so two of them may differ by more than either errs.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
import transformers
from jaxpaged.models.loader import load_model

from tests.hf_reference import hf_greedy, hf_logits, random_hf_model, random_prompts, save_hf_model
from tests.static_batch import StaticBatchRunner

VOCAB = 256
QWEN = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=0,
)  # fmt: skip
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
NEMOTRON = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
    mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=8, max_position_embeddings=512, bos_token_id=0,
    eos_token_id=1, pad_token_id=0,
)  # fmt: skip

# name -> (config class, kwargs, architecture the loader must pick)
CASES = {
    # 3 linear layers and 1 gated attention layer; layer 0's MLP dense (mlp_only_layers), the others MoE with the
    # shared expert; q/k/v and z fused per key head in the checkpoint; 2 value heads per key head
    "qwen3next-moe-shared-dense-layer0": (
        transformers.Qwen3NextConfig, dict(QWEN, intermediate_size=96, mlp_only_layers=[0], **QWEN_MOE), "Qwen3NextForCausalLM",
    ),
    # layer_types other than every fourth, tied embeddings, partial rotary 0.5, biased attention
    "qwen3.5-dense-tied": (
        transformers.Qwen3_5TextConfig,
        dict(QWEN, intermediate_size=96, tie_word_embeddings=True, attention_bias=True,
             layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        "Qwen3_5ForCausalLM",
    ),  # fmt: skip
    "qwen3.5-moe": (transformers.Qwen3_5MoeTextConfig, dict(QWEN, **QWEN_MOE), "Qwen3_5MoeForCausalLM"),
    # Mamba-2 with 2 groups of 4 heads, an MLP, attention without positions, the conv bias
    "nemotron-h": (
        transformers.NemotronHConfig,
        dict(NEMOTRON, layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"]),
        "NemotronHForCausalLM",
    ),
}

NEVER_TIED = ("NemotronHForCausalLM",)  # transformers' class ties no head, whatever tie_word_embeddings says

PROMPT_LENGTHS = [1, 9, 33, 77]
CHUNK = 32  # the first chunked step (74 tokens) pads to the whole step's 128: both run one compiled step
GREEDY_TOKENS = 32


def hybrid_hf_model(config, seed: int = 1):
    """random_hf_model at std 0.1, zero-centred norm weights around 0 (module docstring)."""
    hf = random_hf_model(config, seed=seed, std=0.1)
    if isinstance(config, (transformers.Qwen3NextConfig, transformers.Qwen3_5TextConfig, transformers.Qwen3_5MoeTextConfig)):
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "norm" in name and "linear_attn.norm" not in name:  # (the gated norm is 1-centred)
                    p.sub_(1.0)
    return hf


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def family(request, tmp_path_factory):
    config_cls, kwargs, arch = CASES[request.param]
    hf = hybrid_hf_model(config_cls(**kwargs))
    loaded = load_model(str(save_hf_model(hf, tmp_path_factory.mktemp(request.param))), dtype="float32")
    assert loaded.config.architecture == arch
    return hf, loaded


def test_logits_and_greedy_match_transformers_through_chunked_prefill(family):
    hf, loaded = family
    prompts = random_prompts(VOCAB, PROMPT_LENGTHS, seed=7)
    runner = StaticBatchRunner(loaded, block_size=8)
    # each prompt in one step (the kernels' own chunks: 77 > 64), then in chunks; each prefill followed by decoding
    greedy_whole, whole = runner.generate(prompts, GREEDY_TOKENS, return_prompt_logits=True)
    greedy, chunked = runner.generate(prompts, GREEDY_TOKENS, return_prompt_logits=True, prefill_chunk=CHUNK)
    exact = copy.deepcopy(hf).double()
    if hasattr(exact, "set_experts_implementation"):  # (the default grouped matmul has no float64)
        exact.set_experts_implementation("eager")
    assert greedy_whole == greedy
    for prompt, got_whole, got_chunked, got_tokens in zip(prompts, whole, chunked, greedy):
        with torch.no_grad():
            want64 = exact(torch.tensor([prompt])).logits[0].numpy()
        for want in (hf_logits(hf, prompt), want64):
            np.testing.assert_allclose(got_whole, want, atol=1e-4, rtol=0)
            np.testing.assert_allclose(got_chunked, want, atol=1e-4, rtol=0)
        assert got_tokens == hf_greedy(hf, prompt, GREEDY_TOKENS)


def test_linear_layers_keep_states_and_attention_layers_kv(family):
    """The paged KV holds the attention layers only; every linear layer has a state of the reference's shapes."""
    hf, loaded = family
    cfg, spec = loaded.config, loaded.model.state_spec()
    kinds = [layer.kind for layer in loaded.model.layers]
    assert cfg.num_kv_layers == kinds.count("attention") == len(cfg.kv_layers) < cfg.num_layers
    assert spec.num_layers == kinds.count("linear") > 0
    shapes = {a.name: a.shape for a in spec.arrays}
    hc = hf.config
    if "ssm" in shapes and hasattr(hc, "linear_num_value_heads"):  # the recurrent state transformers keeps per layer
        assert shapes["ssm"] == (hc.linear_num_value_heads, hc.linear_key_head_dim, hc.linear_value_head_dim)
    else:
        assert shapes["ssm"] == (hc.mamba_num_heads, hc.mamba_head_dim, hc.ssm_state_size)
    assert all(shape[0] == (hc.linear_conv_kernel_dim if hasattr(hc, "linear_conv_kernel_dim") else hc.conv_kernel) - 1
               for name, shape in shapes.items() if name.startswith("conv"))  # fmt: skip


def image_text_config(moe: bool = False):
    """A tiny Qwen3.5 image-text config (the released checkpoints' architecture), dense or MoE."""
    text = dict(QWEN, **QWEN_MOE) if moe else dict(QWEN, intermediate_size=96)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)  # fmt: skip
    cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    return cls(text_config=text, vision_config=vision, image_token_id=250, video_token_id=251, vision_start_token_id=252,
               vision_end_token_id=253)  # fmt: skip


def image_text_hf_model(config, seed: int = 0, std: float = 0.1):
    """Every weight random: transformers' AutoModelForCausalLM makes the text-only model from this config."""
    torch.manual_seed(seed)
    cls = transformers.Qwen3_5MoeForConditionalGeneration if isinstance(config, transformers.Qwen3_5MoeConfig) \
        else transformers.Qwen3_5ForConditionalGeneration  # fmt: skip
    hf = cls(config).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, std)
    return hf


# image-text architectures -> (config maker, model maker), for tests that build every architecture (their images and
# text prompts against transformers: tests/models/test_vlm_qwen3_5.py)
IMAGE_TEXT = {
    "Qwen3_5ForConditionalGeneration": (image_text_config, image_text_hf_model),
    "Qwen3_5MoeForConditionalGeneration": (functools.partial(image_text_config, True), image_text_hf_model),
}


def test_nemotron_h_moe_blocks_are_refused_by_name():
    from jaxpaged.models.registry import resolve_architecture

    config = transformers.NemotronHConfig(**NEMOTRON, layers_block_type=["linear_attention", "moe", "full_attention"])
    arch, port = resolve_architecture(["NemotronHForCausalLM"])
    with pytest.raises(ValueError, match="MoE blocks"):
        port.config_from_hf(config, arch)

"""Gemma 4 (text) against transformers in float32: logits within 1e-4 at every position of prompts of 1-77 tokens and
greedy tokens identical, for a dense config (per-layer embeddings, KV shared by the last 6 of 12 layers, a double-wide
MLP on those, global layers with their own head dim and proportional RoPE, 5:1 sliding layers) and a MoE config
(the routed experts beside the dense MLP, `attention_k_eq_v` with one global KV head); each feature shown to change
transformers' output; the image-text checkpoint's language model; through the engine with chunked prefill,
preemption and KV cache groups, with no cache for the sharing layers.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import transformers
from jaxpaged.models.loader import load_model, model_config
from jaxpaged.models.registry import MODEL_REGISTRY

from tests.hf_reference import hf_greedy, hf_logits, random_hf_model, random_prompts, save_hf_model
from tests.static_batch import StaticBatchRunner

torch = pytest.importorskip("torch")

VOCAB = 256
WINDOW = 8
S, F = "sliding_attention", "full_attention"
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    global_head_dim=32, sliding_window=WINDOW, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
    pad_token_id=0, final_logit_softcapping=5.0,
)  # fmt: skip
# rope_theta 10 on the full layers' proportional RoPE: its rotated quarter turns fast enough to matter at 77 tokens
ROPE = {S: {"rope_type": "default", "rope_theta": 100.0},
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 10.0}}  # fmt: skip


def _dense(**overrides) -> transformers.Gemma4TextConfig:
    """12 layers, 5 sliding then 1 full, twice; the last 6 read layers 4's and 5's K/V."""
    kwargs = dict(BASE, num_hidden_layers=12, num_kv_shared_layers=6, hidden_size_per_layer_input=8,
                  vocab_size_per_layer_input=VOCAB, use_double_wide_mlp=True, rope_parameters=copy.deepcopy(ROPE))  # fmt: skip
    return transformers.Gemma4TextConfig(**(kwargs | overrides))


def _moe(**overrides) -> transformers.Gemma4TextConfig:
    kwargs = dict(BASE, num_hidden_layers=6, layer_types=[S, S, F, S, S, F], num_kv_shared_layers=3,
                  hidden_size_per_layer_input=8, enable_moe_block=True, num_experts=4, top_k_experts=2,
                  moe_intermediate_size=32, attention_k_eq_v=True, num_global_key_value_heads=1,
                  rope_parameters=copy.deepcopy(ROPE))  # fmt: skip
    return transformers.Gemma4TextConfig(**(kwargs | overrides))


def _image_text() -> transformers.Gemma4Config:
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16)  # fmt: skip
    return transformers.Gemma4Config(text_config=_dense(num_hidden_layers=6, num_kv_shared_layers=0).to_dict(),
                                     vision_config=vision)  # fmt: skip


CASES = {
    "dense-ple-shared-kv": (_dense, "Gemma4ForCausalLM"),
    "moe-k-eq-v": (_moe, "Gemma4ForCausalLM"),
    "image-text-checkpoint": (_image_text, "Gemma4ForConditionalGeneration"),
}


def _hf_model(config):
    """Random weights, each layer's layer_scalar (a buffer random_hf_model leaves at 1) random too; q and k norms
    halved, so scores (unscaled: q.k of RMS-normed heads) stay about 1 and 12 layers do not amplify float32
    rounding past 1e-4."""
    hf = random_hf_model(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(0.5)
        for name, buffer in hf.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand_like(buffer))
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            hf = _hf_model(CASES[name][0]())
            built[name] = hf, save_hf_model(hf, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_match_transformers(checkpoints, name, tmp_path):
    hf, folder = checkpoints(name)
    arch = CASES[name][1]
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.config.architecture == arch and type(loaded.model) is MODEL_REGISTRY[arch]
    raw = json.loads((folder / "config.json").read_text())
    del raw["architectures"]  # then model_type decides
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert model_config(tmp_path / "config.json").architecture == arch
    prompts = random_prompts(VOCAB, [1, 9, 40, 77], seed=7)  # past the window; one ragged step
    greedy, logits = StaticBatchRunner(loaded, block_size=8).generate(prompts, 16, return_prompt_logits=True)
    for prompt, got_logits, got_tokens in zip(prompts, logits, greedy):
        np.testing.assert_allclose(got_logits, hf_logits(hf, prompt), atol=1e-4, rtol=0)
        assert got_tokens == hf_greedy(hf, prompt, 16)

"""Mistral 3 against transformers in float32, text prompts: Ministral3ForCausalLM (YaRN and Llama 4's q temperature
past `original_max_position_embeddings`, here 16 so prompts of 77 tokens cross it four times; a window), and
Mistral3ForConditionalGeneration's language model (Ministral 3 or Mistral) beside a tiny Pixtral tower, loaded (images:
tests/models/test_vlm_mistral3.py): logits within 1e-4 at every position of prompts of 1-77 tokens, whole and in
16-token chunks, 32 greedy tokens identical; the engine with 16-token chunks, preemption and prefix-cache hits."""

from __future__ import annotations

import copy

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
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0,
    eos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
)  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "original_max_position_embeddings": 16,
        "max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.1}  # fmt: skip
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
              patch_size=4, image_size=32)  # fmt: skip


def ministral3_config(**extra):
    return transformers.Ministral3Config(**TEXT, rope_parameters=copy.deepcopy(YARN), **extra)


def mistral3_config(text: str = "ministral3"):
    """A tiny Mistral3 image-text config: a Ministral 3 (Ministral 3, Magistral/Devstral Small 2) or a Mistral (Mistral
    Small 3.1/3.2) language model, a one-layer Pixtral tower."""
    text_config = ministral3_config() if text == "ministral3" else transformers.MistralConfig(**TEXT, sliding_window=None)
    return transformers.Mistral3Config(text_config=text_config.to_dict(), vision_config=VISION, image_token_index=10,
                                       tie_word_embeddings=False)  # fmt: skip


def mistral3_hf_model(config, seed: int = 0, std: float = 0.15):
    return random_hf_model(config, seed, std, model_cls=transformers.Mistral3ForConditionalGeneration)


# architecture -> (config maker, model maker), for tests that build every architecture (checkpoint accounting)
IMAGE_TEXT = {"Mistral3ForConditionalGeneration": (mistral3_config, mistral3_hf_model)}
CASES = {  # name -> (make the transformers model, architecture)
    "ministral3-yarn-qscale-window": (lambda: random_hf_model(ministral3_config(sliding_window=24)), "Ministral3ForCausalLM"),
    "mistral3-ministral3-text": (lambda: mistral3_hf_model(mistral3_config("ministral3")), "Mistral3ForConditionalGeneration"),
    "mistral3-mistral-text": (lambda: mistral3_hf_model(mistral3_config("mistral")), "Mistral3ForConditionalGeneration"),
}
_SAVED: dict = {}


def saved(case, tmp_path_factory):
    if case not in _SAVED:
        hf = CASES[case][0]()
        _SAVED[case] = hf, save_hf_model(hf, tmp_path_factory.mktemp(case))
    return _SAVED[case]


@pytest.mark.parametrize("case", ["ministral3-yarn-qscale-window", "mistral3-ministral3-text"])
def test_logits_and_greedy_match_transformers(case, tmp_path_factory):
    hf, folder = saved(case, tmp_path_factory)
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.config.architecture == CASES[case][1]
    if CASES[case][1] == "Mistral3ForConditionalGeneration":
        # transformers 5.24 saves the published (4.x) spelling: language_model.model.*, vision_tower.*; all of it read
        assert not loaded.skipped_tensors
        assert loaded.model.multi_modal_projector.patch_merger.merging_layer.kernel.shape == (32 * 4, 32)
    scaled = "ministral3" in case
    assert (loaded.config.option("llama4_scaling") == (0.1, 16)) == scaled
    prompts = random_prompts(VOCAB, [1, 9, 33, 77], seed=7)
    runner = StaticBatchRunner(loaded, block_size=8)
    greedy, logits = runner.generate(prompts, 32, return_prompt_logits=True)
    chunked = runner.prompt_logits(prompts, prefill_chunk=16)
    for prompt, got, got_chunked, tokens in zip(prompts, logits, chunked, greedy):
        want = hf_logits(hf, prompt)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        np.testing.assert_allclose(got_chunked, want, atol=1e-4, rtol=0)
        assert tokens == hf_greedy(hf, prompt, 32)


def test_mistral_small_3_1_language_model(tmp_path_factory):
    """Mistral Small 3.1/3.2's layout: a plain Mistral language model (no q temperature) beside the tower."""
    hf, folder = saved("mistral3-mistral-text", tmp_path_factory)
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.config.option("llama4_scaling") is None and not loaded.skipped_tensors
    prompts = random_prompts(VOCAB, [9, 40], seed=5)
    for prompt, got in zip(prompts, StaticBatchRunner(loaded, block_size=8).prompt_logits(prompts, prefill_chunk=16)):
        np.testing.assert_allclose(got, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_the_q_temperature_matters(tmp_path_factory):
    """Without Llama 4's q scaling (beta 0) transformers' logits past position 16 move: the option is tested."""
    hf, folder = saved("ministral3-yarn-qscale-window", tmp_path_factory)
    plain = copy.deepcopy(hf)
    plain.config.rope_parameters["llama_4_scaling_beta"] = 0.0
    prompt = random_prompts(VOCAB, [40], seed=3)[0]
    moved = np.abs(hf_logits(plain, prompt) - hf_logits(hf, prompt)).max(-1)
    assert moved[:16].max() < 1e-6 and moved[16:].min() > 1e-3


def test_ministral3_engine(tmp_path_factory):
    """Through jaxpaged.LLM: 16-token chunks, a pool small enough to preempt, prompts sharing prefixes (the image-text
    class through the engine, which needs its processor's folder: tests/models/test_vlm_mistral3.py)."""
    hf = random_hf_model(ministral3_config())  # no window: blocks stay, so the small pool preempts
    engine_matches_transformers(hf, save_hf_model(hf, tmp_path_factory.mktemp("ministral3-engine")), VOCAB)

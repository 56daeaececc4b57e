"""Llama 4 against transformers in float32, text prompts: 4 layers, RoPE layers with chunked local attention (chunks of
12 positions, shorter than the prompts and not aligned with the 16-token prefill chunks), q/k L2 norm and llama3
RoPE on interleaved pairs; a NoPE layer with its attention temperature (floor_scale 8, so it grows within the
prompts); MoE every second layer (4 experts, top-1 sigmoid router scaling the expert's input, a shared expert) beside
dense MLPs. Logits within 1e-4 at every position of prompts of 1-77 tokens, whole and in 16-token chunks, 16 greedy
tokens identical (on the platform's kernel; a 40-token prompt's logits also on the Triton kernel, interpreted);
Llama4ForConditionalGeneration's language model on text (its vision model read too); the engine with 16-token
chunks, preemption and prefix-cache hits on prompts past the attention chunk, the chunked layers' KV cache groups
holding about a chunk's blocks."""

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
    vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
    num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 1],
    attention_chunk_size=12, attn_temperature_tuning=True, floor_scale=8, attn_scale=0.1, use_qk_norm=True,
    rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
)  # fmt: skip
VISION = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=16, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64,
              pixel_shuffle_ratio=0.5)  # fmt: skip


def llama4_text_config(**extra):
    return transformers.Llama4TextConfig(**copy.deepcopy(TEXT | extra))


def llama4_config():
    return transformers.Llama4Config(text_config=copy.deepcopy(TEXT), vision_config=VISION, tie_word_embeddings=False)


def llama4_hf_model(config, seed: int = 0, std: float = 0.15):
    return random_hf_model(config, seed, std, model_cls=transformers.Llama4ForConditionalGeneration)


IMAGE_TEXT = {"Llama4ForConditionalGeneration": (llama4_config, llama4_hf_model)}
_SAVED: dict = {}


def saved(tmp_path_factory):
    if not _SAVED:
        hf = random_hf_model(llama4_text_config())
        _SAVED["text"] = hf, save_hf_model(hf, tmp_path_factory.mktemp("llama4"))
    return _SAVED["text"]


def test_logits_and_greedy_match_transformers(tmp_path_factory):
    hf, folder = saved(tmp_path_factory)
    loaded = load_model(str(folder), dtype="float32")
    cfg = loaded.config
    assert cfg.architecture == "Llama4ForCausalLM" and set(loaded.skipped_tensors) <= {"the rotary cache: recomputed from the config"}
    assert (cfg.option("chunked_layers"), cfg.option("nope_layers"), cfg.option("chunk_size")) == ((0, 1, 3), (2,), 12)
    prompts = random_prompts(VOCAB, [1, 9, 33, 77], seed=7)
    runner = StaticBatchRunner(loaded, block_size=8)
    greedy, logits = runner.generate(prompts, 16, return_prompt_logits=True)
    chunked = runner.prompt_logits(prompts, prefill_chunk=16)
    for prompt, got, got_chunked, tokens in zip(prompts, logits, chunked, greedy):
        want = hf_logits(hf, prompt)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        np.testing.assert_allclose(got_chunked, want, atol=1e-4, rtol=0)
        assert tokens == hf_greedy(hf, prompt, 16)


def test_chunked_layers_run_on_the_pallas_kernel(tmp_path_factory):
    """attention_backend="pallas" (the Triton kernel, interpreted here): every layer on it, the chunked ones with their
    chunk (no fallback to the reference), and a 40-token prompt's logits in 16-token chunks within 1e-4."""
    from jaxpaged.pallas_kernels import TritonAttention

    hf, folder = saved(tmp_path_factory)
    loaded = load_model(str(folder), dtype="float32", attention_backend="pallas")
    attns = [layer.self_attn for layer in loaded.model.layers]
    assert all(isinstance(a.backend, TritonAttention) for a in attns)
    assert [a.spec.chunk_size for a in attns] == [12, 12, None, 12]
    prompt = random_prompts(VOCAB, [40], seed=5)[0]
    got = StaticBatchRunner(loaded, block_size=8).prompt_logits([prompt], prefill_chunk=16)[0]
    np.testing.assert_allclose(got, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_chunks_and_temperature_matter(tmp_path_factory):
    """transformers' logits move past the first chunk when its layers attend causally, and past position 6 without
    the NoPE layer's temperature: both features decide the output above."""
    hf, _ = saved(tmp_path_factory)
    prompt = random_prompts(VOCAB, [40], seed=3)[0]
    want = hf_logits(hf, prompt)
    full = copy.deepcopy(hf)
    full.config.layer_types = ["full_attention"] * 4
    moved = np.abs(hf_logits(full, prompt) - want).max(-1)
    assert moved[:12].max() < 1e-5 and moved[12:].min() > 1e-3
    cold = copy.deepcopy(hf)
    for layer in cold.model.layers:
        layer.self_attn.attn_temperature_tuning = False
    moved = np.abs(hf_logits(cold, prompt) - want).max(-1)
    assert moved[:7].max() < 1e-5 and moved[7:].min() > 1e-4


def test_image_text_checkpoint_loads_its_language_model(tmp_path):
    hf = llama4_hf_model(llama4_config())
    loaded = load_model(str(save_hf_model(hf, tmp_path)), dtype="float32")
    assert loaded.config.architecture == "Llama4ForConditionalGeneration" and not loaded.skipped_tensors
    assert hasattr(loaded.model, "vision_model")  # read with it (tests/models/test_vlm_llama4.py: images)
    prompt = random_prompts(VOCAB, [30], seed=3)[0]
    got = StaticBatchRunner(loaded, block_size=8).prompt_logits([prompt], prefill_chunk=16)[0]
    with torch.no_grad():  # its forward's logits on text, from its language model (transformers 5.24's forward
        # itself fails building its output: MoeCausalLMOutputWithPast has no image_outputs)
        want = hf.language_model(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_llama4_engine(tmp_path_factory):
    """Through jaxpaged.LLM (the CPU platform's default attention, the chunked layers included): 16-token chunks, a
    pool small enough to preempt, prompts sharing prefixes, prompts and outputs past several chunks. The chunked
    layers are KV cache groups of their own that give back what their chunk left: on one 60-token sequence the
    global layer holds all 15 blocks of its history, each chunked layer about a chunk's (12 positions, 3 blocks)."""
    from jaxpaged import SamplingParams
    from jaxpaged.core.kv_cache_manager import Chunked
    from jaxpaged.platforms.cpu import attention as cpu_attention

    hf, folder = saved(tmp_path_factory)
    llm = engine_matches_transformers(hf, folder, VOCAB)
    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    groups = runner.kv_groups
    assert groups.windows == (Chunked(12),) * 3 + (None,) and groups.layers == ((0,), (1,), (3,), (2,))
    if cpu_attention.available():  # the platform's kernel runs the chunked layers too (no fallback to the reference)
        assert {layer.self_attn.backend.name for layer in llm.engine.loaded.model.layers} == {"native"}
    most = [0] * 4  # per group, the most blocks the sequence held after any schedule()
    original = scheduler.schedule

    def spy():
        out = original()
        for r in scheduler.running:
            most[:] = [max(m, len(g.held_blocks(r.seq_id))) for m, g in zip(most, scheduler.kv.groups)]
        return out

    scheduler.schedule = spy
    prompt = random_prompts(VOCAB, [20], seed=9)[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    try:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    finally:
        del scheduler.schedule
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 40)
    history = 60 // 4
    assert most[3] == history  # the global layer keeps everything
    assert max(most[:3]) <= 16 // 4  # the first (16-token) step's blocks; then at most a chunk's 3
    stats = llm.get_stats()
    assert stats["num_compiles_after_warmup"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]

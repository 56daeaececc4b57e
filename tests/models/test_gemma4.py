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


# -- each feature moves transformers' output ---------------------------------------------------------------------


def _without(hf, feature: str):
    """A copy of a transformers Gemma 4 with one feature turned off (or, for shared K/V, each layer its own)."""
    ref = copy.deepcopy(hf)
    layers = ref.model.layers
    with torch.no_grad():
        if feature == "per_layer_embeddings":
            for layer in layers:
                layer.per_layer_projection.weight.zero_()
        elif feature == "shared_kv":  # the same weights, but the last 3 layers compute their own K/V
            ref = _hf_model(_moe(num_kv_shared_layers=0))
            missing = ref.load_state_dict(hf.state_dict(), strict=False).missing_keys
            assert missing and all(".self_attn.k_" in k or ".self_attn.v_" in k for k in missing)
        elif feature == "layer_scalar":
            for layer in layers:
                layer.layer_scalar.fill_(1.0)
        elif feature == "v_norm":
            for layer in layers:
                if hasattr(layer.self_attn, "v_norm"):
                    layer.self_attn.v_norm = torch.nn.Identity()
        elif feature == "proportional_rope":  # every angle of the full layers rotates, as default RoPE does
            dim = hf.config.per_layer_config[5].head_dim
            full = 1.0 / (10.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            ref.model.rotary_emb.full_attention_inv_freq.copy_(full)
        elif feature == "final_logit_softcapping":
            ref.config.final_logit_softcapping = None
        elif feature == "per_expert_scale":
            for layer in layers:
                layer.router.per_expert_scale.fill_(1.0)
        elif feature == "experts":
            for layer in layers:
                layer.experts.down_proj.zero_()
    return ref


@pytest.mark.parametrize("feature", ["per_layer_embeddings", "shared_kv", "layer_scalar", "v_norm", "proportional_rope",
                                     "final_logit_softcapping", "per_expert_scale", "experts"])  # fmt: skip
def test_the_tested_features_change_the_output(checkpoints, feature):
    """So the parity above could fail: without each feature transformers' logits move."""
    hf, _ = checkpoints("moe-k-eq-v" if feature in ("per_expert_scale", "experts", "shared_kv") else "dense-ple-shared-kv")
    prompt = random_prompts(VOCAB, [77])[0]
    assert np.abs(hf_logits(_without(hf, feature), prompt) - hf_logits(hf, prompt)).max() > 1e-2


def test_config_reaches_the_port(checkpoints):
    """Dense: 12 layers, 6 with K/V (5 sliding, 1 full); the other 6 read layer 4's or 5's. MoE: the full layers' one
    KV head (k_eq_v) repeated into the cache's 2, their head dim 32 the cache's, the sliding layers' 16 padded."""
    dense = load_model(str(checkpoints("dense-ple-shared-kv")[1]), dtype="float32").config
    assert dense.kv_layers == tuple(range(6)) and dense.num_kv_layers == 6
    assert dense.sliding_windows == (WINDOW,) * 5 + (None,)
    assert [s.kv_index for s in dense.option("layers")] == [0, 1, 2, 3, 4, 5] + [4] * 5 + [5]
    assert (dense.head_dim, dense.num_kv_heads, dense.option("ple_size")) == (32, 2, 8)
    moe = load_model(str(checkpoints("moe-k-eq-v")[1]), dtype="float32").config
    shapes = moe.option("layers")
    assert [(s.head_dim, s.kv_heads, s.k_eq_v) for s in shapes[:3]] == [(16, 2, False), (16, 2, False), (32, 1, True)]
    assert (moe.head_dim, moe.num_kv_heads) == (32, 2) and dict(moe.option("moe"))["num_experts"] == 4


def test_pipeline_parallelism_is_refused(checkpoints):
    """(Tensor parallelism: tests/models/test_gemma4_tp.py.)"""
    import types

    from jaxpaged.worker.pipeline_runner import PipelineRunner

    loaded = load_model(str(checkpoints("moe-k-eq-v")[1]), dtype="float32")
    runner = types.SimpleNamespace(config=types.SimpleNamespace(pipeline_parallel_size=2), tp=1, model_config=loaded.config)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: Gemma4ForCausalLM is not cut into stages"):
        PipelineRunner._place(runner, loaded)


def test_checkpoint_spellings(checkpoints, tmp_path):
    """The image-text checkpoint (`model.language_model.*` beside its vision tower, models/vision/gemma4.py) loads
    with nothing skipped; a checkpoint whose sharing layers still hold K/V projections (transformers ignores them on
    load) loads with them skipped; a config in the hub's spelling (`global_head_dim`, `num_global_key_value_heads`,
    no `per_layer_config`) reads the same."""
    from safetensors.numpy import load_file, save_file

    _, folder = checkpoints("image-text-checkpoint")
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.skipped_tensors == {} and loaded.model.vision_spec is not None
    _, folder = checkpoints("moe-k-eq-v")
    tensors = load_file(str(folder / "model.safetensors"))
    rng = np.random.default_rng(0)
    extra = {f"model.layers.{i}.self_attn.{p}.weight": rng.standard_normal(shape).astype(np.float32)
             for i in (3, 4) for p, shape in (("k_proj", (32, 64)), ("v_proj", (32, 64)), ("k_norm", (16,)))}  # fmt: skip
    save_file(tensors | extra, str(tmp_path / "model.safetensors"))
    raw = json.loads((folder / "config.json").read_text())
    del raw["per_layer_config"]
    (tmp_path / "config.json").write_text(json.dumps(raw | {"global_head_dim": 32, "num_global_key_value_heads": 1}))
    loaded = load_model(str(tmp_path), dtype="float32")
    assert loaded.config == load_model(str(folder), dtype="float32").config
    (reason,) = [r for r in loaded.skipped_tensors if "num_kv_shared_layers" in r]
    assert sorted(loaded.skipped_tensors[reason]) == sorted(extra)


# -- through the engine ------------------------------------------------------------------------------------------


def test_engine_chunked_prefill_preemption_and_no_cache_for_shared_layers(checkpoints):
    """jaxpaged.LLM with 16-token chunks and a pool small enough to preempt: greedy tokens equal transformers', nothing
    compiles after warm-up, every block comes back. KV cache groups cover only the 6 layers that compute K/V (5
    sliding groups and 1 full, a layer each): the 6 sharing layers have no cache, so a token costs 6 layers' bytes."""
    from jaxpaged import LLM, SamplingParams

    hf, folder = checkpoints("dense-ple-shared-kv")
    rng = np.random.default_rng(3)
    prompts = random_prompts(VOCAB, [45, 5, 30, 23, 38, 12], seed=4)
    max_tokens = rng.integers(10, 30, size=len(prompts)).tolist()
    llm = LLM(str(folder), dtype="float32", max_num_seqs=6, max_num_batched_tokens=16, block_size=8, num_kv_blocks=48,
              log_level="WARNING")  # fmt: skip
    runner = llm.engine.runner
    groups = runner.kv_groups
    assert sorted(layer for layers in groups.layers for layer in layers) == list(range(6))
    assert groups.windows.count(None) == 1 and groups.windows.count(WINDOW) == 5
    assert runner.kv_cache.shape == (1, 2, runner.num_blocks, 2, 8, 32)  # a block id: one layer of one group
    assert runner.block_bytes == 1 * 2 * 2 * 8 * 32 * 4
    assert len(llm.engine.scheduler.kv.groups) == 6
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]

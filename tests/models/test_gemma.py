"""Gemma, Gemma 2, Gemma 3 and a Gemma 3 image-text checkpoint against transformers, in float32: logits within 1e-4
at every position, greedy tokens identical to `generate`, and Gemma 3 through the engine with chunked prefill and
preemption.

Each case is a tiny random model (std 0.15, norms too) whose features bite: windows of 8 under prompts of up to 70
tokens, an attention soft-cap of 5 and a final soft-cap of 3 under logits of that size (checked below by turning
each off in transformers), Gemma 3's local RoPE base far from its linearly scaled global one.
"""

from __future__ import annotations

import copy
import json
import logging
import types

import numpy as np
import pytest
import transformers
from jaxpaged import LLM, SamplingParams
from jaxpaged.models.gemma import GemmaForCausalLM
from jaxpaged.models.loader import load_model, model_config
from jaxpaged.models.registry import MODEL_REGISTRY

from tests.hf_reference import hf_greedy, hf_logits, random_hf_model, random_prompts, save_hf_model
from tests.static_batch import StaticBatchRunner

VOCAB = 256
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=0,
)  # fmt: skip
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 20000.0},
}
SLIDING_FULL_SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]


def _gemma3_text(**overrides) -> transformers.Gemma3TextConfig:
    kwargs = dict(
        BASE, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=20, final_logit_softcapping=3.0,
        layer_types=SLIDING_FULL_SLIDING, rope_parameters=copy.deepcopy(GEMMA3_ROPE),
    )  # fmt: skip
    return transformers.Gemma3TextConfig(**(kwargs | overrides))


def _gemma3_image_text() -> transformers.Gemma3Config:
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    return transformers.Gemma3Config(text_config=_gemma3_text(), vision_config=vision, mm_tokens_per_image=4)


# name -> (config maker, the architecture the loader must pick)
CASES = {
    "gemma-gqa2-legacy-gelu": (
        lambda: transformers.GemmaConfig(**BASE, num_hidden_layers=2, hidden_act="gelu"),  # read as tanh GELU
        "GemmaForCausalLM",
    ),
    "gemma2-window8-softcaps": (
        lambda: transformers.Gemma2Config(
            **BASE, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
        "Gemma2ForCausalLM",
    ),
    "gemma3-text-untied-local-rope": (
        lambda: _gemma3_text(tie_word_embeddings=False, attn_logit_softcapping=5.0),  # transformers ignores this cap
        "Gemma3ForCausalLM",
    ),
    "gemma3-image-text-checkpoint": (_gemma3_image_text, "Gemma3ForConditionalGeneration"),
}
PROMPT_LENGTHS = [1, 9, 33, 70]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, saved folder), each built once and only when a test asks for it."""
    built = {}

    def get(name):
        if name not in built:
            hf = random_hf_model(CASES[name][0]())
            built[name] = hf, save_hf_model(hf, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, checkpoints):
    hf, folder = checkpoints(request.param)
    return request.param, hf, folder, load_model(str(folder), dtype="float32")


def test_loader_picks_the_architecture_from_config_json(case, tmp_path):
    name, hf, folder, loaded = case
    arch = CASES[name][1]
    assert json.loads((folder / "config.json").read_text())["architectures"] == [arch]
    assert loaded.config.architecture == arch and type(loaded.model) is MODEL_REGISTRY[arch]
    raw = json.loads((folder / "config.json").read_text())
    del raw["architectures"]  # then model_type decides
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert model_config(tmp_path / "config.json").architecture == arch


def test_logits_match_transformers(case):
    _, hf, _, loaded = case
    prompts = random_prompts(VOCAB, PROMPT_LENGTHS)
    ours = StaticBatchRunner(loaded).prompt_logits(prompts)  # all prompts in one ragged step
    for prompt, got in zip(prompts, ours):
        want = hf_logits(hf, prompt)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(case):
    _, hf, _, loaded = case
    prompts = random_prompts(VOCAB, [3, 21, 50], seed=7)
    ours = StaticBatchRunner(loaded, block_size=8).generate(prompts, 32)
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(hf, prompt, 32)


def _without(hf, feature: str):
    """A copy of a transformers Gemma with one feature turned off."""
    ref = copy.deepcopy(hf)
    if feature == "final_logit_softcapping":
        ref.config.final_logit_softcapping = None
    elif feature == "attn_logit_softcapping":
        for module in ref.modules():
            if hasattr(module, "attn_logit_softcapping"):
                module.attn_logit_softcapping = None
    elif feature == "sliding_window":
        ref.config.sliding_window = 4096
    return ref


@pytest.mark.parametrize("feature", ["final_logit_softcapping", "attn_logit_softcapping", "sliding_window"])
def test_the_tested_features_change_the_output(checkpoints, feature):
    """So the parity above could fail: each of Gemma 2's caps and its windows moves transformers' logits."""
    hf, _ = checkpoints("gemma2-window8-softcaps")
    prompt = random_prompts(VOCAB, [70])[0]
    assert np.abs(hf_logits(_without(hf, feature), prompt) - hf_logits(hf, prompt)).max() > 1e-2


def test_gemma3_config_reaches_the_port(checkpoints):
    hf, folder = checkpoints("gemma3-image-text-checkpoint")
    cfg = load_model(str(folder), dtype="float32").config
    assert cfg.rope.rope_type == "linear" and cfg.rope.factor == 8.0 and cfg.rope.theta == 20000.0
    assert cfg.option("local_rope").theta == 500.0 and cfg.option("local_rope").rope_type == "default"
    assert cfg.option("local_rope_layers") == (0, 2) and cfg.sliding_windows == (8, None, 8)
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.option("attention_scale") == 20**-0.5
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    # transformers' image-text Gemma 3 never applies its text config's final cap (its text-only model does)
    assert hf.config.text_config.final_logit_softcapping == 3.0 and cfg.option("final_logit_softcapping") is None


def test_gemma3_rope_in_the_4x_spelling_reads_the_same():
    """transformers 4.x configs say rope_theta, rope_scaling and rope_local_base_freq; 5.x keys rope_parameters by
    layer type. Both give the same two RoPEs."""
    new = GemmaForCausalLM.config_from_hf(_gemma3_text(), "Gemma3ForCausalLM")
    old_text = types.SimpleNamespace(**{
        k: v for k, v in vars(_gemma3_text()).items() if k != "rope_parameters"
    })  # fmt: skip
    old_text.rope_theta, old_text.rope_local_base_freq = 20000.0, 500.0
    old_text.rope_scaling = {"rope_type": "linear", "factor": 8.0}
    old = GemmaForCausalLM.config_from_hf(old_text, "Gemma3ForCausalLM")
    assert (old.rope, old.option("local_rope")) == (new.rope, new.option("local_rope"))


def test_bidirectional_gemma_is_refused():
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        GemmaForCausalLM.config_from_hf(_gemma3_text(use_bidirectional_attention=True), "Gemma3ForCausalLM")


def test_image_text_checkpoint_in_either_spelling_loads_the_text_model_only(checkpoints, tmp_path, caplog):
    """transformers 5 writes `language_model.model.*`; other writers `model.language_model.*`, `model.vision_tower.*`.
    Vision tower and projector are skipped without a warning per tensor."""
    from safetensors.numpy import load_file, save_file

    hf, folder = checkpoints("gemma3-image-text-checkpoint")
    tensors = load_file(str(folder / "model.safetensors"))
    assert any(n.startswith("vision_tower.") for n in tensors)
    assert any(n.startswith("language_model.model.") for n in tensors)
    renamed = {}
    for name, array in tensors.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name.startswith(("vision_tower.", "multi_modal_projector.")):
            name = "model." + name
        renamed[name] = array
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    prompt = random_prompts(VOCAB, [40])[0]
    with caplog.at_level(logging.WARNING):
        loaded = [load_model(str(f), dtype="float32") for f in (folder, tmp_path)]
    logits = [StaticBatchRunner(model).prompt_logits([prompt])[0] for model in loaded]
    assert not [r for r in caplog.records if "ignoring tensor" in r.getMessage()]
    np.testing.assert_array_equal(logits[0], logits[1])
    np.testing.assert_allclose(logits[1], hf_logits(hf, prompt), atol=1e-4, rtol=0)


# -- through the engine ------------------------------------------------------------------------------------------


def _workload(hf, n: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = random_prompts(VOCAB, rng.integers(1, 40, size=n).tolist(), seed=seed + 1)
    max_tokens = rng.integers(8, 25, size=n).tolist()
    return prompts, max_tokens, [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]


def _run(llm: LLM, prompts, max_tokens) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_gemma3_engine_with_chunked_prefill_and_preemption_matches_transformers(checkpoints):
    hf, folder = checkpoints("gemma3-text-untied-local-rope")
    prompts, max_tokens, expected = _workload(hf, 12, seed=21)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, block_size=8, num_kv_blocks=12,
              log_level="WARNING")  # fmt: skip
    chunks = []
    original = llm.engine.scheduler.schedule

    def spy():
        out = original()
        chunks.extend(s.num_tokens for s in out.scheduled if not s.samples)
        return out

    llm.engine.scheduler.schedule = spy
    assert _run(llm, prompts, max_tokens) == expected
    stats = llm.get_stats()
    assert chunks, "no prompt was split into chunks"
    assert stats["num_preemptions"] > 0
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_gemma2_soft_cap_and_windows_through_the_pallas_kernel(checkpoints):
    """The GPU kernel (interpreted here) with Gemma 2's attention soft-cap and windows, in the engine."""
    hf, folder = checkpoints("gemma2-window8-softcaps")
    prompts, max_tokens, expected = _workload(hf, 4, seed=31)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
              attention_backend="pallas", log_level="WARNING")  # fmt: skip
    spec = llm.engine.loaded.model.layers[0].self_attn.spec
    assert spec.soft_cap == 5.0 and spec.sliding_window == 8
    assert _run(llm, prompts, max_tokens) == expected

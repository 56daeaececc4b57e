"""Pooling checkpoints (models/pooling_head.py) read into the CausalLM ports, against transformers in float32: a base
model's (`LlamaModel`, `Qwen3Model`, `Gemma2Model`, `Gemma3TextModel`) final hidden states equal AutoModel's last_hidden_state, a
`*ForSequenceClassification`'s classifier is its score.weight and pools to its logits; sentence-transformers'
modules.json read as vLLM reads it; everything else refused with the loader's errors."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import transformers
from flax import nnx
from jaxpaged.models import pooling_head
from jaxpaged.models.loader import load_model
from jaxpaged.models.pooling_head import PoolingInfo, sentence_transformers_config

from tests.hf_reference import random_hf_model, random_prompts, save_hf_model, tiny_llama_config, torch
from tests.static_batch import StaticBatchRunner

VOCAB = 256
QWEN3 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
GEMMA2 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)  # fmt: skip
GEMMA3 = dict(GEMMA2, layer_types=["sliding_attention", "full_attention", "sliding_attention"], attn_logit_softcapping=None,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 20000.0}})  # fmt: skip
# name -> (config, transformers class, the port's architecture)
CASES = {
    "LlamaModel": (lambda: tiny_llama_config(num_key_value_heads=2), transformers.LlamaModel, "LlamaForCausalLM"),
    "Qwen3Model": (lambda: transformers.Qwen3Config(**QWEN3), transformers.Qwen3Model, "Qwen3ForCausalLM"),
    "Gemma2Model": (lambda: transformers.Gemma2Config(**GEMMA2), transformers.Gemma2Model, "Gemma2ForCausalLM"),
    "Gemma3TextModel": (lambda: transformers.Gemma3TextConfig(**GEMMA3), transformers.Gemma3TextModel, "Gemma3ForCausalLM"),
    "Qwen3ForSequenceClassification-3": (
        lambda: transformers.Qwen3Config(**QWEN3, num_labels=3), transformers.Qwen3ForSequenceClassification, "Qwen3ForCausalLM"),
    "LlamaForSequenceClassification-1": (
        lambda: tiny_llama_config(num_labels=1), transformers.LlamaForSequenceClassification, "LlamaForCausalLM"),
}  # fmt: skip
PROMPT_LENGTHS = [1, 7, 40]


def _random(model):
    """Every parameter random, as tests/hf_reference.py random_hf_model draws them."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    return model.eval()


def _saved(name: str, folder: Path):
    make, cls, _ = CASES[name]
    hf = _random(cls(make()))
    hf.save_pretrained(folder)
    return hf


def _hidden_states(loaded, prompts) -> list[np.ndarray]:
    """The port's final hidden states (model.forward's, before compute_logits) at every prompt position, all
    prompts in one ragged step."""
    runner = StaticBatchRunner(loaded)
    width = -(-max(len(p) for p in prompts) // runner.block_size)
    ids, positions, attn_metadata, _, qsl = runner._prefill_inputs(prompts, width)

    @jax.jit
    def forward(state, kv, ids, positions, attn_metadata):
        return nnx.merge(runner.graphdef, state).forward(ids, positions, kv, attn_metadata)[0]

    hidden = np.asarray(forward(runner.state, runner._kv_cache(len(prompts), width), ids, positions, attn_metadata))
    return [hidden[qsl[i] : qsl[i + 1]] for i in range(len(prompts))]


def _hf_hidden(base, prompt) -> np.ndarray:
    with torch.no_grad():
        return base(torch.tensor([prompt])).last_hidden_state[0].float().numpy()


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = _saved(request.param, folder)
    return request.param, hf, folder, load_model(str(folder), dtype="float32")


def test_the_port_serves_the_checkpoint_and_the_head_is_tied(case):
    name, hf, folder, loaded = case
    assert loaded.config.architecture == CASES[name][2]
    assert loaded.hf_config.architectures == [type(hf).__name__]  # the original, for logs
    assert loaded.config.tie_word_embeddings and loaded.model.lm_head is None  # no lm_head stored, none needed


def test_final_hidden_states_match_transformers_last_hidden_state(case):
    _, hf, _, loaded = case
    base = getattr(hf, "model", hf)  # a classifier's decoder is its `model`
    prompts = random_prompts(VOCAB, PROMPT_LENGTHS)
    for prompt, got in zip(prompts, _hidden_states(loaded, prompts)):
        np.testing.assert_allclose(got, _hf_hidden(base, prompt), atol=1e-4, rtol=0)


def test_pooling_info(case):
    name, hf, _, loaded = case
    if "ForSequenceClassification" not in name:
        assert loaded.pooling == PoolingInfo("embed", None, None)
        return
    pooling = loaded.pooling
    assert (pooling.task, pooling.pooling_type, pooling.normalize) == ("classify", None, None)
    assert pooling.classifier.dtype == np.float32
    np.testing.assert_array_equal(pooling.classifier, hf.score.weight.detach().numpy())
    assert pooling.id2label == {i: f"LABEL_{i}" for i in range(hf.config.num_labels)}
    assert loaded.skipped_tensors[pooling_head.CLASSIFIER_SKIP] == ("score.weight",)


def test_classifier_on_the_last_hidden_state_gives_transformers_logits(case):
    name, hf, _, loaded = case
    if "ForSequenceClassification" not in name:
        pytest.skip("an embedding model")
    prompt = random_prompts(VOCAB, [9], seed=3)[0]
    (hidden,) = _hidden_states(loaded, [prompt])
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()  # one sequence: its last token's score
    np.testing.assert_allclose(hidden[-1] @ loaded.pooling.classifier.T, want, atol=1e-4, rtol=0)


# -- sentence-transformers' modules.json --------------------------------------------------------------------------


def _st_folder(folder: Path, pooling: dict | None, normalize: bool, dense: bool = False, as_dict: bool = False) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (folder / "1_Pooling").mkdir(parents=True, exist_ok=True)
        modes = dict.fromkeys(["cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens",
                               "lasttoken"], False)  # fmt: skip
        config = {"word_embedding_dimension": 64, **{f"pooling_mode_{k}": v for k, v in (modes | pooling).items()},
                  "include_prompt": True}  # fmt: skip
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    if dense:
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    if normalize:
        modules.append({"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps({"modules": modules} if as_dict else modules))
    return folder


@pytest.mark.parametrize(
    "pooling, normalize, want",
    [
        ({"lasttoken": True}, True, ("LAST", True)),  # Qwen3-Embedding, e5-mistral
        ({"mean_tokens": True}, False, ("MEAN", False)),
        ({"cls_token": True}, True, ("CLS", True)),
        (None, True, (None, True)),  # no Pooling module: the engine's default
        ({}, False, (None, False)),  # a Pooling module setting no mode
    ],
)
def test_sentence_transformers_pooling_and_normalize(tmp_path, pooling, normalize, want):
    assert sentence_transformers_config(_st_folder(tmp_path, pooling, normalize)) == (True, *want)


def test_modules_json_may_hold_its_list_under_modules(tmp_path):
    assert sentence_transformers_config(_st_folder(tmp_path, {"mean_tokens": True}, True, as_dict=True)) == (True, "MEAN", True)


def test_no_modules_json_says_nothing(tmp_path):
    assert sentence_transformers_config(tmp_path) == (False, None, None)


@pytest.mark.parametrize(
    "pooling, dense, match",
    [
        ({"max_tokens": True}, False, r"pools by pooling_mode_max_tokens, which jaxpaged does not"),
        ({"cls_token": True, "mean_tokens": True}, False, r"concatenates those poolings"),
        ({"lasttoken": True}, True, r"Dense module \(2_Dense\): a projection after pooling"),
    ],
)
def test_poolings_jaxpaged_does_not_run_are_refused(tmp_path, pooling, dense, match):
    with pytest.raises(ValueError, match=match):
        sentence_transformers_config(_st_folder(tmp_path, pooling, True, dense=dense))


def _as_causal_lm(folder: Path) -> Path:
    """A base model's checkpoint whose config says Qwen3ForCausalLM: Qwen3-Embedding's layout (no `model.` prefix,
    no lm_head, the architecture of the model it was trained from)."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen3ForCausalLM"]}))
    return folder


def test_qwen3_embedding_layout_loads_with_its_modules_json(tmp_path):
    hf = _saved("Qwen3Model", tmp_path)
    _st_folder(_as_causal_lm(tmp_path), {"lasttoken": True}, True)
    loaded = load_model(str(tmp_path), dtype="float32")
    assert loaded.config.architecture == "Qwen3ForCausalLM" and loaded.model.lm_head is None
    assert loaded.pooling == PoolingInfo(None, "LAST", True)
    prompt = random_prompts(VOCAB, [11], seed=5)[0]
    np.testing.assert_allclose(_hidden_states(loaded, [prompt])[0], _hf_hidden(hf, prompt), atol=1e-4, rtol=0)


def test_the_same_layout_without_modules_json_still_lacks_its_head(tmp_path):
    """The head is tied only for a pooling checkpoint: a CausalLM missing its lm_head is the loader's error."""
    _saved("Qwen3Model", tmp_path)
    _as_causal_lm(tmp_path)
    with pytest.raises(ValueError, match=r"tensor\(s\) the model needs are missing: lm_head.weight"):
        load_model(str(tmp_path), dtype="float32")


def test_a_causal_lm_without_modules_json_has_no_pooling(tmp_path):
    folder = save_hf_model(random_hf_model(tiny_llama_config()), tmp_path)
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.pooling is None and loaded.model.lm_head is not None


# -- refused -------------------------------------------------------------------------------------------------------


def _config_only(folder: Path, config) -> Path:
    config.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("architecture", ["GPT2ForSequenceClassification", "PhiForSequenceClassification", "BertModel"])
def test_a_pooling_architecture_without_a_port_is_the_unknown_architecture_error(tmp_path, architecture):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=[architecture])
    with pytest.raises(ValueError, match=rf"unsupported model architecture {architecture}; supported architectures: .*"
                                         r"LlamaForSequenceClassification.*Qwen3Model"):  # fmt: skip
        load_model(str(_config_only(tmp_path, config)), dtype="float32")


def test_a_classifier_without_score_weight_is_refused(tmp_path):
    folder = save_hf_model(random_hf_model(tiny_llama_config()), tmp_path)  # model.* and lm_head, no score
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(ValueError, match=r"a LlamaForSequenceClassification checkpoint needs score.weight"):
        load_model(str(folder), dtype="float32")


def test_a_token_classifier_without_its_bias_is_refused_unless_its_config_has_none(tmp_path):
    import transformers
    from safetensors.torch import load_file, save_file

    hf = transformers.LlamaForTokenClassification(tiny_llama_config(num_labels=2)).eval()
    folder = save_hf_model(hf, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    assert tensors.pop("score.bias").shape == (2,)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"LlamaForTokenClassification checkpoint needs score.bias"):
        load_model(str(folder), dtype="float32")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"token_classification_bias": False}))
    info = load_model(str(folder), dtype="float32").pooling
    assert info.task == "token_classify" and info.bias is None and info.classifier.shape == (2, 64)


def test_a_bidirectional_embedding_model_loads_where_its_port_runs_one(tmp_path):
    """is_causal=false in config.json (or hf_overrides): Qwen3's port (Llama's) runs it bidirectionally (the engine:
    tests/engine/test_bidirectional_pooling.py); Gemma 2's refuses it."""
    for name in ("Qwen3Model", "Gemma2Model"):
        folder = tmp_path / name
        _saved(name, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"is_causal": False}))
        if name == "Qwen3Model":
            assert load_model(str(folder), dtype="float32").config.option("bidirectional") is True
            assert load_model(str(folder), dtype="float32", hf_overrides={"is_causal": True}).config.option("bidirectional") is None
        else:
            with pytest.raises(ValueError, match=r"is_causal=false, a bidirectional embedding model, which the"):
                load_model(str(folder), dtype="float32")

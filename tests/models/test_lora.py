"""LoRA adapters written by PEFT itself, against transformers + PEFT in float32: logits within 1e-4 and greedy tokens
identical, per family and target set, with several adapters (and the base model) mixed in one ragged step."""

from __future__ import annotations

import copy
import json

import jax
import numpy as np
import pytest
from jaxpaged.models import lora
from jaxpaged.models.loader import load_model

from tests.hf_reference import hf_greedy, hf_logits, random_hf_model, random_prompts, save_hf_model
from tests.static_batch import StaticBatchRunner

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
import transformers  # noqa: E402

LLAMA_LIKE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256,
                  bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
# family -> (config class, kwargs); each family meets every target set: attention only, attention + MLP, rslora
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2)),
    "mistral": (transformers.MistralConfig, dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, sliding_window=16)),
    "qwen2": (transformers.Qwen2Config, dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=4)),
    "qwen3": (transformers.Qwen3Config, dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
}
# name -> (rank, alpha, target_modules, use_rslora)
ADAPTERS = {"attention-r4": (4, 8, ATTENTION, False), "all-r8": (8, 16, ALL, False), "rslora-r6-qv": (6, 12, ["q_proj", "v_proj"], True)}
MAX_RANK = 8
DECODE_TOKENS = 4
MIXED_STEP_FAMILIES = ("llama", "qwen3")  # prefill and decode steps; the others' (same code path) prefill logits only


def write_peft_adapter(base, folder, rank, alpha, targets, rslora, seed):
    """A PEFT LoRA on a copy of `base` with random A and B (PEFT zeroes B by default), saved by PEFT: -> the model."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    model.eval()
    return model


class LoRAStaticRunner(StaticBatchRunner):
    """The static-batch reference runner with the engine's LoRA path: stacked slots, one adapter slot per sequence."""

    def __init__(self, loaded, adapters: list, targets=lora.LORA_TARGETS):
        super().__init__(loaded)
        lora.attach(loaded.model, targets)
        from flax import nnx

        self.graphdef, self.state = nnx.split(loaded.model)
        self.shapes = lora.target_shapes(loaded.config, targets)
        self.max_loras = len(adapters)
        weights = lora.empty_weights(self.shapes, self.max_loras, MAX_RANK, self.dtype)
        write = jax.jit(lora.write_slot, donate_argnums=(0,))
        for slot, adapter in enumerate(adapters):
            weights = write(weights, np.int32(slot), lora.slot_arrays(adapter, self.shapes, MAX_RANK, self.dtype))
        self.weights = weights
        self.seq_slots = None  # per sequence of the next calls
        self._model_step = jax.jit(self._lora_step_impl)

    def _forward(self, state, kv_cache, ids, positions, attn_metadata, logit_rows, temperature, key):
        starts = np.asarray(attn_metadata.query_start_loc)
        slots = np.full(ids.shape[0], -1, np.int32)
        counts = np.diff(starts)[: len(self.seq_slots)]
        slots[: counts.sum()] = np.repeat(self.seq_slots, counts)
        logits, tokens, new_kv = self._model_step(state, kv_cache, ids, positions, attn_metadata, logit_rows, temperature,
                                                  key, self.weights, slots)  # fmt: skip
        return logits, tokens, self._write_kv(kv_cache, new_kv, attn_metadata.slot_mapping)

    def _lora_step_impl(self, state, kv_cache, ids, positions, attn_metadata, logit_rows, temperature, key, weights, slots):
        with lora.active(weights, slots, self.max_loras, MAX_RANK):
            return self._model_step_impl(state, kv_cache, ids, positions, attn_metadata, logit_rows, temperature, key)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    config_class, kwargs = FAMILIES[request.param]
    base = random_hf_model(config_class(**kwargs))
    root = tmp_path_factory.mktemp(request.param)
    folder = save_hf_model(base, root / "base")
    refs, paths = {}, {}
    for i, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        refs[name] = write_peft_adapter(base, paths[name], rank, alpha, targets, rslora, seed=10 + i)
    return base, folder, refs, paths, request.param


def test_mixed_adapters_in_one_step_match_peft(family):
    """Three adapters and the base model, in one ragged prefill and (Llama, Qwen3) the decode steps after it: each
    sequence's logits and greedy tokens are those of transformers + PEFT with its own adapter (or none). Mistral and
    Qwen2 differ from Llama only in the base model's own code, so their prefill logits suffice."""
    base, folder, refs, paths, family_name = family
    steps = DECODE_TOKENS if family_name in MIXED_STEP_FAMILIES else 1
    loaded = load_model(str(folder), dtype="float32")
    adapters = [lora.load_adapter(name, paths[name], loaded.config, lora.LORA_TARGETS, MAX_RANK) for name in ADAPTERS]
    runner = LoRAStaticRunner(loaded, adapters)
    names = [*ADAPTERS, None, "all-r8"]  # slot per prompt; None: the base model
    runner.seq_slots = np.array([-1 if n is None else list(ADAPTERS).index(n) for n in names], np.int32)
    prompts = random_prompts(256, [7, 19, 3, 12, 25], seed=3)
    outputs, logits = runner.generate(prompts, steps, return_prompt_logits=True)
    for name, prompt, got_logits, got_tokens in zip(names, prompts, logits, outputs):
        ref = base if name is None else refs[name]
        np.testing.assert_allclose(got_logits, hf_logits(ref, prompt), atol=1e-4, rtol=0, err_msg=str(name))
        assert got_tokens == hf_greedy(ref, prompt, steps), name


def test_adapter_changes_the_output(family):
    """Not vacuous: every adapter moves the logits well beyond the tolerance."""
    base, _, refs, _, _ = family
    prompt = random_prompts(256, [9], seed=4)[0]
    for ref in refs.values():
        assert np.abs(hf_logits(ref, prompt) - hf_logits(base, prompt)).max() > 1e-2


def test_scaling_is_folded_into_b(family):
    _, folder, _, paths, _ = family
    cfg = load_model(str(folder), dtype="float32").config
    for name, (rank, alpha, _, rslora) in ADAPTERS.items():
        adapter = lora.load_adapter(name, paths[name], cfg, lora.LORA_TARGETS, MAX_RANK)
        assert adapter.rank == rank
        assert adapter.scaling == pytest.approx(alpha / rank**0.5 if rslora else alpha / rank)


# -- bad adapters ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    base = random_hf_model(transformers.LlamaConfig(**FAMILIES["llama"][1]))
    root = tmp_path_factory.mktemp("bad")
    folder = save_hf_model(base, root / "base")
    good = root / "good"
    write_peft_adapter(base, good, 4, 8, ["q_proj", "v_proj"], False, seed=1)
    return base, load_model(str(folder), dtype="float32").config, root, good


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda d: (d / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
        (lambda d: (d / "adapter_config.json").unlink(), "no adapter_config.json"),
        (lambda d: (d / "adapter_model.safetensors").rename(d / "adapter_model.bin"), "pickle"),
        (lambda d: _edit_config(d, target_modules=["q_proj", "lm_head"]), "target_modules"),
        (lambda d: _edit_config(d, use_dora=True), "DoRA"),
        (lambda d: _edit_config(d, peft_type="PREFIX_TUNING"), "peft_type"),
        (lambda d: (d / "adapter_model.safetensors").write_bytes(b"not a safetensors file"), "cannot be read"),
    ],
    ids=["missing-weights", "missing-config", "pickle-bin", "unknown-target", "dora", "not-lora", "corrupt"],
)
def test_bad_adapter_is_refused_naming_the_problem(llama, tmp_path, break_it, message):
    _, cfg, _, good = llama
    folder = _copy(good, tmp_path / "adapter")
    break_it(folder)
    with pytest.raises(ValueError, match=message):
        lora.load_adapter("bad", str(folder), cfg, lora.LORA_TARGETS, MAX_RANK)


def _edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_rank_above_max_lora_rank_is_refused(llama):
    _, cfg, _, good = llama
    with pytest.raises(ValueError, match="max_lora_rank"):
        lora.load_adapter("big", str(good), cfg, lora.LORA_TARGETS, 2)


def test_adapter_for_another_base_is_refused(llama, tmp_path):
    base, cfg, _, _ = llama
    other = random_hf_model(transformers.LlamaConfig(**dict(FAMILIES["llama"][1], hidden_size=96)))
    write_peft_adapter(other, tmp_path / "other", 4, 8, ["q_proj"], False, seed=2)
    with pytest.raises(ValueError, match="do not fit the base model"):
        lora.load_adapter("other", str(tmp_path / "other"), cfg, lora.LORA_TARGETS, MAX_RANK)


def test_target_outside_the_engine_targets_is_refused(llama):
    _, cfg, _, good = llama
    with pytest.raises(ValueError, match="lora_target_modules"):
        lora.load_adapter("good", str(good), cfg, ("q_proj",), MAX_RANK)


def test_missing_folder_and_other_families_are_refused(llama, tmp_path):
    _, cfg, _, good = llama
    with pytest.raises(ValueError, match="not a folder"):
        lora.load_adapter("none", str(tmp_path / "nowhere"), cfg, lora.LORA_TARGETS, MAX_RANK)
    import dataclasses

    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        lora.load_adapter("gpt2", str(good), dataclasses.replace(cfg, architecture="GPT2LMHeadModel"), lora.LORA_TARGETS, MAX_RANK)

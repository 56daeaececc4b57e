"""Loading accounts for every checkpoint tensor (issue 49), in float32 against transformers.

- The LM head is tied by transformers 5's rule: per architecture, for both values of the flag where transformers reads
  it; a tiny Gemma 3 image-text checkpoint whose top-level config unties the head (its text_config keeps the default
  true) greedy-decodes as transformers does; a tied config's stored head is used as transformers uses it.
- Every family's tiny checkpoint loads with nothing unexplained (what a port skips listed once at INFO), and each
  loader path (safetensors folder, pre-quantized checkpoint, GGUF, PEFT LoRA adapter) refuses a checkpoint with one
  unknown tensor and one missing tensor with a ValueError naming both.
- docs/models.md says what is skipped for which architecture, as the ports' rules say.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import re

import numpy as np
import pytest
import torch
import transformers
from jaxpaged.models import checkpoint_quant, lora
from jaxpaged.models.deepseek import INDEXER
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.models.loader import _port_config, load_model
from jaxpaged.models.registry import MODEL_REGISTRY
from jaxpaged.models.tying import COPY
from safetensors.torch import load_file, save_file

import tests.models.test_deepseek as deepseek_cases
import tests.models.test_deepseek_v32 as deepseek_v32_cases
import tests.models.test_gemma as gemma_cases
import tests.models.test_gemma4 as gemma4_cases
import tests.models.test_gpt_oss as gpt_oss_cases
import tests.models.test_llama4 as llama4_cases
import tests.models.test_mistral3 as mistral3_cases
import tests.models.test_hybrid_models as hybrid_cases
import tests.models.test_model_families as family_cases
import tests.models.test_model_families_2026 as families_2026_cases
import tests.models.test_moe as moe_cases
import tests.models.test_phi as phi_cases
import tests.models.test_vlm_qwen2_5 as qwen_vl_cases
import tests.models.test_vlm_llava as llava_cases
import tests.models.test_vlm_qwen3 as qwen3_vl_cases
from tests import REPO
from tests.hf_reference import hf_greedy, hf_logits, random_hf_model, random_prompts, save_hf_model, tiny_llama_config
from tests.static_batch import StaticBatchRunner

VOCAB = 256
SIGLIP_HEAD = "SigLIP's attention-pooling head: Gemma 3 projects the last hidden states, never the pooled output"
LLAVA_UNREAD = "the tower's final LayerNorm and pooling head: LLaVA reads a layer's hidden states, never the pooled output"
UNKNOWN = "model.layers.0.mlp.extra_proj.weight"  # what the broken checkpoints add ...
MISSING = "model.layers.1.mlp.down_proj"  # ... and what they lack (its .weight, or a quantized Linear's parts)


# image-text architectures: (config maker, model maker), AutoModelForCausalLM making none or the text-only model
IMAGE_TEXT = {**hybrid_cases.IMAGE_TEXT, **qwen_vl_cases.CASES, **qwen3_vl_cases.CASES, **llava_cases.CASES,
              **mistral3_cases.IMAGE_TEXT, **llama4_cases.IMAGE_TEXT}


def _architectures() -> dict:
    """architecture -> a maker of one tiny config, from the family tests' cases."""
    found = {"LlamaForCausalLM": tiny_llama_config}
    for config_cls, kwargs, arch in [*family_cases.CASES.values(), *moe_cases.CASES.values(), *hybrid_cases.CASES.values(),
                                  *families_2026_cases.CASES.values()]:
        found.setdefault(arch, functools.partial(config_cls, **kwargs))
    for arch, (make_config, _) in IMAGE_TEXT.items():
        found.setdefault(arch, make_config)
    for config, arch in phi_cases.CASES.values():
        found.setdefault(arch, functools.partial(copy.deepcopy, config))
    for make, arch in [*gemma_cases.CASES.values(), *gemma4_cases.CASES.values()]:
        found.setdefault(arch, make)
    found.setdefault("GptOssForCausalLM", lambda: transformers.GptOssConfig(**copy.deepcopy(gpt_oss_cases.CONFIG)))
    for name, arch in (("v2", "DeepseekV2ForCausalLM"), ("v3", "DeepseekV3ForCausalLM")):
        found.setdefault(arch, functools.partial(lambda n: deepseek_cases._configs()[n], name))
    found.setdefault("DeepseekV32ForCausalLM", deepseek_v32_cases.v32_config)
    found.setdefault("Ministral3ForCausalLM", mistral3_cases.ministral3_config)
    found.setdefault("Llama4ForCausalLM", llama4_cases.llama4_text_config)
    return found


ARCHITECTURES = _architectures()


def loader_log(caplog):
    """jaxpaged.loader's INFO records (conftest's caplog sees them on the "jaxpaged" logger itself)."""
    return caplog.at_level(logging.INFO, logger="jaxpaged.loader")


def _skip_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("not loaded")]


def _resave(path, change) -> None:
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _break(tensors: dict) -> None:
    """One tensor no port reads added, and one the model needs (a Linear, quantized or not) taken away."""
    tensors[UNKNOWN] = torch.zeros(4, 4)
    for name in [n for n in tensors if n.startswith(f"{MISSING}.")]:
        del tensors[name]


def _names_both(error: pytest.ExceptionInfo, unknown: str, missing: str, escaped: bool = False) -> None:
    """The error names exactly one unknown and one missing tensor, these (`missing` a pattern when escaped)."""
    message = str(error.value)
    assert re.search(rf"1 tensor\(s\) that no parameter of the model reads[^;]*: {re.escape(unknown)};", message), message
    missing = missing if escaped else re.escape(missing)
    assert re.search(rf"1 tensor\(s\) the model needs are missing: {missing}$", message), message


# -- tying, as transformers ties ----------------------------------------------------------------------------------


def test_every_architecture_is_covered():
    assert sorted(ARCHITECTURES) == sorted(MODEL_REGISTRY)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_tying_follows_transformers_per_architecture(arch):
    """Both values of the flag, set where transformers reads it (the top-level config: for the image-text Gemma 3,
    not its text_config, which keeps its own default)."""
    for flag in (True, False):
        config = ARCHITECTURES[arch]()
        config.tie_word_embeddings = flag
        if arch in llama4_cases.IMAGE_TEXT:  # transformers reads its language model's own flag there
            config.text_config.tie_word_embeddings = flag
        with torch.device("meta"):  # (Qwen3.5's image-text classes: AutoModelForCausalLM makes the text-only one)
            hf = getattr(transformers, arch)(config) if arch in IMAGE_TEXT else transformers.AutoModelForCausalLM.from_config(config)
        theirs = hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
        assert theirs == (flag and arch not in hybrid_cases.NEVER_TIED)
        assert _port_config(config)[1].tie_word_embeddings == theirs, (arch, flag)


def test_gemma3_image_text_with_an_untied_head_decodes_as_transformers(tmp_path, caplog):
    """The issue's checkpoint: `tie_word_embeddings: false` at the top level of config.json, the text_config's default
    true, so a separate `language_model.lm_head.weight`. Tied, the head would decode otherwise (checked below)."""
    config = gemma_cases._gemma3_image_text()
    config.tie_word_embeddings = False
    hf = random_hf_model(config)
    folder = save_hf_model(hf, tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["tie_word_embeddings"] is False and raw["text_config"].get("tie_word_embeddings", True) is True
    stored = load_file(str(folder / "model.safetensors"))
    assert "language_model.lm_head.weight" in stored
    with loader_log(caplog):
        loaded = load_model(str(folder), dtype="float32")
    assert not loaded.config.tie_word_embeddings
    prompts = random_prompts(VOCAB, [1, 9, 30], seed=11)
    ours = StaticBatchRunner(loaded, block_size=8).generate(prompts, 12)
    assert ours == [hf_greedy(hf, p, 12) for p in prompts]
    tied = copy.deepcopy(hf)
    tied.lm_head.weight = torch.nn.Parameter(hf.get_input_embeddings().weight.detach().clone())
    assert ours != [hf_greedy(tied, p, 12) for p in prompts]
    # the vision tower and projector load (models/vision/gemma3.py); SigLIP's pooling head, which Gemma 3 never runs,
    # is skipped, each tensor in one INFO record that names the reason
    head = sorted(n for n in stored if n.startswith("vision_tower.head."))
    assert head and sorted(loaded.skipped_tensors.pop(SIGLIP_HEAD)) == head and loaded.skipped_tensors == {}
    (record,) = _skip_records(caplog)
    assert SIGLIP_HEAD in record and f"{len(head)} tensor(s)" in record and "vision_tower.head.mlp.fc1.weight" in record


@pytest.fixture(scope="module")
def tied_llama():
    return random_hf_model(tiny_llama_config(tie_word_embeddings=True))


def _random_like(array: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(0.0, 0.15, tuple(array.shape)).astype(np.float32))


# a tied config's checkpoint -> (the change, tied as transformers loads it, what is skipped)
STORED_HEADS = {
    "head-differs": (lambda t: t.update({"lm_head.weight": _random_like(t["model.embed_tokens.weight"], 1)}), False, {}),
    "head-is-a-copy": (lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}), True,
                       {COPY: ("lm_head.weight",)}),
    "head-without-embeddings": (lambda t: t.update({"lm_head.weight": _random_like(t.pop("model.embed_tokens.weight"), 2)}),
                                True, {}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(STORED_HEADS))
def test_a_tied_config_uses_a_stored_head_as_transformers_does(tied_llama, tmp_path, case):
    change, tied, skipped = STORED_HEADS[case]
    folder = save_hf_model(tied_llama, tmp_path)
    _resave(folder / "model.safetensors", change)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert (theirs.lm_head.weight is theirs.model.embed_tokens.weight) == tied
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.config.tie_word_embeddings == tied and loaded.skipped_tensors == skipped
    prompts = random_prompts(VOCAB, [3, 17])
    for prompt, got in zip(prompts, StaticBatchRunner(loaded).prompt_logits(prompts)):
        np.testing.assert_allclose(got, hf_logits(theirs, prompt), atol=1e-4, rtol=0)
    changed = np.abs(hf_logits(theirs, prompts[1]) - hf_logits(tied_llama, prompts[1])).max() > 1e-2
    assert changed == (case != "head-is-a-copy")  # so the parity above tells the readings apart


def test_an_untied_config_without_its_head_is_an_error(tmp_path):
    """transformers initializes the missing head at random (and says so); jaxpaged refuses, naming it."""
    folder = save_hf_model(random_hf_model(tiny_llama_config(tie_word_embeddings=False)), tmp_path)
    _resave(folder / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing: lm_head\.weight$"):
        load_model(str(folder), dtype="float32")


# -- every family's checkpoint, and the safetensors path's errors -------------------------------------------------


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_family_loads_with_nothing_unexplained(arch, tmp_path):
    """save_pretrained's checkpoint loads, skipping only what the port says (Gemma 3 image-text: its vision tower);
    with one unknown tensor more and one Linear less it is a ValueError naming both."""
    make_model = IMAGE_TEXT[arch][1] if arch in IMAGE_TEXT else random_hf_model  # (as above)
    hf = make_model(ARCHITECTURES[arch]())
    folder = save_hf_model(hf, tmp_path)
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.config.architecture == arch
    expected = {"Gemma3ForConditionalGeneration": {SIGLIP_HEAD}}
    expected |= dict.fromkeys(llava_cases.CASES, {LLAVA_UNREAD})  # the tower's final LayerNorm (SigLIP's head)
    expected["DeepseekV32ForCausalLM"] = {INDEXER}  # the sparse-attention indexer: dense MLA within index_topk
    assert set(loaded.skipped_tensors) == expected.get(arch, set())
    skipped = {n for names in loaded.skipped_tensors.values() for n in names}
    gone = next(n for n in sorted(load_file(str(folder / "model.safetensors"))) if ".1." in n and n not in skipped)
    _resave(folder / "model.safetensors", lambda t: (t.update({UNKNOWN: torch.zeros(4, 4)}), t.pop(gone)))
    with pytest.raises(ValueError) as error:
        load_model(str(folder), dtype="float32")
    missing = r"\S*\.1\." + re.escape(gone.split(".1.", 1)[1])  # as the port spells it (Gemma 3's without language_model.)
    _names_both(error, f"{UNKNOWN} (model.safetensors)", missing, escaped=True)


def test_hub_buffers_are_skipped_and_listed_once(tmp_path, caplog):
    """openai-community/gpt2's file holds each layer's causal-mask buffers, without the `transformer.` prefix."""
    hf = random_hf_model(transformers.GPT2Config(**family_cases.GPT_LIKE, n_head=4))
    folder = save_hf_model(hf, tmp_path)
    buffers = {f"h.{i}.attn.{b}": torch.ones(1, 1, 8, 8) for i in range(2) for b in ("bias", "masked_bias")}
    _resave(folder / "model.safetensors", lambda t: t.update({k.removeprefix("transformer."): t.pop(k) for k in list(t)} | buffers))
    with loader_log(caplog):
        loaded = load_model(str(folder), dtype="float32")
    why = "causal-mask buffers: the attention masks itself"
    assert sorted(loaded.skipped_tensors[why]) == sorted(buffers)
    (record,) = _skip_records(caplog)
    assert record == f"not loaded, {why}: 4 tensor(s) h.{{0-1}}.attn.bias, h.{{0-1}}.attn.masked_bias"
    prompt = random_prompts(VOCAB, [12])[0]
    np.testing.assert_allclose(StaticBatchRunner(loaded).prompt_logits([prompt])[0], hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_safetensors_folder_names_the_unknown_and_the_missing_tensor(tied_llama, tmp_path):
    folder = save_hf_model(tied_llama, tmp_path, max_shard_size="100KB")  # sharded: the names span the files
    shard = sorted(folder.glob("*.safetensors"))[0]
    _resave(shard, lambda t: t.update({UNKNOWN: torch.zeros(4, 4)}))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"][UNKNOWN] = shard.name
    owner = folder / index["weight_map"].pop(f"{MISSING}.weight")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _resave(owner, lambda t: t.pop(f"{MISSING}.weight"))
    with pytest.raises(ValueError) as error:
        load_model(str(folder), dtype="float32")
    _names_both(error, f"{UNKNOWN} ({shard.name})", f"{MISSING}.weight")


# -- pre-quantized checkpoints ------------------------------------------------------------------------------------


def test_quantized_checkpoint_skips_activation_scales_and_names_the_unknown_and_the_missing(tied_llama, tmp_path, caplog):
    from tests.models.test_quantized_checkpoints import FORMATS, write_quantized

    quantize, qcfg, _, extra = FORMATS["ct-int8-tensor-static"]  # each Linear also stores a static input_scale
    write_quantized(tied_llama, tmp_path / "ok", quantize, qcfg, extra)
    with loader_log(caplog):
        loaded = load_model(str(tmp_path / "ok"), dtype="float32")
    scales = loaded.skipped_tensors[checkpoint_quant.ACTIVATIONS]
    assert len(scales) == 14 and all(n.endswith(".input_scale") for n in scales)
    assert [r for r in _skip_records(caplog) if checkpoint_quant.ACTIVATIONS in r] != []
    quantize, qcfg, _, _ = FORMATS["gptq-4bit-v1"]
    write_quantized(tied_llama, tmp_path / "broken", quantize, qcfg)
    _resave(tmp_path / "broken" / "model.safetensors", _break)  # the GPTQ Linear's qweight, qzeros, scales, g_idx
    with pytest.raises(ValueError) as error:
        load_model(str(tmp_path / "broken"), dtype="float32")
    _names_both(error, f"{UNKNOWN} (model.safetensors)", f"{MISSING}.weight")


# -- GGUF ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_gguf_names_the_unknown_and_the_missing_tensor(tied_llama, tmp_path, quantization):
    pytest.importorskip("gguf")
    from tests.gguf_writer import write_llama_gguf

    path = write_llama_gguf(tied_llama, tmp_path / "m.gguf", drop=(f"{MISSING}.weight",),
                            extra={"blk.0.ffn_extra.weight": np.zeros((4, 4), np.float32)})  # fmt: skip
    with pytest.raises(ValueError, match=r"m\.gguf does not fit the llama architecture") as error:
        load_model(str(path), dtype="float32", quantization=quantization, use_cache=False)
    _names_both(error, "blk.0.ffn_extra.weight", f"{MISSING}.weight (blk.1.ffn_down.weight)")


# -- LoRA adapters ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_base():
    hf = random_hf_model(tiny_llama_config(num_attention_heads=4, num_key_value_heads=2))
    return hf, LlamaForCausalLM.config_from_hf(hf.config, "LlamaForCausalLM")


def _adapter(base, folder, **config):
    import peft

    torch.manual_seed(0)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **config))
    model.save_pretrained(folder)
    return folder


def test_lora_adapter_names_the_unknown_and_the_missing_tensor(llama_base, tmp_path):
    pytest.importorskip("peft")
    base, cfg = llama_base
    folder = _adapter(base, tmp_path, target_modules=["q_proj", "v_proj"])
    unknown = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"  # up_proj is not a target
    missing = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    _resave(folder / "adapter_model.safetensors", lambda t: (t.update({unknown: torch.zeros(4, 64)}), t.pop(missing)))
    with pytest.raises(ValueError) as error:
        lora.load_adapter("broken", str(folder), cfg, lora.LORA_TARGETS, 8)
    message = str(error.value)
    assert "holds 1 tensor(s) that are not the lora_A / lora_B" in message and message.count(unknown) == 1
    assert f"it lacks 1 tensor(s) its target_modules imply: {missing}" in message


@pytest.mark.parametrize(
    "config, adapted",
    [
        (dict(target_modules="all-linear"), {f"{i}.{p}" for i in range(2) for p in lora.LORA_TARGETS}),  # saved as paths
        (dict(target_modules=["q_proj", "v_proj"], layers_to_transform=[1]), {"1.q_proj", "1.v_proj"}),
        (dict(target_modules=r".*\.1\.self_attn\.(q|k)_proj"), {"1.q_proj", "1.k_proj"}),
        (dict(target_modules=["q_proj", "down_proj"], exclude_modules=["model.layers.0.mlp.down_proj"]),
         {"0.q_proj", "1.q_proj", "1.down_proj"}),
    ],
    ids=["all-linear", "layers-to-transform", "regex", "exclude-modules"],
)
def test_lora_adapters_peft_writes_load_what_they_target(llama_base, tmp_path, config, adapted):
    """The tensors PEFT expects from the config (its check_target_module_exists) are exactly those it saved."""
    pytest.importorskip("peft")
    base, cfg = llama_base
    adapter = lora.load_adapter("a", str(_adapter(base, tmp_path, **config)), cfg, lora.LORA_TARGETS, 8)
    got = {re.sub(r"^layers\.(\d+)\.\w+\.", r"\1.", key) for key in adapter.weights}
    assert got == adapted


# -- the docs -----------------------------------------------------------------------------------------------------


def test_models_md_says_what_each_architecture_skips():
    """Every row of docs/models.md's skip table names architectures and a reason; each port's SKIPPED_TENSORS reason
    is in a row naming its architecture, and an architecture without rules is in the row that skips nothing."""
    text = (REPO / "docs" / "models.md").read_text(encoding="utf-8")
    section = text.split("### What loading skips", 1)[1].split("\n#", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| `")]
    assert rows
    for arch, cls in MODEL_REGISTRY.items():
        naming = [row for row in rows if f"`{arch}`" in row[0]]
        for _, why in cls.SKIPPED_TENSORS:
            assert any(why in row[2] for row in naming), (arch, why)
        if not cls.SKIPPED_TENSORS:
            assert any(row[1] == "nothing" for row in naming), arch

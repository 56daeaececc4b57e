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


@pytest.fixture(scope="module")
def ours(case):
    """(prompts, our logits at every prompt position, our 32 greedy tokens): all prompts in one ragged prefill step
    (whose logits are these), then decoded together; one runner, so one compiled prefill and one decode step."""
    _, _, _, loaded = case
    prompts = random_prompts(VOCAB, PROMPT_LENGTHS)
    greedy, logits = StaticBatchRunner(loaded, block_size=8).generate(prompts, 32, return_prompt_logits=True)
    return prompts, logits, greedy


def test_logits_match_transformers(case, ours):
    _, hf, _, _ = case
    for prompt, got in zip(ours[0], ours[1]):
        want = hf_logits(hf, prompt)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(case, ours):
    _, hf, _, _ = case
    for prompt, got in zip(ours[0], ours[2]):
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


def test_gemma3_global_layers_with_yarn_match_transformers(tmp_path):
    """The global layers' RoPE through the shared rope_table, scalings with an attention factor included."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 20000.0, "original_max_position_embeddings": 32}
    hf = random_hf_model(_gemma3_text(rope_parameters={**copy.deepcopy(GEMMA3_ROPE), "full_attention": yarn}))
    loaded = load_model(str(save_hf_model(hf, tmp_path)), dtype="float32")
    assert loaded.config.rope.rope_type == "yarn" and loaded.config.option("local_rope").rope_type == "default"
    prompts = random_prompts(VOCAB, [9, 70])
    for prompt, got in zip(prompts, StaticBatchRunner(loaded).prompt_logits(prompts)):
        np.testing.assert_allclose(got, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_bidirectional_gemma_is_refused():
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        GemmaForCausalLM.config_from_hf(_gemma3_text(use_bidirectional_attention=True), "Gemma3ForCausalLM")


def test_image_text_checkpoint_loads_in_either_spelling(checkpoints, tmp_path, caplog):
    """transformers 5 writes `language_model.model.*`; other writers `model.language_model.*`, `model.vision_tower.*`.
    Both load the same model, vision tower and projector included (models/vision/gemma3.py); only SigLIP's pooling
    head, which Gemma 3 never runs, is skipped (each tensor, under one reason; models/accounting.py), without a
    warning."""
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
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    head = sorted(n.removeprefix("model.") for n in renamed if ".vision_tower.head." in n)  # (listed as the port names them)
    assert head and [sorted(n for names in model.skipped_tensors.values() for n in names) for model in loaded] == [head, head]
    np.testing.assert_array_equal(logits[0], logits[1])
    pixels = {"pixel_values": np.random.default_rng(0).standard_normal((1, 3, 28, 28)).astype(np.float32)}
    np.testing.assert_array_equal(*(np.asarray(model.model.encode(pixels)) for model in loaded))
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
    """KV cache groups (2 local layers, 1 global): a block serves one layer, so 18 blocks are 6 of every layer. 8-token
    steps (buckets 4 and 8): prompts of up to 40 tokens in chunks beside decode rows."""
    hf, folder = checkpoints("gemma3-text-untied-local-rope")
    prompts, max_tokens, expected = _workload(hf, 12, seed=21)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=8, max_num_batched_tokens=8, block_size=8, num_kv_blocks=18,
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
    """The GPU kernel (interpreted here) with Gemma 2's attention soft-cap and windows, in the engine (8-token steps:
    buckets 4 and 8, prompts of up to 40 tokens in chunks)."""
    hf, folder = checkpoints("gemma2-window8-softcaps")
    prompts, max_tokens, expected = _workload(hf, 4, seed=31)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, block_size=8,
              attention_backend="pallas", log_level="WARNING")  # fmt: skip
    spec = llm.engine.loaded.model.layers[0].self_attn.spec
    assert spec.soft_cap == 5.0 and spec.sliding_window == 8
    assert _run(llm, prompts, max_tokens) == expected


# -- GGUF files in llama.cpp's conventions -----------------------------------------------------------------------


def _spm_vocab() -> tuple[list[str], list[int]]:
    """A SentencePiece vocabulary as llama.cpp writes Gemma's: pad, eos, bos, unk, then pieces."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581"] + list(letters) + [f"\u2581{c}" for c in letters]
    tokens += [a + b for a in letters for b in letters][: VOCAB - len(tokens)]
    return tokens, [3, 3, 3, 2] + [1] * (VOCAB - 4)


def _write_gemma_gguf(hf, path, arch: str):
    """What llama.cpp's convert_hf_to_gguf.py writes for Gemma: no lm_head (tied), every norm weight + 1, q/k rows as
    stored (no permutation), the SentencePiece vocabulary, Gemma 2's caps and window, Gemma 3's RoPE and window."""
    import gguf

    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        full = cfg.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_sliding_window(cfg.sliding_window)
    tokens, types_ = _spm_vocab()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(types_)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_space_prefix(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight":
            continue
        array = tensor.detach().float().numpy().copy()
        if name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GGUF_CASES = {
    "gemma": lambda: transformers.GemmaConfig(**BASE, num_hidden_layers=2),
    "gemma2": lambda: transformers.Gemma2Config(
        **BASE, num_hidden_layers=2, sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    ),
    # llama.cpp's Gemma 3: five local layers (base 10000), then a global one; query_pre_attn_scalar = head_dim
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **BASE, num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=16, rope_local_base_freq=10000.0,
        rope_theta=1_000_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
}


@pytest.mark.parametrize("arch", list(GGUF_CASES))
def test_gguf_in_llama_cpp_conventions_matches_transformers(arch, tmp_path):
    pytest.importorskip("gguf")
    hf = random_hf_model(GGUF_CASES[arch]())
    path = _write_gemma_gguf(hf, tmp_path / f"{arch}.gguf", arch)
    loaded = load_model(str(path), dtype="float32", use_cache=False)
    assert loaded.config.architecture == CASES_BY_GGUF_ARCH[arch]
    prompts = random_prompts(VOCAB, [9, 40])
    ours = StaticBatchRunner(loaded).prompt_logits(prompts)
    for prompt, got in zip(prompts, ours):
        np.testing.assert_allclose(got, hf_logits(hf, prompt), atol=1e-4, rtol=0)
    # the tokenizer as transformers' own GGUF loading builds it (which needs torch; jaxpaged's reading does not)
    tokenizer, tokens = loaded.tokenizer, _spm_vocab()[0]
    reference = transformers.GemmaTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert tokenizer.convert_tokens_to_ids(tokens[40]) == 40 and tokenizer.bos_token == "<bos>"
    for text in ("ab cd", " hello  world", "zz<eos>q"):
        assert tokenizer.encode(text) == reference.encode(text)
    ids = tokenizer.encode("ab cd", add_special_tokens=False)
    assert tokenizer.decode(ids) == "ab cd"
    # converted once, then read back from the conversion cache as an HF folder: the same model and tokenizer
    for _ in range(2):
        cached = load_model(str(path), dtype="float32", cache_dir=str(tmp_path / "cache"))
    assert cached.config == loaded.config and any((tmp_path / "cache").rglob("config.json"))
    for got, want in zip(StaticBatchRunner(cached).prompt_logits(prompts), ours):
        np.testing.assert_array_equal(got, want)
    assert cached.tokenizer.encode("ab cd", add_special_tokens=False) == ids


CASES_BY_GGUF_ARCH = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

"""GGUF files of Phi-3, Qwen2, Qwen3, Qwen2-MoE and Qwen3-MoE as llama.cpp's convert_hf_to_gguf.py writes them
(tests/gguf_writer.py), loaded by jaxpaged and checked against the transformers model they were written from, in
float32: the config rebuilt from the metadata, logits within 1e-4, greedy tokens identical; a Q8_0 file kept quantized. (Gemma's files:
tests/models/test_gemma.py; Llama's: test_loading.py and test_weight_quantization.py.)

Phi-3's features bite here: LongRoPE with prompts on both sides of original_max_position_embeddings (24), partial
rotary 0.75, a window of 12 under 40-token prompts, fused qkv and gate/up rows; Qwen2-MoE's: 6 experts of 24
features (not the hidden size, so a transposed expert cannot pass), top-2 not renormalized, the shared expert and
its sigmoid gate stored as a vector, q/k/v biases; Qwen3-MoE's: top-2 renormalized (llama.cpp always does),
q/k norms, head_dim 32 (not hidden / heads), no shared expert; dense Qwen3 (q/k norms, head_dim 32, tied) and
Qwen2 (q/k/v biases, MQA, tied). RoPE scaling keys (rope.scaling.*): a Qwen2 with YaRN and its betas, a Llama with
YaRN, a Qwen3 with linear scaling, prompts and greedy tokens past YARN_ORIGINAL; where llama.cpp reads the keys
otherwise than transformers would, metadata-only files.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from jaxpaged.models.loader import load_model
from jaxpaged.models.quantization import GroupLinear

from tests.gguf_writer import sentencepiece_vocab, write_llama_gguf, write_phi3_gguf, write_qwen_gguf
from tests.hf_reference import hf_greedy, hf_logits, random_hf_model, random_prompts
from tests.static_batch import StaticBatchRunner

pytest.importorskip("gguf")

VOCAB = 256
ORIGINAL = 24  # Phi-3's original_max_position_embeddings: LongRoPE's short factors below, long ones from there
YARN_ORIGINAL = 32  # the YaRN cases' original_max_position_embeddings
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=0)


def _longrope(rotary_dim: int, **extra) -> dict:
    half = rotary_dim // 2
    return dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.1 * i for i in range(half)],
                long_factor=[1.0 + 1.5 * i for i in range(half)], **extra)  # fmt: skip


def _yarn(**betas) -> dict:  # past YARN_ORIGINAL every prompt below runs scaled
    return dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=YARN_ORIGINAL,
                **betas)


# name -> (transformers config, writer, its keyword arguments, prompts, greedy tokens); greedy stays on one side of
# ORIGINAL (transformers' Phi-3 recomputes the whole sequence when it crosses; tests/models/test_phi.py)
CASES = {
    "phi3-mini-longrope-sentencepiece": (
        transformers.Phi3Config(**BASE, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                                max_position_embeddings=128, original_max_position_embeddings=ORIGINAL,
                                rope_scaling=_longrope(16)),
        write_phi3_gguf, {"vocab": "llama"}, [9, 40], 12,
    ),
    "phi4-mini-partial-window-bytelevel": (
        transformers.Phi3Config(**BASE, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                tie_word_embeddings=True, max_position_embeddings=128,
                                original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75,
                                rope_scaling=_longrope(12, partial_rotary_factor=0.75), sliding_window=12),
        write_phi3_gguf, {"vocab": "gpt2"}, [9, 40], 12,
    ),
    "qwen2moe-shared-expert": (
        transformers.Qwen2MoeConfig(**BASE, intermediate_size=96, moe_intermediate_size=24,
                                    shared_expert_intermediate_size=64, num_experts=6, num_experts_per_tok=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    norm_topk_prob=False, tie_word_embeddings=False),
        write_qwen_gguf, {}, [1, 33], 24,
    ),
    "qwen3moe-head-dim-32": (
        transformers.Qwen3MoeConfig(**BASE, intermediate_size=96, moe_intermediate_size=24, num_experts=6,
                                    num_experts_per_tok=2, norm_topk_prob=True, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                                    tie_word_embeddings=False),
        write_qwen_gguf, {}, [1, 33], 24,
    ),
    "qwen3-head-dim-32-tied": (
        transformers.Qwen3Config(**BASE, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=32, max_position_embeddings=512, tie_word_embeddings=True),
        write_qwen_gguf, {}, [1, 33], 24,
    ),
    "qwen2-yarn-betas": (
        transformers.Qwen2Config(**BASE, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=128, tie_word_embeddings=True,
                                 rope_parameters=_yarn(beta_fast=4.0, beta_slow=0.5)),
        write_qwen_gguf, {}, [9, 40], 24,
    ),
    "qwen3-linear": (
        transformers.Qwen3Config(**BASE, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, max_position_embeddings=128, tie_word_embeddings=True,
                                 rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
        write_qwen_gguf, {}, [9, 40], 24,
    ),
    "llama-yarn": (
        transformers.LlamaConfig(**BASE, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=128, rope_parameters=_yarn()),
        write_llama_gguf, {}, [9, 40], 24,
    ),
    "qwen2-bias-tied": (
        transformers.Qwen2Config(**BASE, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1,
                                 max_position_embeddings=512, tie_word_embeddings=True),
        write_qwen_gguf, {}, [1, 33], 24,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """case -> (transformers model, GGUF path), each built once."""
    cache = {}

    def get(case: str):
        if case not in cache:
            config, write, kwargs, _, _ = CASES[case]
            hf = random_hf_model(config)
            cache[case] = hf, write(hf, tmp_path_factory.mktemp(case) / f"{case}.gguf", **kwargs)
        return cache[case]

    return get


# fields of the transformers config the file must give back (rope_parameters compared separately)
SAME_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "sliding_window", "head_dim",
               "original_max_position_embeddings", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size", "norm_topk_prob", "qkv_bias")  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_matches_transformers(case, written):
    hf, path = written(case)
    config, _, _, lengths, greedy_tokens = CASES[case]
    loaded = load_model(str(path), dtype="float32", use_cache=False)
    assert loaded.config.architecture == type(hf).__name__
    for field in SAME_FIELDS:
        if hasattr(config, field):
            want = getattr(config, field)
            assert getattr(loaded.hf_config, field) == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), field
    want, got = dict(config.rope_parameters), dict(loaded.hf_config.rope_parameters)
    for key in ("rope_type", "rope_theta", "partial_rotary_factor", "long_factor", "short_factor", "factor",
                "beta_fast", "beta_slow", "original_max_position_embeddings"):
        assert np.allclose(got.get(key, 1.0), want.get(key, 1.0)) if key != "rope_type" else got[key] == want[key], key

    prompts = random_prompts(VOCAB, lengths, seed=7)
    greedy, logits = StaticBatchRunner(loaded, block_size=8).generate(prompts, greedy_tokens, return_prompt_logits=True)
    for prompt, got_logits, got_tokens in zip(prompts, logits, greedy):
        np.testing.assert_allclose(got_logits, hf_logits(hf, prompt), atol=1e-4, rtol=0)
        assert got_tokens == hf_greedy(hf, prompt, greedy_tokens)


def test_phi3_sentencepiece_vocabulary_equals_transformers_own(written):
    """Phi-3's SentencePiece vocabulary (its prefix space from a normalizer) as transformers' own GGUF loading builds
    it (which needs torch; jaxpaged's reading does not)."""
    _, path = written("phi3-mini-longrope-sentencepiece")
    tokenizer = load_model(str(path), dtype="float32", use_cache=False).tokenizer
    reference = transformers.LlamaTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokens = sentencepiece_vocab(VOCAB)
    assert tokenizer.convert_tokens_to_ids(tokens[40]) == 40 and tokenizer.eos_token == "<|end|>"
    for text in ("ab cd", " hello  world", "zz<|end|>q"):
        assert tokenizer.encode(text) == reference.encode(text), text
    assert tokenizer.decode(tokenizer.encode("ab cd", add_special_tokens=False)) == "ab cd"


@pytest.mark.parametrize("case", ["phi3-mini-longrope-sentencepiece", "qwen2moe-shared-expert", "qwen3moe-head-dim-32"])
def test_q8_0_file_stays_quantized_but_fused_and_expert_tensors(case, written, tmp_path):
    """quantization="gguf": Q8_0 matrices stay 8-bit on the device, except Phi-3's fused qkv and gate/up rows (split
    at load) and stacked experts, which load as floats; the logits those give are the dequantized file's."""
    hf, _ = written(case)
    config, write, kwargs, lengths, _ = CASES[case]
    path = write(hf, tmp_path / "q8.gguf", quant="Q8_0", **kwargs)
    kept = load_model(str(path), quantization="gguf")
    floats = load_model(str(path), quantization="none", use_cache=False)
    layer = kept.model.layers[1]
    assert layer.self_attn.o_proj.method == GroupLinear(8, 32)
    if case.startswith("phi3"):
        assert layer.self_attn.q_proj.kernel[...].dtype == layer.mlp.up_proj.kernel[...].dtype == jnp.float32
        assert layer.mlp.down_proj.method == GroupLinear(8, 32)
    else:
        assert layer.self_attn.q_proj.method == GroupLinear(8, 32)
        if case.startswith("qwen2moe"):
            assert layer.mlp.shared_expert.up_proj.method == GroupLinear(8, 32)
        assert layer.mlp.experts.gate_proj.kernel[...].dtype == jnp.float32
    prompts = random_prompts(VOCAB, lengths, seed=3)
    for got, want in zip(StaticBatchRunner(kept).prompt_logits(prompts), StaticBatchRunner(floats).prompt_logits(prompts)):
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)


def _bare_gguf(path, arch: str, keys: dict):
    """Metadata (and one embedding tensor) only: the dimensions and `keys`, {key after "{arch}.": value}, typed as
    the converter writes them (str, uint32, float32)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    add = {str: writer.add_string, int: writer.add_uint32, float: writer.add_float32}
    for key, value in {"block_count": 2, "context_length": 128, "embedding_length": 64, "feed_forward_length": 96,
                       "attention.head_count": 4, **keys}.items():  # fmt: skip
        add[type(value)](f"{arch}.{key}", value)
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("arch,message", [("llama", "with experts \\(Mixtral\\)"), ("olmoe", "architecture 'olmoe'")])
def test_files_jaxpaged_does_not_read_are_refused_by_name(arch, message, tmp_path):
    from jaxpaged.models import gguf_io

    path = _bare_gguf(tmp_path / f"{arch}.gguf", arch, {"expert_count": 8})
    with pytest.raises(ValueError, match=message):
        gguf_io.gguf_hf_config(gguf_io.open_gguf(path), path)


# where llama.cpp's reading is not transformers': YaRN's cos/sin scale is its mscale of the factor times
# rope.scaling.attn_factor (the yarn_attn_factor key, HF's attention_factor, is overwritten there), its original
# context the file's context_length (128) where unstated; a bare factor, or the old rope.scale_linear, is linear
YARN = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}
MSCALE = 1 + 0.1 * np.log(4.0)
LLAMA_CPP_READINGS = {
    "yarn-attn-factor-key-unread": (
        {**YARN, "rope.scaling.original_context_length": 32, "rope.scaling.yarn_attn_factor": 0.5},
        ("yarn", 4.0, 32), MSCALE,
    ),
    "yarn-times-attn-factor": ({**YARN, "rope.scaling.attn_factor": 0.5}, ("yarn", 4.0, 128), 0.5 * MSCALE),
    "bare-factor": ({"rope.scaling.factor": 2.0}, ("linear", 2.0, 8192), 1.0),
    "old-scale-linear-key": ({"rope.scale_linear": 2.0}, ("linear", 2.0, 8192), 1.0),
    "none": ({**YARN, "rope.scaling.type": "none"}, ("default", 1.0, 8192), 1.0),
}  # fmt: skip


@pytest.mark.parametrize("case", list(LLAMA_CPP_READINGS))
def test_rope_scaling_keys_read_as_llama_cpp_does(case, tmp_path):
    from jaxpaged.models import gguf_io
    from jaxpaged.models.config import rope_from_hf
    from jaxpaged.models.layers import rope_attention_factor

    keys, (kind, factor, original), attention = LLAMA_CPP_READINGS[case]
    path = _bare_gguf(tmp_path / "qwen2.gguf", "qwen2", keys)
    rope = rope_from_hf(gguf_io.gguf_hf_config(gguf_io.open_gguf(path), path))
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == (kind, factor, original)
    assert rope_attention_factor(rope) == pytest.approx(attention, rel=1e-6)

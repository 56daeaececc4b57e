"""Write a transformers Llama as a GGUF the way llama.cpp's converter does (names, q/k row order)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from jaxpaged.models.gguf_io import _bytes_to_unicode


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_K layout (gguf-py reads it but cannot write it): per 256-value super-block an f16 d and
    dmin, eight 6-bit sub-block scales and mins packed in 12 bytes, and 4-bit codes; value = d*sc*q - dmin*m."""
    x = np.asarray(rows, np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(x.min(-1), 0.0), x.max(-1)
    step, offset = (hi - lo) / 15, -lo  # per sub-block: value ~ step * q - offset
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = (offset.max(-1) / 63).astype(np.float16)
    safe = lambda a: np.where(a == 0, 1, a).astype(np.float32)  # noqa: E731
    sc = np.clip(np.rint(step / safe(d)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(offset / safe(dmin)[:, None]), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.rint((x + (dmin.astype(np.float32)[:, None] * mn)[..., None]) / safe(scale)[..., None]), 0, 15).astype(np.uint8)
    packed = np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6), (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4),
    ], axis=1)  # fmt: skip
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), packed, qs], axis=1)
    return blocks.reshape(rows.shape[0], -1)


def _quantized(array: np.ndarray, kind: str | None):
    """(data, raw_dtype) for GGUFWriter.add_tensor: matrices in `kind`, everything else float32."""
    if kind is None or array.ndim != 2:
        return array, None
    qtype = gguf.GGMLQuantizationType[kind]
    data = quantize_q4_k(array) if kind == "Q4_K" else gguf.quants.quantize(array, qtype)
    return data, qtype


def write_llama_gguf(hf_model, path: Path, chat_template: str | None = None, quant: dict[str, str] | str | None = None,
                     drop: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None) -> Path:
    """quant: a GGML type name for every matrix ("Q4_0"), or {hf name substring: type}, the rest float32. drop: HF
    names left out; extra: tensors added under their GGUF names (a broken file, for the loader's errors)."""
    cfg = hf_model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    writer.add_vocab_size(cfg.vocab_size)
    _rope_scaling(writer, cfg)

    spelling = _bytes_to_unicode()
    tokens = [spelling[b] for b in range(cfg.vocab_size - 2)] + ["<|start|>", "<|end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges([])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    if chat_template:
        writer.add_chat_template(chat_template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for hf_name, tensor in hf_model.state_dict().items():
        if (hf_name == "lm_head.weight" and cfg.tie_word_embeddings) or hf_name in drop:
            continue
        array = tensor.detach().float().numpy().copy()
        if ".self_attn.q_proj." in hf_name:
            array = _llama_cpp_permute(array, heads)
        elif ".self_attn.k_proj." in hf_name:
            array = _llama_cpp_permute(array, kv_heads)
        kind = quant if not isinstance(quant, dict) else next((t for key, t in quant.items() if key in hf_name), None)
        data, raw_dtype = _quantized(array, kind)
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), data, raw_dtype=raw_dtype)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- other architectures, as convert_hf_to_gguf.py writes them (no q/k permutation: that is llama's alone) -----------


def _byte_level_vocab(writer, vocab_size: int, pre: str | None = None) -> None:
    """A byte-level BPE vocabulary ('gpt2'): the 256 bytes, then a BOS and an EOS control token."""
    spelling = _bytes_to_unicode()
    tokens = [spelling[b] for b in range(vocab_size - 2)] + ["<|start|>", "<|end|>"]
    writer.add_tokenizer_model("gpt2")
    if pre:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges([])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)


def sentencepiece_vocab(vocab_size: int) -> list[str]:
    """A SentencePiece ('llama') vocabulary shaped as Phi-3's: <unk>, <s>, </s>, pieces by falling score, and a
    control token at the end (Phi-3's <|end|>)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    tokens = ["<unk>", "<s>", "</s>", "\u2581"] + list(letters) + [f"\u2581{c}" for c in letters]
    tokens += [a + b for a in letters for b in letters][: vocab_size - len(tokens) - 1]
    return tokens + ["<|end|>"]


def _sentencepiece_vocab(writer, vocab_size: int) -> None:
    tokens = sentencepiece_vocab(vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0, 0.0, 0.0] + [-float(i) for i in range(len(tokens) - 4)] + [-1000.0])
    writer.add_token_types([2, 3, 3] + [1] * (len(tokens) - 4) + [3])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(False)


def _rope_scaling(writer, cfg) -> None:
    """The rope.scaling.* keys TextModel.set_gguf_parameters writes for a linear or YaRN config (HF's
    attention_factor as yarn_attn_factor, betas only where the config states them)."""
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    kind = rope.get("rope_type")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _write_tensors(writer, arch, tensors: dict[str, np.ndarray], layers: int, quant=None) -> None:
    """HF-named arrays under the names gguf-py's map gives them for `arch`."""
    names = gguf.get_tensor_name_map(arch, layers)
    for hf_name, array in tensors.items():
        kind = quant if not isinstance(quant, dict) else next((t for key, t in quant.items() if key in hf_name), None)
        if hf_name.endswith(".mlp.gate.weight"):  # llama.cpp keeps routers (ffn_gate_inp) in float32
            kind = None
        data, raw_dtype = _quantized(array, kind)
        name = hf_name if hf_name.startswith("rope_factors") else names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KeyError(f"no GGUF name for {hf_name}")
        writer.add_tensor(name, data, raw_dtype=raw_dtype)


def _finish(writer, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _state(hf_model) -> dict[str, np.ndarray]:
    tied = hf_model.config.tie_word_embeddings
    return {k: v.detach().float().numpy().copy() for k, v in hf_model.state_dict().items() if not (tied and k == "lm_head.weight")}


def write_phi3_gguf(hf_model, path: Path, vocab: str = "llama", quant=None) -> Path:
    """Phi3MiniModel's file: fused attn_qkv and ffn_up (gate rows, then up) as HF stores them, the rotary width as
    rope.dimension_count, LongRoPE factors as rope_factors_long/short tensors with their attention factor, a window
    of 0 for none. vocab: "llama" (SentencePiece, Phi-3/3.5) or "gpt2" (byte-level, Phi-4-mini)."""
    import math

    cfg = hf_model.config
    rope = dict(cfg.rope_parameters)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rotary = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(rotary)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(cfg.sliding_window or 0)
    tensors = _state(hf_model)
    if rope.get("long_factor"):
        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        original = cfg.original_max_position_embeddings  # LongRoPE's attention factor, as the converter computes it
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        assert len(rope["long_factor"]) == rotary // 2 and head_dim >= rotary
        tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    (_sentencepiece_vocab if vocab == "llama" else _byte_level_vocab)(writer, cfg.vocab_size)
    _write_tensors(writer, gguf.MODEL_ARCH.PHI3, tensors, cfg.num_hidden_layers, quant)
    return _finish(writer, path)


QWEN_ARCHITECTURES = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
                      "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE}  # fmt: skip


def write_qwen_gguf(hf_model, path: Path, quant=None) -> Path:
    """Qwen2Model's file and its subclasses' (qwen2, qwen3, qwen2moe, qwen3moe, by the config's model_type): HF's
    tensors unpermuted, q/k norms as attn_{q,k}_norm, an explicit head_dim as key/value_length; MoE layers' experts
    stacked into ffn_{gate,up,down}_exps ([E, out, in] in numpy's order), the router as ffn_gate_inp, Qwen2-MoE's
    shared expert as ffn_*_shexp with its sigmoid gate as the [hidden] vector ffn_gate_inp_shexp; the expert sizes
    and counts in {arch}.expert_* keys."""
    cfg = hf_model.config
    arch = QWEN_ARCHITECTURES[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    _rope_scaling(writer, cfg)
    if getattr(cfg, "head_dim", None):  # the converter writes a config's head_dim when it has one
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if getattr(cfg, "num_experts", None):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    _byte_level_vocab(writer, cfg.vocab_size, pre="qwen2")
    tensors = {}
    for name, array in _state(hf_model).items():
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers' fused [E, 2F, H]: gate rows, then up
            gate, up = np.split(array, 2, axis=1)
            tensors[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            tensors[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith("mlp.experts.down_proj"):
            tensors[name + ".weight"] = array
        elif name.endswith("mlp.shared_expert_gate.weight"):
            tensors[name] = array.reshape(-1)
        else:
            tensors[name] = array
    _write_tensors(writer, arch, tensors, cfg.num_hidden_layers, quant)
    return _finish(writer, path)

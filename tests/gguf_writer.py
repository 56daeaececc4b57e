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


def write_llama_gguf(hf_model, path: Path, chat_template: str | None = None, quant: dict[str, str] | str | None = None) -> Path:
    """quant: a GGML type name for every matrix ("Q4_0"), or {hf name substring: type}, the rest float32."""
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
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy().copy()
        if ".self_attn.q_proj." in hf_name:
            array = _llama_cpp_permute(array, heads)
        elif ".self_attn.k_proj." in hf_name:
            array = _llama_cpp_permute(array, kv_heads)
        kind = quant if not isinstance(quant, dict) else next((t for key, t in quant.items() if key in hf_name), None)
        data, raw_dtype = _quantized(array, kind)
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

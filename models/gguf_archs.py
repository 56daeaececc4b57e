"""llama.cpp's GGUF conventions per architecture, as its convert_hf_to_gguf.py writes them: which HF config field each
metadata key fills, what the converter did to a tensor that loading undoes, and the HF model each loads as.

models/gguf_io.py reads a file through these tables; an architecture is supported when it has an entry in
ARCHITECTURES. Tensor names themselves come from the `gguf` package's own map (gguf.get_tensor_name_map), which is
llama.cpp's; a TensorRule only covers a tensor the converter reshaped, reordered, offset or fused differently.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

REQUIRED, SKIP = object(), object()  # a key's default: the file must state it / leave the HF config's own default


# (metadata key after "{arch}.", HF config field, cast, default) every architecture reads
COMMON_KEYS = (
    ("context_length", "max_position_embeddings", int, 2048),
    ("embedding_length", "hidden_size", int, REQUIRED),
    ("feed_forward_length", "intermediate_size", int, REQUIRED),
    ("block_count", "num_hidden_layers", int, REQUIRED),
    ("attention.head_count", "num_attention_heads", int, REQUIRED),
    ("attention.layer_norm_rms_epsilon", "rms_norm_eps", float, 1e-6),
    ("rope.freq_base", "rope_theta", float, 10000.0),
)


class Metadata:
    """One file's metadata and tensor list, read by architecture-relative keys."""

    def __init__(self, reader, arch: str, path: str):
        self.reader, self.arch, self.path = reader, arch, path
        self.tensors = {t.name: t for t in reader.tensors}

    def field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def get(self, key: str, default=None):
        """`{arch}.{key}`, e.g. get("attention.head_count")."""
        return self.field(f"{self.arch}.{key}", default)

    def has(self, tensor: str) -> bool:
        return tensor in self.tensors

    def vector(self, tensor: str) -> list[float]:
        """A small float tensor's values (Phi-3's RoPE factors)."""
        from gguf.quants import dequantize

        t = self.tensors[tensor]
        return [float(v) for v in dequantize(t.data, t.tensor_type).reshape(-1)]

    def read_keys(self, table) -> dict[str, Any]:
        kwargs = {}
        for key, field, cast, default in table:
            value = self.get(key)
            if value is None and default is REQUIRED:
                raise ValueError(f"GGUF file {self.path} lacks the metadata key {self.arch}.{key} ({field})")
            if value is not None:
                kwargs[field] = cast(value)
            elif default is not SKIP:
                kwargs[field] = default
        return kwargs


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """HF names matching `pattern` (the port's weight_specs names): read from the GGUF tensor the name after
    re.sub(pattern, rename) maps to, and passed through undo(array, hf_config) (also given a GroupQuantized when the
    tensor stays quantized). keep_quantized False: dequantized even under quantization="gguf" (fused rows that the
    port splits at load, which a quantized tensor cannot be)."""

    pattern: str
    undo: Callable[[Any, Any], Any] | None = None
    rename: str | None = None
    keep_quantized: bool = True

    def matches(self, hf_name: str) -> bool:
        return re.search(self.pattern, hf_name) is not None

    def gguf_side_name(self, hf_name: str) -> str:
        return hf_name if self.rename is None else re.sub(self.pattern, self.rename, hf_name)


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
    model_type: str  # the HF config's
    hf_architecture: str
    keys: tuple = ()  # rows as COMMON_KEYS's, read after them (a repeated field overrides)
    derive: Callable[[Metadata, dict], dict] | None = None  # the fields no single key states
    tensors: tuple[TensorRule, ...] = ()
    sentencepiece_tokenizer: str | None = None  # transformers class a 'llama' (SentencePiece) vocabulary becomes
    config_tensors: tuple[str, ...] = ()  # tensors `derive` reads into the config (no parameter reads them)

    def rule(self, hf_name: str) -> TensorRule | None:
        return next((r for r in self.tensors if r.matches(hf_name)), None)


# -- what the converter did to tensors ------------------------------------------------------------------------------


def unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows (interleaved rotary pairs back to HF's halves)."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermuted(heads_field: str):
    """Llama's q or k rows back in HF's order; on a GroupQuantized a row's codes and group scales move together."""

    def undo(x, hf_config):
        heads = getattr(hf_config, heads_field)
        if isinstance(x, np.ndarray):
            return unpermute_rope(x, heads)
        rows = lambda a: None if a is None else unpermute_rope(a, heads)  # noqa: E731
        return dataclasses.replace(x, codes=rows(x.codes), scale=rows(x.scale), zero=rows(x.zero))

    return undo


def _minus_one(x, _):  # Gemma's RMSNorm weights are stored as 1 + w: llama.cpp's norm multiplies by them alone
    return x - np.float32(1.0)


def _experts_in_out(x, _):  # stacked experts [E, out, in] (torch's order) -> models/moe.py's [E, in, out]
    return np.ascontiguousarray(np.swapaxes(x, 1, 2))


def _one_row(x, _):  # Qwen2-MoE's shared-expert gate is stored as a [hidden] vector; HF's is a [1, hidden] Linear
    return x.reshape(1, -1)


LLAMA_QK = (
    TensorRule(r"\.self_attn\.q_proj\.(weight|bias)$", _unpermuted("num_attention_heads")),
    TensorRule(r"\.self_attn\.k_proj\.(weight|bias)$", _unpermuted("num_key_value_heads")),
)
GEMMA_NORMS = (TensorRule(r"norm\.weight$", _minus_one),)
PHI3_FUSED = (
    TensorRule(r"\.self_attn\.qkv_proj\.weight$", keep_quantized=False),  # q, k, v rows: attn_qkv as HF's qkv_proj
    TensorRule(r"\.mlp\.gate_up_proj\.weight$", keep_quantized=False),  # gate rows, then up: ffn_up
)
QWEN2MOE_EXPERTS = (
    TensorRule(r"\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.kernel$", _experts_in_out, r".mlp.experts.\1.weight"),
    TensorRule(r"\.mlp\.shared_expert_gate\.weight$", _one_row),
)


# -- the config fields no single key states -------------------------------------------------------------------------


def rope_scaling(meta: Metadata, context_length: int) -> dict | None:
    """The HF rope_scaling llama.cpp runs a file's `rope.scaling.*` keys as (its loader's defaults included); None for
    none. Phi-3's LongRoPE factors are tensors: _phi3 reads them."""
    kind = meta.get("rope.scaling.type", "linear")  # llama.cpp's default type: a bare factor scales linearly
    factor = float(meta.get("rope.scaling.factor", meta.get("rope.scale_linear", 0.0)) or 1.0)  # (the key's old name)
    if kind == "longrope":
        return {"rope_type": "longrope"}
    if kind not in ("none", "linear", "yarn"):
        raise ValueError(f"GGUF file {meta.path} has the RoPE scaling type {kind!r}, which jaxpaged does not read")
    if kind == "none" or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    return _yarn(meta, factor, context_length)


def _yarn(meta: Metadata, factor: float, context_length: int) -> dict:
    """The betas where the converter wrote them (HF's; llama.cpp reads them for a few architectures only, else
    uses HF's defaults 32 and 1). The cos/sin scale is llama.cpp's, which differs from HF's: YaRN's mscale of the
    file's factor (some transformers 4.x releases took max_position_embeddings / original instead) times
    `rope.scaling.attn_factor`; llama.cpp overwrites the `yarn_attn_factor` key (HF's attention_factor) with that
    mscale, so it is not read."""
    original = int(meta.get("rope.scaling.original_context_length", context_length))  # llama.cpp's n_ctx_orig_yarn
    scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    for key, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if (value := meta.get(f"rope.scaling.{key}")) is not None:
            scaling[field] = float(value)
    if (attn_factor := meta.get("rope.scaling.attn_factor")) is not None:
        mscale = 1.0 + 0.1 * math.log(factor) if factor > 1 else 1.0
        scaling["attention_factor"] = mscale * float(attn_factor)
    return scaling


def _llama(meta: Metadata, kwargs: dict) -> dict:
    if meta.get("expert_count"):  # llama.cpp writes Mixtral as `llama` with stacked experts
        raise ValueError(
            f"GGUF file {meta.path} is a llama-architecture file with experts (Mixtral), which jaxpaged does not read "
            "from GGUF; load the model from its HF safetensors folder instead"
        )
    return kwargs


def _without_false_biases(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k not in ("attention_bias", "mlp_bias") or v}


# Gemma 2 and 3 27B scale queries by (hidden / heads) ** -0.5, the others by head_dim ** -0.5; llama.cpp tells them
# apart by depth, since its files do not store query_pre_attn_scalar
GEMMA_27B_BLOCKS = {"gemma2": 46, "gemma3": 62}


def _gemma(meta: Metadata, kwargs: dict) -> dict:
    kwargs = _without_false_biases(kwargs)
    if meta.has("token_embd.weight"):  # Gemma 3's converter drops the padding rows past the real vocabulary
        kwargs["vocab_size"] = int(meta.tensors["token_embd.weight"].shape[-1])
    if meta.arch == "gemma":
        return kwargs
    layers, hidden, heads = kwargs["num_hidden_layers"], kwargs["hidden_size"], kwargs["num_attention_heads"]
    kwargs["query_pre_attn_scalar"] = hidden // heads if layers == GEMMA_27B_BLOCKS[meta.arch] else kwargs["head_dim"]
    if meta.arch == "gemma3":
        pattern = meta.get("attention.sliding_window_pattern", 6)  # llama.cpp's Gemma 3 default: 5 local, 1 global
        if isinstance(pattern, (list, tuple)):  # newer files: a flag per layer
            sliding = list(pattern)
        else:
            sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
        kwargs["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    return kwargs


def _phi3(meta: Metadata, kwargs: dict) -> dict:
    """The file states the rotary width, not the head's (which is hidden / heads unless key_length says), LongRoPE's
    factors as the tensors rope_factors_long/short, and a window of 0 for none."""
    kwargs = _without_false_biases(kwargs)
    head_dim = int(meta.get("attention.key_length", kwargs["hidden_size"] // kwargs["num_attention_heads"]))
    kwargs["head_dim"] = head_dim
    rope = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
    rotary = int(meta.get("rope.dimension_count", head_dim))
    if rotary != head_dim:
        rope["partial_rotary_factor"] = kwargs["partial_rotary_factor"] = rotary / head_dim
    if meta.has("rope_factors_long.weight"):
        rope |= {"rope_type": "longrope", "long_factor": meta.vector("rope_factors_long.weight"),
                 "short_factor": meta.vector("rope_factors_short.weight")}  # fmt: skip
        if (attention_factor := meta.get("rope.scaling.attn_factor")) is not None:
            rope["attention_factor"] = float(attention_factor)
    kwargs.pop("rope_scaling", None)
    kwargs["rope_parameters"] = rope
    kwargs["sliding_window"] = kwargs.get("sliding_window") or None
    return kwargs


def _qwen2moe(meta: Metadata, kwargs: dict) -> dict:
    """Every layer sparse (llama.cpp's qwen2moe has no dense FFN tensors); q/k/v biases as the file holds them."""
    kwargs = _without_false_biases(kwargs)
    return kwargs | {"qkv_bias": meta.has("blk.0.attn_q.bias"), "mlp_only_layers": [], "decoder_sparse_step": 1,
                     "use_sliding_window": False}  # fmt: skip


def _qwen2(meta: Metadata, kwargs: dict) -> dict:
    """Qwen2's q/k/v biases are its HF class's own (no config field); llama.cpp's qwen2 has no sliding window."""
    return _without_false_biases(kwargs) | {"use_sliding_window": False}


def _qwen3moe(meta: Metadata, kwargs: dict) -> dict:
    """Every layer sparse, no shared expert. llama.cpp's qwen3moe graph always renormalizes the top-k weights (it
    passes norm_w = true, whatever the source config's norm_topk_prob), and sizes an expert n_ff / top-k when the
    file omits expert_feed_forward_length."""
    kwargs = _without_false_biases(kwargs)
    kwargs.setdefault("moe_intermediate_size", kwargs["intermediate_size"] // kwargs["num_experts_per_tok"])
    return kwargs | {"norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1, "use_sliding_window": False}


GEMMA2_KEYS = (
    ("attention.sliding_window", "sliding_window", int, None),
    ("attn_logit_softcapping", "attn_logit_softcapping", float, 50.0),
    ("final_logit_softcapping", "final_logit_softcapping", float, 30.0),
)
GEMMA3_KEYS = (
    ("attention.sliding_window", "sliding_window", int, None),
    ("final_logit_softcapping", "final_logit_softcapping", float, None),
    ("rope.freq_base", "rope_theta", float, 1_000_000.0),  # the global layers'
    ("rope.freq_base_swa", "rope_local_base_freq", float, 10_000.0),
)
PHI3_KEYS = (
    ("attention.sliding_window", "sliding_window", int, None),
    ("rope.scaling.original_context_length", "original_max_position_embeddings", int, SKIP),
)
QWEN2MOE_KEYS = (
    ("expert_count", "num_experts", int, REQUIRED),
    ("expert_used_count", "num_experts_per_tok", int, REQUIRED),
    ("expert_feed_forward_length", "moe_intermediate_size", int, REQUIRED),
    ("expert_shared_feed_forward_length", "shared_expert_intermediate_size", int, REQUIRED),
    ("expert_weights_norm", "norm_topk_prob", bool, False),  # llama.cpp's qwen2moe: top-k weights not renormalized
)

QWEN3MOE_KEYS = (
    ("expert_count", "num_experts", int, REQUIRED),
    ("expert_used_count", "num_experts_per_tok", int, REQUIRED),
    ("expert_feed_forward_length", "moe_intermediate_size", int, SKIP),
)

ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("llama", "LlamaForCausalLM", derive=_llama, tensors=LLAMA_QK),
    "gemma": GGUFArchitecture("gemma", "GemmaForCausalLM", (), _gemma, GEMMA_NORMS, "GemmaTokenizer"),
    "gemma2": GGUFArchitecture("gemma2", "Gemma2ForCausalLM", GEMMA2_KEYS, _gemma, GEMMA_NORMS, "GemmaTokenizer"),
    "gemma3": GGUFArchitecture("gemma3_text", "Gemma3ForCausalLM", GEMMA3_KEYS, _gemma, GEMMA_NORMS, "GemmaTokenizer"),
    "phi3": GGUFArchitecture("phi3", "Phi3ForCausalLM", PHI3_KEYS, _phi3, PHI3_FUSED, "LlamaTokenizer",
                             ("rope_factors_long.weight", "rope_factors_short.weight")),
    "qwen2moe": GGUFArchitecture("qwen2_moe", "Qwen2MoeForCausalLM", QWEN2MOE_KEYS, _qwen2moe, QWEN2MOE_EXPERTS),
    # dense Qwen2 and Qwen3 (q/k norms): HF's own tensors, q/k rows unpermuted (the converter permutes llama's only)
    "qwen2": GGUFArchitecture("qwen2", "Qwen2ForCausalLM", derive=_qwen2),
    "qwen3": GGUFArchitecture("qwen3", "Qwen3ForCausalLM", derive=_qwen2),
    "qwen3moe": GGUFArchitecture("qwen3_moe", "Qwen3MoeForCausalLM", QWEN3MOE_KEYS, _qwen3moe, QWEN2MOE_EXPERTS),
}

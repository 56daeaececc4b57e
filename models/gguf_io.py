"""Reading a llama.cpp GGUF file as an HF config, an HF tokenizer and HF-named float tensors.

Everything here works without torch: the tokenizer is rebuilt from the file's vocabulary
with the `tokenizers` library the same way transformers does it, and tensors are
dequantized with the `gguf` package (the `gguf` extra; imported only when a file is read).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
from jaxpaged.models.accounting import shown
from jaxpaged.models.gguf_archs import ARCHITECTURES, COMMON_KEYS, Metadata, rope_scaling
from jaxpaged.utils.extras import require

logger = logging.getLogger(__name__)

# Pre-tokenizer splits for byte-level vocabularies, keyed by `tokenizer.ggml.pre`. Files whose
# pre-tokenizer is not listed get GPT-2's own split, as transformers gives them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}

_CONTROL, _USER_DEFINED = 3, 4


def _gguf(path: str):
    return require("gguf", f"reading the GGUF file {path}")


def open_gguf(path: str):
    gguf = _gguf(path)
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises many kinds on a damaged file
        raise ValueError(f"could not read GGUF file {path}: {exc}") from exc


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(reader, path: str) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        from jaxpaged.models.registry import supported_architectures

        raise ValueError(
            f"unsupported model architecture {arch!r} in GGUF file {path}; "
            f"supported GGUF architectures: {', '.join(sorted(ARCHITECTURES))} "
            f"(HF architectures: {', '.join(supported_architectures())})"
        )
    return arch


def gguf_hf_config(reader, path: str):
    """An HF PretrainedConfig equivalent to the one the GGUF was converted from (models/gguf_archs.py's tables)."""
    import transformers

    arch = gguf_architecture(reader, path)
    spec, meta = ARCHITECTURES[arch], Metadata(reader, arch, path)
    if meta.has("rope_freqs.weight"):
        raise ValueError(
            f"GGUF file {path} stores llama3 RoPE factors as a tensor, which jaxpaged does not read yet; "
            "load the model from its HF safetensors folder instead"
        )
    kwargs = meta.read_keys(COMMON_KEYS)
    heads, hidden = kwargs["num_attention_heads"], kwargs["hidden_size"]
    kwargs |= dict(
        architectures=[spec.hf_architecture],
        vocab_size=int(meta.get("vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data))),
        num_key_value_heads=int(meta.get("attention.head_count_kv", heads)),
        head_dim=int(meta.get("attention.key_length", meta.get("rope.dimension_count", hidden // heads))),
        tie_word_embeddings=not meta.has("output.weight"),
        bos_token_id=meta.field("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.field("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.field("tokenizer.ggml.padding_token_id"),
        attention_bias=meta.has("blk.0.attn_q.bias"),
        mlp_bias=meta.has("blk.0.ffn_up.bias"),
    )
    if (scaling := rope_scaling(meta, kwargs["max_position_embeddings"])) is not None:
        kwargs["rope_scaling"] = scaling
    kwargs |= meta.read_keys(spec.keys)
    if spec.derive is not None:
        kwargs = spec.derive(meta, kwargs)
    return transformers.AutoConfig.for_model(spec.model_type, **kwargs)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, which byte-level vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def gguf_tokenizer(reader, path: str):
    """A PreTrainedTokenizerFast for the file's byte-level BPE vocabulary, chat template included."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = _field(reader, "tokenizer.ggml.model")
    sentencepiece = ARCHITECTURES[gguf_architecture(reader, path)].sentencepiece_tokenizer
    if kind == "llama" and sentencepiece:
        return _sentencepiece_tokenizer(reader, path, sentencepiece)
    if kind != "gpt2":
        raise ValueError(
            f"GGUF file {path} has a {kind!r} tokenizer; jaxpaged rebuilds byte-level BPE ('gpt2') "
            "tokenizers only. Load the model from its HF folder instead."
        )
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges", [])]
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        (tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))): i
        for i, tok in enumerate(tokens)
    }
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = PRE_TOKENIZER_SPLITS.get(_field(reader, "tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
    )
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    special = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and token_id < len(tokens):
            special[name] = tokens[token_id]
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    if add_bos and "bos_token" in special:
        bos = special["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[bos])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=_field(reader, "tokenizer.chat_template"), **special
    )


def _sentencepiece_tokenizer(reader, path: str, tokenizer_class: str):
    """A SentencePiece vocabulary as transformers rebuilds it from a GGUF (its per-architecture fixes included: Gemma's
    spaces and merge order, Phi-3's prefix space), fed from this reader: transformers' own GGUF reader imports torch."""
    import transformers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    groups = {group: {} for group in GGUF_TOKENIZER_MAPPING}
    for group, renames in GGUF_TOKENIZER_MAPPING.items():
        for key, name in renames.items():
            if (value := _field(reader, f"tokenizer.{key}")) is not None:
                groups[group][name] = value
    tokens, config = groups["tokenizer"]["tokens"], groups["tokenizer_config"]
    config.setdefault("add_bos_token", True)  # llama.cpp's default for a SentencePiece vocabulary, as transformers
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id")
        config[name] = tokens[token_id] if token_id is not None and token_id < len(tokens) else None
    try:
        backend, _ = convert_gguf_tokenizer(_field(reader, "general.architecture"), groups["tokenizer"])
        return getattr(transformers, tokenizer_class)(tokenizer_object=backend, **config)
    except Exception as exc:
        raise ValueError(f"could not rebuild the tokenizer of GGUF file {path}: {exc}") from exc


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """llama.cpp's 4-bit order within each `width`-byte run: the run's low nibbles, then its high nibbles."""
    runs = qs.reshape(*qs.shape[:-1], -1, width)
    return np.concatenate([runs & 0xF, runs >> 4], axis=-1).reshape(*qs.shape[:-1], -1)


def group_quantized(tensor, path: str):
    """A Q8_0, Q4_0, Q4_1 or Q4_K tensor as GroupQuantized (its [rows, cols] with 32-wide groups along cols,
    exactly the values gguf's dequantize gives); None for other types."""
    from gguf import GGMLQuantizationType as Q

    from jaxpaged.models.quantization import GroupQuantized, pack_int4

    kind = tensor.tensor_type
    if kind not in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K):
        return None
    rows, cols = (int(d) for d in reversed(tensor.shape))
    data = np.asarray(tensor.data, np.uint8).reshape(rows, -1)
    if kind == Q.Q4_K:
        blocks = data.reshape(rows, cols // 256, 144)
        d, dmin = _f16(blocks[..., 0:2]).astype(np.float32), _f16(blocks[..., 2:4]).astype(np.float32)
        from gguf.quants import Q4_K

        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
        sc, mn = sc.reshape(rows, -1, 8).astype(np.float32), mn.reshape(rows, -1, 8).astype(np.float32)
        scale = (d[..., None] * sc).reshape(rows, -1)
        zero = -(dmin[..., None] * mn).reshape(rows, -1)
        codes = _nibbles(blocks[..., 16:], 32).reshape(rows, cols)
        return GroupQuantized(pack_int4(codes, axis=1), scale, zero, 4, 32, "Q4_K")
    size = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}[kind]
    blocks = data.reshape(rows, cols // 32, size)
    d = _f16(blocks[..., 0:2])
    if kind == Q.Q8_0:
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
        return GroupQuantized(codes, d, None, 8, 32, "Q8_0")
    if kind == Q.Q4_0:  # d * (q - 8)
        codes = _nibbles(blocks[..., 2:], 16).reshape(rows, cols)
        return GroupQuantized(pack_int4(codes, axis=1), d, (d.astype(np.float32) * -8.0), 4, 32, "Q4_0")
    codes = _nibbles(blocks[..., 4:], 16).reshape(rows, cols)  # Q4_1: d * q + m
    return GroupQuantized(pack_int4(codes, axis=1), d, _f16(blocks[..., 2:4]), 4, 32, "Q4_1")


def _tensor_plan(reader, path: str, hf_names: list[str], hf_config) -> dict[str, str | None]:
    """HF name -> the GGUF tensor it is read from; ValueError naming every GGUF tensor nothing reads (bar those the
    architecture reads into the config) and every HF tensor the file lacks, before any is read."""
    gguf = _gguf(path)
    arch = gguf_architecture(reader, path)
    spec = ARCHITECTURES[arch]
    arch_id = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    name_map = gguf.get_tensor_name_map(arch_id, hf_config.num_hidden_layers)
    plan = {}
    for hf_name in hf_names:
        rule = spec.rule(hf_name)
        plan[hf_name] = name_map.get_name(rule.gguf_side_name(hf_name) if rule else hf_name, try_suffixes=(".weight", ".bias"))
    stored = {t.name for t in reader.tensors}
    unknown = sorted(stored - set(plan.values()) - set(spec.config_tensors))
    missing = [f"{hf_name} ({gguf_name or 'no GGUF name'})" for hf_name, gguf_name in plan.items() if gguf_name not in stored]
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} tensor(s) that no parameter of the model reads: {shown(unknown)}")
    if missing:
        problems.append(f"{len(missing)} tensor(s) the model needs are missing: {shown(missing)}")
    if problems:
        raise ValueError(f"GGUF file {path} does not fit the {arch} architecture: {'; '.join(problems)}")
    return plan


def gguf_tensors(reader, path: str, hf_names: list[str], hf_config, keep_quantized: bool = False) -> Iterator[tuple[str, np.ndarray, str]]:
    """HF-named tensors, one at a time: float32, or with keep_quantized, GroupQuantized where group_quantized
    reads the type; what the converter did to a tensor undone per models/gguf_archs.py. Every tensor of the file is
    checked to be read first (_tensor_plan)."""
    plan = _tensor_plan(reader, path, hf_names, hf_config)
    return _read_tensors(reader, path, plan, hf_config, keep_quantized)


def _read_tensors(reader, path: str, plan: dict[str, str], hf_config, keep_quantized: bool) -> Iterator[tuple[str, np.ndarray, str]]:
    from gguf.quants import dequantize

    spec = ARCHITECTURES[gguf_architecture(reader, path)]
    by_gguf_name = {t.name: t for t in reader.tensors}
    for hf_name, gguf_name in plan.items():
        rule = spec.rule(hf_name)
        tensor = by_gguf_name[gguf_name]
        undo = rule.undo if rule and rule.undo else (lambda x, _: x)
        keep = keep_quantized and len(tensor.shape) == 2 and (rule is None or rule.keep_quantized)
        kept = group_quantized(tensor, path) if keep else None
        if kept is not None:
            yield hf_name, undo(kept, hf_config), path
            continue
        if keep_quantized and tensor.tensor_type.name not in ("F32", "F16", "BF16"):
            why = "is split at load" if rule and not rule.keep_quantized else "is not a Q8_0/Q4_0/Q4_1/Q4_K matrix"
            logger.info("GGUF tensor %s (%s) %s: dequantized", gguf_name, tensor.tensor_type.name, why)
        try:
            array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        except Exception as exc:
            raise ValueError(f"could not dequantize tensor {gguf_name} in {path}: {exc}") from exc
        yield hf_name, undo(array.reshape(tuple(int(d) for d in reversed(tensor.shape))), hf_config), path

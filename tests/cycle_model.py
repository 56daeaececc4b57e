"""A tiny Llama folder whose greedy output is known in advance, for server tests (no torch needed).

Attention and MLP outputs are zero, so the next-token logits depend only on the current token:
one-hot embeddings (hidden size = vocabulary) and an lm_head that scores one successor per token.
Greedy decoding therefore walks a fixed cycle of byte tokens that spells `CYCLE_TEXT`, which mixes
1- to 4-byte UTF-8 characters: a stream that splits a character between tokens shows up at once.
The successor's margin is only `MARGIN` logits, so sampling at temperature 1 is genuinely random.
`write_cycle_model` also takes extra whole-word tokens, another successor table and another chat template, for
outputs bytes alone cannot spell (tests/tool_model.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Every byte distinct, so "next byte" is a function of the current byte.
CYCLE_TEXT = "é日🚀ж ab"
CYCLE = list(CYCLE_TEXT.encode("utf-8"))
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|reserved_{i}|>" for i in range(5)]
VOCAB = 256 + len(SPECIALS)  # byte b is token b
EOS_ID = 256 + SPECIALS.index("<|im_end|>")
MARGIN = 4.0
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
assert len(set(CYCLE)) == len(CYCLE)


def successor(token: int) -> int:
    """The greedy next token: the cycle's next byte, or its first byte from anywhere else."""
    return CYCLE[(CYCLE.index(token) + 1) % len(CYCLE)] if token in CYCLE else CYCLE[0]


def greedy_bytes(last_prompt_token: int, count: int) -> bytes:
    out, tok = [], last_prompt_token
    for _ in range(count):
        tok = successor(tok)
        out.append(tok)
    return bytes(out)


def greedy_text(last_prompt_token: int, count: int) -> str:
    """What a greedy request of `count` tokens returns (a cut character decodes as U+FFFD, as a full decode does)."""
    return greedy_bytes(last_prompt_token, count).decode("utf-8", errors="replace")


def _tokenizer(words=(), chat_template=CHAT_TEMPLATE):
    from jaxpaged.models.gguf_io import _bytes_to_unicode
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spelling = _bytes_to_unicode()
    vocab = {spelling[b]: b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    backend.add_tokens([AddedToken(w, normalized=False, special=False) for w in words])  # ids VOCAB, VOCAB + 1, ...
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=chat_template, eos_token="<|im_end|>", bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )


def _weights(
    num_layers: int, heads: int, kv_heads: int, intermediate: int, seed: int, vocab: int = VOCAB, succ=successor
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d = vocab
    hd = d // heads
    w = {"model.embed_tokens.weight": np.eye(vocab, d, dtype=np.float32), "model.norm.weight": np.ones(d, np.float32)}
    head = np.zeros((vocab, d), np.float32)  # torch Linear layout [out, in]
    for tok in range(vocab):
        head[succ(tok), tok] = MARGIN / np.sqrt(d)  # the RMS-normed one-hot is sqrt(d) * e_tok
    w["lm_head.weight"] = head
    for i in range(num_layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = np.ones(d, np.float32)
        w[f"{p}.post_attention_layernorm.weight"] = np.ones(d, np.float32)
        for name, shape in (("q_proj", (heads * hd, d)), ("k_proj", (kv_heads * hd, d)), ("v_proj", (kv_heads * hd, d)),
                            ("gate_proj", (intermediate, d)), ("up_proj", (intermediate, d))):
            block = "mlp" if name in ("gate_proj", "up_proj") else "self_attn"
            w[f"{p}.{block}.{name}.weight"] = rng.normal(0, 0.1, shape).astype(np.float32)
        w[f"{p}.self_attn.o_proj.weight"] = np.zeros((d, heads * hd), np.float32)
        w[f"{p}.mlp.down_proj.weight"] = np.zeros((d, intermediate), np.float32)
    return w


def write_cycle_model(
    folder: Path, *, max_position_embeddings: int = 512, num_layers: int = 2, seed: int = 0, words=(), succ=successor,
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    """config.json + model.safetensors + tokenizer files in `folder`; returns the folder. `words` are extra tokens
    (ids VOCAB, VOCAB + 1, ...) and `succ` the greedy next token of every token."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    heads, kv_heads, intermediate = 4, 2, 64
    vocab = VOCAB + len(words)
    vocab += -vocab % (2 * heads)  # hidden size = vocabulary: whole heads of even size (spare ids are no successor)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": vocab,
        "intermediate_size": intermediate, "num_hidden_layers": num_layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": EOS_ID,
        "hidden_act": "silu", "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(_weights(num_layers, heads, kv_heads, intermediate, seed, vocab, succ), str(folder / "model.safetensors"))
    _tokenizer(words, chat_template).save_pretrained(str(folder))
    return folder

"""A tiny random-weight GPT-OSS (written by transformers, as tests/models/test_gpt_oss.py's) with GPT-OSS's own
vocabulary: 201088 ids and an o200k_harmony tokenizer, so the ids openai-harmony renders are this model's prompt ids.

The tokenizer is built offline from the o200k_base.tiktoken that harmony's encoding reads (litellm's copy, checked by
its SHA-256: jaxpaged/utils/harmony.py): transformers' TikTokenConverter turns the ranks into a byte-level BPE with
o200k's pre-tokenizer pattern, and harmony's special tokens (`<|startoftext|>` .. `<|reserved_201087|>`, named by
harmony's own encoding) follow the 199998 ranks, as in gpt-oss's tokenizer.json. The hidden size is small (32), so the
embedding and head hold ~13M values in all.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

HARMONY_VOCAB = 201088
# o200k_base's pre-tokenizer pattern (tiktoken's o200k_base, which o200k_harmony extends)
O200K_PATTERN = "|".join(  # noqa: FLY002
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)  # fmt: skip


def harmony_tokenizer():
    """GPT-OSS's tokenizer (o200k_harmony) as a transformers fast tokenizer; None when harmony's vocabulary is not
    installed (litellm's copy)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from jaxpaged.utils.harmony import BUNDLED_O200K, bundled_vocabulary, harmony_encoding

    folder = bundled_vocabulary()
    if folder is None:
        return None
    ranks = {}
    for line in (folder / BUNDLED_O200K[1].rsplit("/", 1)[1]).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    encoding = harmony_encoding()
    specials = [encoding.decode([i]) for i in range(len(ranks), HARMONY_VOCAB)]

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_path):
            return ranks

    backend = _Converter(vocab_file=str(folder), pattern=O200K_PATTERN, extra_special_tokens=specials).converted()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>"
    )


def write_gpt_oss_harmony_model(folder: Path, tokenizer) -> Path:
    """A random GPT-OSS with harmony's vocabulary and `tokenizer` in `folder` (torch and transformers write it)."""
    import transformers

    from tests.hf_reference import random_hf_model, save_hf_model

    config = transformers.GptOssConfig(
        vocab_size=HARMONY_VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        max_position_embeddings=1024, bos_token_id=199998, eos_token_id=200002, pad_token_id=199999,
    )  # fmt: skip
    folder = save_hf_model(random_hf_model(config), Path(folder))
    tokenizer.save_pretrained(str(folder))
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == ["GptOssForCausalLM"], saved["architectures"]
    return folder

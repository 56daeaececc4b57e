"""Kimi K2- and Moonlight-style checkpoint folders, as their repositories ship them, loaded without their remote code.

Kimi K2's config.json says model_type kimi_k2 (unknown to transformers) with an auto_map into its own
configuration_deepseek.py; it is read as DeepSeek-V3's config (models/loader.py's CONFIG_ALIASES). Both ship a
tiktoken.model and a remote-code TikTokenTokenizer (tokenization_kimi.py / tokenization_moonshot.py), rebuilt as a
transformers fast tokenizer from the files (models/tiktoken_folder.py) with the pattern the .py file spells, read as a
syntax tree. Every .py file written here raises if anything imports it. A random tiny DeepSeek-V3 written by
transformers is the model: greedy tokens and logits equal transformers' on the same weights; the tokenizer round-trips
text, maps special tokens to their ids, and (where the tiktoken package is installed) equals tiktoken's own Encoding
built from the same file and pattern."""

from __future__ import annotations

import base64
import itertools
import json
import logging
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from jaxpaged.models import hub, tiktoken_folder

REMOTE = 'raise RuntimeError("a checkpoint\'s remote code ran")\n'
RESERVED = 256  # the files' num_reserved_special_tokens, as Kimi K2's
MERGES = 230  # BPE merges learnt on CORPUS: 256 + 230 ranks, then 258 special ids: 744 < the model's 768
VOCAB = 768
CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's the model's turn; they're sure we'll see what I'd done. "
    "def load_model(folder): return folder / 'config.json'  # 12345 67890 3.14159\n\n"
    "月之暗面的 Kimi 模型支持长上下文。你好，世界！今天天气很好。 naïve café, émigré façade, Straße, Ελληνικά, русский. "
    "emoji 🤖🚀✨ and tabs\t\tand   spaces\r\nDONE. HTTPServer parses JSONData quickly. "
) * 3
TEXTS = [
    "Hello, world! It's 2025 and we're testing Kimi.",
    "你好，世界。月之暗面 Kimi 模型",
    "naïve café — émigré façade, STRASSE straße",
    "emoji 🤖🚀 and\ttabs\n\n  newlines\r\n end ",
    "HTTPServerError: 1234567 items; I'LL see what THEY'd do",
    "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "unseen bytes: \x00\x7f ÿ ǅ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]
SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
            7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}  # fmt: skip
TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def _train_ranks(text: str, merges: int) -> dict[bytes, int]:
    """A byte-level BPE learnt on `text` (the 256 bytes in a shuffled order, then the most frequent pair each step):
    every merged token the concatenation of two earlier ones, as tiktoken's files are."""
    order = np.random.default_rng(0).permutation(256)
    ranks = {bytes([int(b)]): r for r, b in enumerate(order)}
    words = [[bytes([c]) for c in w.encode()] for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", text)]
    for _ in range(merges):
        pairs = Counter(p for w in words for p in itertools.pairwise(w))
        (a, b), count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        assert count > 1
        ranks[a + b] = len(ranks)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == (a, b):
                    w[i : i + 2] = [a + b]
                i += 1
    return ranks


RANKS = _train_ranks(CORPUS, MERGES)
BASE_VOCAB = len(RANKS)


def _pattern_source(pattern_parts: list[str]) -> str:
    lines = "".join(f'            r"""{p}""",\n' for p in pattern_parts)
    return f'        "|".join(\n        [\n{lines}        ]\n    )'


def write_tokenizer(folder: Path, module: str = "tokenization_kimi", pattern: str = tiktoken_folder.KIMI_PATTERN):
    """The tokenizer files of Kimi K2's repository, in its layout, over RANKS; the .py file raises if imported."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = sorted(RANKS.items(), key=lambda kv: kv[1])
    (folder / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in lines))
    added = {str(BASE_VOCAB + i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": True} for i, c in SPECIALS.items()}  # fmt: skip
    config = {
        "added_tokens_decoder": added, "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>"],
        "auto_map": {"AutoTokenizer": [f"{module}.TikTokenTokenizer", None]}, "bos_token": "[BOS]",
        "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]", "chat_template": TEMPLATE,
        "clean_up_tokenization_spaces": False, "model_max_length": 131072, "tokenizer_class": "TikTokenTokenizer",
    }  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / f"{module}.py").write_text(
        REMOTE + "import tiktoken\nfrom transformers.tokenization_utils import PreTrainedTokenizer\n\n\n"
        "class TikTokenTokenizer(PreTrainedTokenizer):\n"
        '    vocab_files_names = {"vocab_file": "tiktoken.model"}\n'
        "    special_tokens: dict\n"
        f"    num_reserved_special_tokens = {RESERVED}\n\n"
        f"    pat_str = {_pattern_source(pattern.split('|')).strip()}\n\n"
        "    def __init__(self, vocab_file, **kwargs):\n"
        "        self.model = tiktoken.Encoding(name='x', pat_str=self.pat_str, mergeable_ranks={}, special_tokens={})\n"
    )
    return folder


def _ids(i: int) -> int:
    return BASE_VOCAB + i


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory):
    from jaxpaged.models.loader import _load_tokenizer

    return _load_tokenizer(write_tokenizer(tmp_path_factory.mktemp("kimi_tok")))


def test_the_tokenizer_round_trips_and_maps_special_tokens(kimi_tokenizer):
    tok = kimi_tokenizer
    assert len(tok) == BASE_VOCAB + RESERVED + 2  # the remote class's special ids
    for i, name in SPECIALS.items():
        assert tok.convert_tokens_to_ids(name) == _ids(i), name
    assert tok.convert_tokens_to_ids(f"<|reserved_token_{_ids(5)}|>") == _ids(5)
    named = (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id)
    assert named == (_ids(0), _ids(1), _ids(255), _ids(254))
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.encode(text) == ids  # nothing added around a prompt (the remote class adds no BOS)
        assert tok.decode(ids) == text, text
    ids = tok.encode(TEXTS[5])
    assert [i for i in ids if i >= BASE_VOCAB] == [_ids(3), _ids(17), _ids(2), _ids(4), _ids(17)]
    assert tok.decode(ids, skip_special_tokens=True) == "userWhat is 2+2?assistant"
    # merges learnt on the corpus make words single tokens; digits go in threes (the pattern's \p{N}{1,3})
    assert len(tok.encode(" the")) == 1
    pieces = [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("1234567")]
    assert [tok.convert_tokens_to_string([p]) for p in pieces] == ["123", "456", "7"]


def test_the_chat_template_and_special_tokens_in_text(kimi_tokenizer):
    tok = kimi_tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>你好<|im_end|>" \
                   "<|im_assistant|>assistant<|im_middle|>"  # fmt: skip
    ids = list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))
    assert ids == tok.encode(text, add_special_tokens=False)
    assistant = tok.encode("assistant")
    assert ids[0] == _ids(10) and ids[-len(assistant) - 2 :] == [_ids(4), *assistant, _ids(17)]


def test_ids_equal_tiktokens_own_encoding(kimi_tokenizer):
    """tiktoken's Encoding on the same ranks, pattern and special tokens (the remote class's encode, all specials
    allowed): the same ids on every text, and on random strings of the corpus's characters and others."""
    tiktoken = pytest.importorskip("tiktoken", reason="the tiktoken package is not a jaxpaged dependency")
    specials = {SPECIALS.get(i, f"<|reserved_token_{_ids(i)}|>"): _ids(i) for i in range(RESERVED + 2)}
    pattern = tiktoken_folder.KIMI_PATTERN
    enc = tiktoken.Encoding("kimi-test", pat_str=pattern, mergeable_ranks=RANKS, special_tokens=specials)
    rng = np.random.default_rng(1)
    chars = sorted(set(CORPUS + "".join(TEXTS) + "ÀÉÎØÜ ΑΒΓ АБВ 日本語 한국어 ١٢٣ ⅣⅫ 'S'T'RE'LL"))
    randoms = ["".join(rng.choice(chars, size=int(n))) for n in rng.integers(1, 80, size=40)]
    for text in TEXTS + [CORPUS] + randoms:
        want = enc.encode(text, allowed_special="all")
        assert kimi_tokenizer.encode(text, add_special_tokens=False) == want, repr(text)


def test_the_pattern_is_read_from_the_checkpoints_file_never_run(tmp_path, caplog):
    """Moonlight's file name; a pattern that differs from Kimi's (digits in twos) is the one used; a folder without
    the .py file falls back to Kimi's pattern, saying so."""
    from jaxpaged.models.loader import _load_tokenizer

    pattern = tiktoken_folder.KIMI_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}{1,2}")
    folder = write_tokenizer(tmp_path / "moonlight", module="tokenization_moonshot", pattern=pattern)
    assert tiktoken_folder.remote_tiktoken_class(folder) == "tokenization_moonshot.TikTokenTokenizer"
    tok = _load_tokenizer(folder)
    assert [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("12345")] == ["12", "34", "5"]
    assert tok.decode(tok.encode(TEXTS[1])) == TEXTS[1]
    (folder / "tokenization_moonshot.py").unlink()
    with caplog.at_level(logging.WARNING, logger="jaxpaged.tokenizer"):
        tok = _load_tokenizer(folder)
    assert "Kimi's pre-tokenizer pattern" in caplog.text
    assert [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("12345")] == ["123", "45"]


def test_class_constants_read_literals_only():
    src = (REMOTE + "X = 1\nclass Other:\n    pat_str = 'other'\nclass TikTokenTokenizer:\n"
           "    num_reserved_special_tokens: int = 8\n    pat_str = '|'.join(['a', r'\\p{N}'])\n")  # fmt: skip
    want = {"pat_str": r"a|\p{N}", "num_reserved_special_tokens": 8}
    assert tiktoken_folder.class_constants(src, "TikTokenTokenizer") == want
    assert tiktoken_folder.class_constants("pat_str = compute()\n", "TikTokenTokenizer") == {}


def test_the_hub_fetches_the_vocabulary_and_the_tokenizers_source_only():
    from huggingface_hub.utils import filter_repo_objects

    files = ["config.json", "tiktoken.model", "tokenization_kimi.py", "configuration_deepseek.py", "modeling_deepseek.py",
             "tokenizer_config.json", "model-00001-of-000061.safetensors", "chat_template.jinja"]  # fmt: skip
    assert set(filter_repo_objects(files, allow_patterns=hub.HUB_FILES)) == {
        "config.json", "tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json",
        "model-00001-of-000061.safetensors", "chat_template.jinja"}  # fmt: skip


# -- the model: config.json as Kimi K2 ships it ----------------------------------------------------------------------


def _kimi_config_json(folder: Path, model_type: str = "kimi_k2", architectures=("DeepseekV3ForCausalLM",)) -> None:
    """config.json rewritten as Kimi K2's: its model_type, an auto_map into its own code (files that raise if run),
    and the rope_scaling/rope_theta spelling of transformers 4.48 that it was written with."""
    raw = json.loads((folder / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = {**{k: v for k, v in rope.items() if k != "rope_type"}, "type": rope["rope_type"]}
    raw.update(model_type=model_type, architectures=list(architectures), auto_map={
        "AutoConfig": "configuration_deepseek.DeepseekV3Config", "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})  # fmt: skip
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    for name in ("configuration_deepseek.py", "modeling_deepseek.py"):
        (folder / name).write_text(REMOTE)


@pytest.fixture(scope="module")
def kimi_model(tmp_path_factory):
    """(the transformers reference, the Kimi K2-style folder, a Moonlight-style folder) on the same weights."""
    import shutil

    import transformers

    from tests.hf_reference import random_hf_model, save_hf_model
    from tests.models.test_deepseek import BASE, YARN, torch

    # test_deepseek's V3 (q low-rank, YaRN, grouped sigmoid router with a random correction bias), Kimi's vocabulary
    config = transformers.DeepseekV3Config(**{**BASE, "vocab_size": VOCAB}, q_lora_rank=48, n_shared_experts=1,
                                           routed_scaling_factor=2.5, n_group=4, topk_group=2, rope_parameters=YARN)  # fmt: skip
    hf = random_hf_model(config)
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    kimi = save_hf_model(hf, tmp_path_factory.mktemp("kimi_k2"))
    moonlight = Path(shutil.copytree(kimi, tmp_path_factory.mktemp("moonlight") / "m"))
    _kimi_config_json(kimi)
    write_tokenizer(kimi)
    _kimi_config_json(moonlight, model_type="deepseek_v3")  # Moonlight: a type transformers knows, the same auto_map
    write_tokenizer(moonlight, module="tokenization_moonshot")
    return hf, kimi, moonlight


def test_kimi_k2_loads_and_equals_transformers(kimi_model, caplog):
    """The kimi_k2 config read as DeepseekV3Config (logged), the weights through the MLA port: logits within 1e-4 and
    12 greedy tokens equal to transformers' DeepseekV3 on the same weights, on random ids and on a chat prompt."""
    import transformers
    from jaxpaged.models.loader import load_model

    from tests.hf_reference import hf_greedy, hf_logits, random_prompts
    from tests.static_batch import StaticBatchRunner

    hf, folder, _ = kimi_model
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoConfig.from_pretrained(str(folder), trust_remote_code=False)  # what transformers says alone
    with caplog.at_level(logging.INFO, logger="jaxpaged.loader"):
        loaded = load_model(str(folder), dtype="float32")
    assert "model_type 'kimi_k2' (unknown to transformers) read as DeepseekV3Config" in caplog.text
    assert type(loaded.hf_config) is transformers.DeepseekV3Config
    assert loaded.config.architecture == "DeepseekV3ForCausalLM"
    assert loaded.hf_config.rope_parameters["rope_type"] == "yarn" and loaded.hf_config.rope_parameters["factor"] == 8.0
    chat = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Kimi, 你好!"}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)  # fmt: skip
    prompts = [list(chat)] + random_prompts(VOCAB, [1, 40, 77], seed=5)
    greedy, logits = StaticBatchRunner(loaded, block_size=8).generate(prompts, 12, return_prompt_logits=True)
    for prompt, got_logits, got_tokens in zip(prompts, logits, greedy):
        np.testing.assert_allclose(got_logits, hf_logits(hf, prompt), atol=1e-4, rtol=0)
        assert got_tokens == hf_greedy(hf, prompt, 12)


def test_moonlight_reads_with_transformers_config_and_the_tiktoken_tokenizer(kimi_model):
    """Moonlight: model_type deepseek_v3 with an auto_map, read by transformers' own class (its code not run); its
    tokenization_moonshot.py tokenizer rebuilt like Kimi's."""
    import transformers
    from jaxpaged.models.loader import _load_hf_folder, _load_tokenizer
    from jaxpaged.pallas_kernels import ReferenceAttention

    _, kimi, folder = kimi_model
    _, cfg, hf_config, tok, _, _, _ = _load_hf_folder(folder, "float32", lambda _: ReferenceAttention())
    assert type(hf_config) is transformers.DeepseekV3Config and cfg.architecture == "DeepseekV3ForCausalLM"
    assert tok.encode(TEXTS[0]) == _load_tokenizer(kimi).encode(TEXTS[0])


def test_configs_no_alias_covers_stay_a_clear_error(tmp_path):
    """A model_type transformers does not know and the alias table does not name (even with DeepSeek-V3's
    architecture), and kimi_k2 naming an architecture that is not DeepSeek-V3's: a ValueError naming config.json, as
    before; Kimi K2.5 (transformers' kimi_k25, an image-text wrapper) an unsupported architecture."""
    from jaxpaged.models.loader import load_model

    cases = (("moonshot_next", "DeepseekV3ForCausalLM", "config.json"), ("kimi_k2", "KimiLinearForCausalLM", "config.json"),
             ("kimi_k25", "KimiK25ForConditionalGeneration", "unsupported model architecture"))  # fmt: skip
    for model_type, arch, message in cases:
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [arch],
                                                        "auto_map": {"AutoConfig": "configuration_x.XConfig"}}))  # fmt: skip
        (folder / "configuration_x.py").write_text(REMOTE)
        expected = re.escape(str(folder / "config.json")) if message == "config.json" else message
        with pytest.raises(ValueError, match=expected):
            load_model(str(folder), dtype="float32")

"""The built-in SmolLM2-135M-Instruct against transformers loading the same GGUF, in float32."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch (the dev extra) is the reference model")

from models.builtin import builtin_gguf_path  # noqa: E402

try:
    GGUF = builtin_gguf_path()
except FileNotFoundError as exc:
    pytest.skip(f"built-in model absent ({exc}); CI installs it", allow_module_level=True)

from jaxpaged.static_batch import StaticBatchRunner  # noqa: E402
from jaxpaged.text import encode_prompt  # noqa: E402
from models.loader import load_model  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colors: 1.",
    "Water boils at",
]
TEXTS = [
    "Hello, world!",
    "  leading spaces and 12345 digits 3.14159",
    "unicode: héllo wörld, 日本語, emoji 🚀🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
    "tabs\tand\nnewlines\r\n done",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return os.environ.get("JAXPAGED_CACHE_DIR") or str(tmp_path_factory.mktemp("jaxpaged-cache"))


@pytest.fixture(scope="module")
def ours(cache_dir):
    return load_model(None, dtype="float32", cache_dir=cache_dir)


@pytest.fixture(scope="module")
def hf():
    import transformers

    folder, name = str(Path(GGUF).parent), Path(GGUF).name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    return model, tokenizer


def test_tokenizer_matches_transformers(ours, hf):
    _, hf_tok = hf
    for text in TEXTS:
        assert ours.tokenizer.encode(text) == hf_tok.encode(text), text
        assert ours.tokenizer.decode(ours.tokenizer.encode(text)) == text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert encode_prompt(ours.tokenizer, messages[0]["content"], chat=True) == list(want)
    assert ours.tokenizer.eos_token == hf_tok.eos_token


def test_greedy_64_tokens_match_transformers(ours, hf):
    model, tokenizer = hf
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    got = StaticBatchRunner(ours).generate(prompts, 64)
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=64, min_new_tokens=64, pad_token_id=0,
            )
        assert tokens == out[0, len(prompt):].tolist(), tokenizer.decode(prompt)


def test_cli_chat_answers_paris(ours, cache_dir):
    env = dict(os.environ, JAXPAGED_CACHE_DIR=cache_dir)
    result = subprocess.run(
        [sys.executable, "-m", "jaxpaged.generate", "--chat", "What is the capital of France?"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "loaded SmolLM2" in result.stderr  # load time is logged

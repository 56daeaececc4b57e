"""A hybrid model served like the rest: the generate CLI and the OpenAI server answer with transformers' greedy text,
and structured outputs constrain it. A tiny random Qwen3.5 (tests/models/test_hybrid_models.py) with the cycle model's
byte-level tokenizer (tests/cycle_model.py), float32."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest

from tests import REPO
from tests.cycle_model import VOCAB, _tokenizer
from tests.hf_reference import hf_greedy, save_hf_model
from tests.models.test_hybrid_models import CASES, hybrid_hf_model

PROMPT = "The state of"
ARGS = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--block-size", "8",
        "--dtype", "float32"]  # fmt: skip


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(folder, tokenizer, transformers' greedy text after PROMPT, 10 tokens)."""
    config_cls, kwargs, _ = CASES["qwen3.5-dense-tied"]
    hf = hybrid_hf_model(config_cls(**{**kwargs, "vocab_size": VOCAB}))
    folder = save_hf_model(hf, tmp_path_factory.mktemp("qwen3.5-served"))
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(str(folder))
    ids = tokenizer.encode(PROMPT)
    return folder, tokenizer, tokenizer.decode(hf_greedy(hf, ids, 10))


def _env(tmp_path):
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                JAXPAGED_CACHE_DIR=str(tmp_path))  # fmt: skip


def test_generate_cli_streams_transformers_greedy_text(hybrid, tmp_path):
    folder, _, want = hybrid
    run = subprocess.run([sys.executable, "-m", "jaxpaged.generate", "--model", str(folder), "--max-tokens", "10", *ARGS,
                          PROMPT], capture_output=True, text=True, timeout=600, cwd=REPO, env=_env(tmp_path))  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert want in run.stdout
    assert "prefix caching is off" in run.stderr


def test_server_completes_and_constrains(hybrid, tmp_path):
    from tests.server_harness import ServerProcess

    folder, tokenizer, want = hybrid
    server = ServerProcess(["--model", str(folder), "--served-model-name", "hybrid", *ARGS], tmp_path / "server.log")
    try:
        body = {"model": "hybrid", "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        choices = ["alpha", "beta", "gamma"]
        for constraint, check in (
            ({"choice": choices}, lambda text: text in choices),
            ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
        ):
            body = {"model": "hybrid", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.8, "seed": 3, "n": 3,
                    "structured_outputs": constraint}  # fmt: skip
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts = [c["text"] for c in r.json()["choices"]]
            assert len(texts) == 3 and all(check(t) for t in texts), texts
    finally:
        server.stop()

"""`python -m jaxpaged.generate` takes the model's generation_config.json defaults for the sampling flags left out
(vLLM's users get them), its own (greedy, 256 tokens) where the model has none, and the flags given over both."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from jaxpaged.entrypoints import generate
from tests.cycle_model import greedy_bytes


def _params(argv, model_defaults=None):
    return generate.sampling_params(generate.build_parser().parse_args(argv), model_defaults)


def test_flags_over_the_models_defaults_over_the_clis(caplog):
    plain = _params(["hi"])  # a model without a generation config (the built-in GGUF): greedy, 256 tokens, as before
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (0.0, 1.0, 0, 256)
    model = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 32}
    with caplog.at_level(logging.INFO, logger="jaxpaged"):
        mixed = _params(["--temperature", "0.3", "--top-k", "4", "hi"], model)
    assert (mixed.temperature, mixed.top_p, mixed.top_k, mixed.repetition_penalty, mixed.max_tokens) == (0.3, 0.95, 4, 1.1, 32)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "'top_p': 0.95" in logged and "'max_tokens': 32" in logged and "temperature" not in logged


def test_a_run_takes_the_models_defaults(cycle_model_dir, tmp_path, capsys):
    """top_k 1 makes the model's temperature sample greedily, so the tokens are known; max_new_tokens is its length."""
    folder = tmp_path / "with-defaults"
    shutil.copytree(cycle_model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.5, "top_k": 1, "max_new_tokens": 3}))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ab\n")
    engine = ["--model", str(folder), "--dtype", "float32", "--max-model-len", "64", "--quiet"]
    assert generate.main([*engine, "--prompts-file", str(prompts)]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["token_ids"] == list(greedy_bytes(ord("b"), 3)) and record["finish_reason"] == "length"
    assert generate.main([*engine, "--max-tokens", "5", "--prompts-file", str(prompts)]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["token_ids"] == list(greedy_bytes(ord("b"), 5))


@pytest.mark.parametrize("flag", ["--top-p", "--temperature"])
def test_bad_values_are_still_refused_before_the_model_loads(flag, capsys):
    assert generate.main([flag, "-3", "hi"]) == 2
    assert f"error: {flag} must be" in capsys.readouterr().err

"""The built-in SmolLM2-135M-Instruct against transformers loading the same GGUF, in float32."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch (the dev extra) is the reference model")

from jaxpaged.models.builtin import builtin_gguf_path  # noqa: E402

try:
    GGUF = builtin_gguf_path()
except FileNotFoundError as exc:
    pytest.skip(f"built-in model absent ({exc}); CI installs it", allow_module_level=True)

from jaxpaged.models.loader import load_model  # noqa: E402

from jaxpaged.utils.text import chat_prompt_ids  # noqa: E402
from tests.static_batch import StaticBatchRunner  # noqa: E402

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
    assert chat_prompt_ids(ours.tokenizer, messages) == list(want)
    assert ours.tokenizer.eos_token == hf_tok.eos_token


GREEDY_TOKENS = 32  # per prompt: 160 tokens in all, each equal to transformers'


@pytest.fixture(scope="module")
def hf_greedy(hf) -> dict[str, list[int]]:
    """transformers' greedy tokens after each of PROMPTS (EOS ignored), computed once."""
    model, tokenizer = hf
    want = {}
    for text in PROMPTS:
        prompt = tokenizer.encode(text)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, pad_token_id=0,
            )
        want[text] = out[0, len(prompt) :].tolist()
    return want


def test_greedy_tokens_match_transformers(ours, hf, hf_greedy):
    _, tokenizer = hf
    got = StaticBatchRunner(ours).generate([tokenizer.encode(p) for p in PROMPTS], GREEDY_TOKENS)
    for text, tokens in zip(PROMPTS, got):
        assert tokens == hf_greedy[text], text


CLI_ENGINE = ["--max-model-len", "512", "--max-num-batched-tokens", "32", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def llm(cache_dir):
    """The CLI tests' engine shape (CLI_ENGINE), on their cache folder: their engines take the executables this one
    compiled and stored (in this process from memory, the CLI's own process from the folder), not the 30-layer
    model's steps compiled again at each start."""
    from jaxpaged import LLM

    return LLM(cache_dir=cache_dir, dtype="float32", max_model_len=512, max_num_batched_tokens=32, max_num_seqs=4,
               log_level="WARNING")


def test_engine_greedy_matches_transformers_and_stops(llm, hf, hf_greedy):
    """The continuous-batching engine gives transformers' greedy tokens; stop strings cut the text."""
    from jaxpaged import SamplingParams

    _, tokenizer = hf
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        want = hf_greedy[prompt]
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].text == tokenizer.decode(want, skip_special_tokens=True)
    full = outs[0].outputs[0].text
    word = full.split()[1]
    stopped = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=32, stop=[word]), use_tqdm=False)[0]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == word
    assert stopped.outputs[0].text == full[: full.index(word)]
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in chat.outputs[0].text and chat.outputs[0].finish_reason == "stop"
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_cli_prompts_file_and_interactive(cache_dir, tmp_path, monkeypatch, capsys):
    import json

    from jaxpaged.entrypoints import generate

    monkeypatch.setenv("JAXPAGED_CACHE_DIR", cache_dir)
    engine_flags = [*CLI_ENGINE, "--quiet"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\nName a primary color.\n")
    out_file = tmp_path / "out.jsonl"
    assert generate.main(["--chat", "--max-tokens", "24", "--prompts-file", str(prompts), "--output", str(out_file)] + engine_flags) == 0
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["What is the capital of France?", "Name a primary color."]
    assert "Paris" in records[0]["text"] and all(r["token_ids"] for r in records)

    question = "What is the capital of France?"
    lines = iter([question, "Say that again.", "/reset", question])
    from jaxpaged.engine.llm_engine import LLMEngine

    prompt_lengths = []
    add_request = LLMEngine.add_request

    def spy(self, request_id, prompt, params=None, **kwargs):
        request_id = add_request(self, request_id, prompt, params, **kwargs)
        prompt_lengths.append(len(self.get_prompt_token_ids(request_id)))  # the conversation as the engine rendered it
        return request_id

    monkeypatch.setattr(LLMEngine, "add_request", spy)

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    monkeypatch.setattr("sys.stdin.isatty", lambda: True, raising=False)
    capsys.readouterr()
    assert generate.main(["--chat", "--max-tokens", "24"] + engine_flags) == 0
    answers = capsys.readouterr().out.strip().splitlines()
    assert "Paris" in answers[0] and answers[-1] == answers[0]  # after /reset the same question, the same answer
    first, follow_up, after_reset = prompt_lengths
    assert follow_up > first and after_reset == first  # the conversation was carried, then /reset dropped it


def test_cli_help_explains_every_flag():
    result = subprocess.run([sys.executable, "-m", "jaxpaged.generate", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for flag in ["--model", "--dtype", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--chat",
                 "--system", "--prompts-file"]:
        assert flag in result.stdout


def test_cli_chat_answers_paris(ours, cache_dir):
    env = dict(os.environ, JAXPAGED_CACHE_DIR=cache_dir)
    result = subprocess.run(
        [sys.executable, "-m", "jaxpaged.generate", "--chat", *CLI_ENGINE, "What is the capital of France?"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "loaded SmolLM2" in result.stderr  # load time is logged


def test_beam_search_best_beam_matches_transformers(llm, hf):
    """Beam search on the real model, ending on <|im_end|>: transformers' best beam, token for token."""
    from jaxpaged import BeamSearchParams

    model, tokenizer = hf
    eos = llm.engine.eos_token_ids
    messages = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name a primary color.")]
    prompts = [chat_prompt_ids(tokenizer, m) for m in messages]
    for width, length_penalty in ((3, 1.0), (2, 0.5)):
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                               BeamSearchParams(beam_width=width, max_tokens=32, length_penalty=length_penalty),
                               use_tqdm=False)  # fmt: skip
        for prompt, out in zip(prompts, outs):
            with torch.no_grad():
                want = model.generate(
                    torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    num_beams=width, do_sample=False, max_new_tokens=32, length_penalty=length_penalty,
                    eos_token_id=eos, pad_token_id=0,
                )  # fmt: skip
            assert out.sequences[0].output_token_ids == want[0, len(prompt) :].tolist()
    assert outs[0].sequences[0].finish_reason == "stop" and "Paris" in outs[0].sequences[0].text

"""The command lines' own behaviour, with no model loaded: bad flags refused in a line that names the flag (and,
for a vLLM flag they lack, what to use instead) before anything loads, Ctrl-C, and the server's port."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from jaxpaged.entrypoints import generate


class _Loaded(Exception):
    """Raised by the fake LLM: the CLI got as far as loading the model."""


@pytest.fixture
def no_model(monkeypatch):
    """LLM(...) records its call and stops: a test sees whether the CLI would have loaded the model."""
    calls = []

    def fake_llm(**kwargs):
        calls.append(kwargs)
        raise _Loaded

    monkeypatch.setattr("jaxpaged.entrypoints.llm.LLM", fake_llm)
    return calls


def _error_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_generate_refuses_vllm_flags_in_a_line_with_what_to_use(capsys):
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--gpu-memory-utilization", "0.5", "--enforce-eager", "hello"])
    assert exit_.value.code == 2
    lines = _error_lines(capsys)
    assert len(lines) == 4, lines  # the error, two hints, --help: not argparse's fifty lines of usage
    assert "unrecognized arguments: --gpu-memory-utilization" in lines[0]
    assert "--kv-cache-memory-fraction" in lines[1] and "--no-precompile" in lines[2]
    with pytest.raises(SystemExit):
        generate.main(["Once", "upon", "a", "time"])
    assert "needs quotes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate.main(["--max-tokens", "many", "hello"])
    assert "argument --max-tokens: invalid int value: 'many'" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--top-p", "2", "hello"], "error: --top-p must be in (0, 1]"),
    (["--max-tokens", "0", "hello"], "error: --max-tokens must be"),
    (["--temperature", "-1", "hello"], "error: --temperature must be >= 0"),
    (["--seed", "-1", "hello"], "error: --seed must be"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "error: --prompts-file /nonexistent/prompts.txt: No such file"),
    (["--prompts-file", "/"], "error: --prompts-file /: Is a directory"),
])  # fmt: skip
def test_generate_checks_its_flags_before_the_model_loads(no_model, capsys, flags, message):
    assert generate.main(flags) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert no_model == []  # refused before the load, not after it


def test_generate_refuses_flags_that_would_be_ignored(no_model, capsys, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\n")
    for flags, message in [
        (["--output", str(tmp_path / "out.jsonl"), "hello"], "--output writes --prompts-file's results"),
        (["--system", "Be brief.", "hello"], "--system is the system message of --chat"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            generate.main(flags)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert generate.main(["--prompts-file", str(prompts), "--output", str(tmp_path / "no" / "out.jsonl")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert no_model == []
    with pytest.raises(_Loaded):  # well-formed, they reach the load
        generate.main(["--chat", "--system", "Be brief.", "hello"])


def test_a_ctrl_c_a_library_swallows_during_the_load_still_stops_the_run(monkeypatch):
    """A KeyboardInterrupt that a library swallows (Python prints and drops one raised inside a gc callback, and JAX
    has one that runs often while a model loads) let the load go on and the CLI generate its whole answer as if
    Ctrl-C had not been pressed. Here the load swallows it itself: raise_signal runs the handler at once, so the
    KeyboardInterrupt is raised there, deterministically (a gc.collect() runs no callbacks while another thread
    collects, so a test that relied on one could miss its Ctrl-C)."""

    class Engine:
        steps = 0
        pooler = None  # a generating model
        default_sampling_kwargs: dict = {}  # a model without a generation config

        def add_request(self, *args, **kwargs):
            return "0"

        def abort_request(self, request_id):
            pass

        def has_unfinished_requests(self):
            return Engine.steps < 3

        def step(self):
            Engine.steps += 1
            return []

    class FakeLLM:
        is_follower = False
        engine = Engine()
        loaded = False

        def __init__(self, **kwargs):
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                pass  # swallowed, as a gc callback's is
            FakeLLM.loaded = True  # the load went on: the KeyboardInterrupt never reached the CLI

        def get_tokenizer(self):
            return object()

    monkeypatch.setattr("jaxpaged.entrypoints.llm.LLM", FakeLLM)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, which the CLI takes over
    try:
        assert generate.main(["hello", "--max-tokens", "4"]) == 130
        assert FakeLLM.loaded and Engine.steps == 0  # stopped after the load, before any step
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the CLI's handler is gone again
    finally:
        signal.signal(signal.SIGINT, before)


# -- python -m jaxpaged.serve ------------------------------------------------------------------------------


@pytest.fixture
def no_engine(monkeypatch):
    """make_engine records its call and stops."""
    calls = []

    def fake_make_engine(config):
        calls.append(config)
        raise _Loaded

    monkeypatch.setattr("jaxpaged.engine.data_parallel.make_engine", fake_make_engine)
    return calls


@pytest.mark.parametrize(("flags", "message"), [
    (["--port", "70000"], "argument --port: must be a port number, 0 to 65535 (got 70000)"),
    (["--port", "http"], "argument --port: invalid int value: 'http'"),
    (["--max-waiting", "0"], "argument --max-waiting: must be a positive integer (got 0)"),
    (["--log-level", "loud"], "argument --log-level: invalid choice: 'LOUD'"),
    (["--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization: the KV cache is sized with --kv-cache-memory-fraction"),
    (["--uvicorn-log-level", "debug"], "--uvicorn-log-level: use --log-level"),
    (["Qwen/Qwen2.5-0.5B-Instruct"], "the model is given as --model MODEL"),
])  # fmt: skip
def test_serve_refuses_bad_and_vllm_flags_in_a_line(no_engine, capsys, flags, message):
    from jaxpaged.entrypoints import serve

    with pytest.raises(SystemExit) as exit_:
        serve.main(flags)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) <= 3, err  # not argparse's fifty lines of usage
    assert no_engine == []


def test_serve_log_level_takes_any_case(no_engine):
    """uvicorn knows only lower-case names and jaxpaged's logging only upper-case ones: `warn` or `Info` crashed
    one of them (the second after the model had loaded)."""
    from jaxpaged.entrypoints.serve import build_parser

    assert build_parser().parse_args(["--log-level", "warning"]).log_level == "WARNING"


def test_a_busy_port_stops_the_start_before_the_engine_loads(no_engine, capsys):
    """It was found by uvicorn after the model had loaded and every step compiled (minutes for a large model)."""
    from jaxpaged.entrypoints import serve

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert serve.main(["--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"error: cannot listen on 127.0.0.1:{port} (--host, --port): Address already in use" in err
    assert no_engine == []


def test_ctrl_c_while_the_engine_starts_exits_130_and_frees_the_port(monkeypatch, capsys):
    from jaxpaged.entrypoints import serve

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr("jaxpaged.engine.data_parallel.make_engine", interrupted)
    assert serve.main(["--port", str(port)]) == 130  # was a traceback through the engine's start-up
    assert "Traceback" not in capsys.readouterr().err
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))  # the early bind was closed


def test_both_clis_take_the_same_engine_flags_and_differ_only_in_defaults():
    """README: the server's model and engine flags are generate's (it said the server lacked --tensor-parallel-size
    and alone had --kv-cache-memory-fraction, which both have), with --precompile on and --seed the engine's."""
    from jaxpaged.engine.arg_utils import cli_fields
    from jaxpaged.entrypoints.serve import build_parser as serve_parser

    gen, srv = generate.build_parser(), serve_parser()
    engine_flags = {"--" + f.name.replace("_", "-") for f in cli_fields()}
    for parser in (gen, srv):
        assert engine_flags <= set(parser._option_string_actions)
    assert gen.parse_args(["x"]).precompile is False and srv.parse_args([]).precompile is True
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    assert "has no `--tensor-parallel-size`" not in readme


@pytest.mark.parametrize(("argv0", "prog"), [
    ("/venv/bin/jaxpaged-generate", "jaxpaged-generate"),
    ("/site-packages/jaxpaged/__main__.py", "python -m jaxpaged"),
    ("/site-packages/jaxpaged/entrypoints/generate.py", "python -m jaxpaged.generate"),
])  # fmt: skip
def test_help_and_errors_name_the_command_the_user_ran(monkeypatch, argv0, prog):
    """`jaxpaged-generate --help` and `python -m jaxpaged --help` said "usage: python -m jaxpaged.generate"."""
    monkeypatch.setattr("sys.argv", [argv0])
    assert generate.build_parser().prog == prog


def test_quiet_batch_shows_no_progress_bar(monkeypatch, tmp_path, capsys):
    """--quiet ("log warnings only") still drew LLM.generate's "Generating" bar over a --prompts-file run."""
    from types import SimpleNamespace

    bars = []

    class FakeLLM:
        is_follower = False
        engine = SimpleNamespace(pooler=None, default_sampling_kwargs={})  # a generating model, no generation config

        def __init__(self, **kwargs):
            pass

        def get_tokenizer(self):
            return object()

        def generate(self, prompts, params, lora_request=None, use_tqdm=True):
            bars.append(use_tqdm)
            done = SimpleNamespace(text="x", token_ids=[1], finish_reason="length")
            return [SimpleNamespace(outputs=[done]) for _ in prompts]

    monkeypatch.setattr("jaxpaged.entrypoints.llm.LLM", FakeLLM)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\n")
    assert generate.main(["--quiet", "--prompts-file", str(prompts)]) == 0
    assert generate.main(["--prompts-file", str(prompts)]) == 0
    assert bars == [False, True]
    assert capsys.readouterr().out.count('"text": "x"') == 4


def test_an_empty_api_key_is_refused_not_an_open_server(no_engine, capsys, monkeypatch):
    """README's `--api-key "$KEY"` with KEY unset passed "", which served every route without a key."""
    from jaxpaged.entrypoints import serve

    with pytest.raises(SystemExit) as exit_:
        serve.main(["--api-key", "", "--port", "0"])
    assert exit_.value.code == 2 and "--api-key is empty" in capsys.readouterr().err
    assert no_engine == []
    monkeypatch.setenv("JAXPAGED_API_KEY", "")  # an empty variable is no key, as before
    assert serve.build_parser().parse_args([]).api_key is None


def test_vllms_short_flags_are_taken():
    """-tp, -pp, -dp and -q, as vllm serve spells them."""
    import argparse

    from jaxpaged.engine.arg_utils import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kwargs = engine_kwargs(p.parse_args(["-tp", "4", "-pp", "2", "-dp", "3", "-q", "int8"]))
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"], kwargs["data_parallel_size"]) == (4, 2, 3)
    assert kwargs["quantization"] == "int8"

"""Reasoning outputs end to end with the openai client: the think model (tests/reasoning_model.py) answers with
`<think>` reasoning `</think>` and an answer, which the server splits into message.reasoning_content and content
(streamed as delta.reasoning_content and delta.content) with the parser it found in the chat template (qwen3,
deepseek_r1) or was given (gpt_oss); chat_template_kwargs turn the thinking off; tool calls are read from the
answer only; an output constraint starts after `</think>` (qwen3, deepseek_r1) or harmony's
`<|channel|>final<|message|>` (gpt_oss).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.conftest import ENGINE_ARGS
from tests.reasoning_model import (
    ANSWER,
    CONTENT,
    DEEPSEEK_TEMPLATE,
    HARMONY_CALL,
    HARMONY_CONTENT,
    HARMONY_REASONING,
    QWEN3_TEXT,
    REASONING,
    write_harmony_model,
    write_think_model,
)  # fmt: skip

MODEL = "think-model"
USER = [{"role": "user", "content": "2 + 2?"}]
TOOLS = [{"type": "function", "function": {"name": "now"}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]  # fmt: skip
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"], "additionalProperties": False}


def _serve(model_dir, log, *flags):
    from tests.server_harness import ServerProcess

    return ServerProcess(["--model", str(model_dir), "--served-model-name", MODEL, "--log-level", "INFO", *flags, *ENGINE_ARGS], log)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    proc = _serve(write_think_model(tmp_path_factory.mktemp("qwen3")), tmp_path_factory.mktemp("qwen3-server") / "log")
    yield proc
    proc.stop()


def _client(proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _create(proc, **fields):
    return _client(proc).chat.completions.create(**{"model": MODEL, "messages": USER, "temperature": 0, "max_tokens": 40, **fields})


def _streamed(proc, **fields) -> tuple[str | None, str | None, str, list]:
    """(reasoning, content, finish_reason, tool-call deltas) of a streamed answer."""
    reasoning, content, calls, finish = [], [], [], None
    for chunk in _create(proc, stream=True, **fields):
        (choice,) = chunk.choices
        delta = choice.delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
        calls += delta.tool_calls or []
        finish = choice.finish_reason or finish
    return "".join(reasoning) or None, "".join(content) or None, finish, calls


def test_qwen3_splits_reasoning_from_content(qwen3):
    assert "qwen3 reasoning parser" in qwen3.log()
    (choice,) = _create(qwen3).choices
    assert choice.message.reasoning_content == REASONING and choice.message.content == CONTENT
    assert choice.finish_reason == "stop"
    assert _streamed(qwen3) == (REASONING, CONTENT, "stop", [])
    cut = _create(qwen3, max_tokens=2).choices[0]  # cut short inside the thinking
    assert (cut.message.reasoning_content, cut.message.content, cut.finish_reason) == ("Let me think.", None, "length")


def test_enable_thinking_false_reaches_the_template(qwen3):
    off = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    (choice,) = _create(qwen3, **off).choices
    assert (choice.message.reasoning_content, choice.message.content) == (None, ANSWER)
    assert _streamed(qwen3, **off) == (None, ANSWER, "stop", [])
    on = _create(qwen3, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert on.choices[0].message.reasoning_content == REASONING
    assert on.usage.prompt_tokens < _create(qwen3, **off).usage.prompt_tokens  # "<think>\n\n</think>\n\n" added
    with pytest.raises(openai.BadRequestError) as bad:
        _create(qwen3, extra_body={"chat_template_kwargs": {"tools": []}})
    assert bad.value.body["param"] == "chat_template_kwargs"


def test_tool_calls_come_from_the_answer_only(qwen3):
    # the thinking holds a <tool_call> block: under "auto" it is reasoning, and the answer holds no call
    (choice,) = _create(qwen3, tools=TOOLS).choices
    assert choice.message.reasoning_content == REASONING and not choice.message.tool_calls
    assert choice.message.content == CONTENT and choice.finish_reason == "stop"
    reasoning, content, finish, calls = _streamed(qwen3, tools=TOOLS)
    assert (reasoning, content, finish, calls) == (REASONING, CONTENT, "stop", [])
    # "required": the calls' grammar starts after </think>, so the model thinks as it likes and then calls
    # (this model repeats the call until max_tokens: the array has no end it prefers)
    required = {"tools": TOOLS[:1], "tool_choice": "required", "max_tokens": 60}
    (choice,) = _create(qwen3, **required).choices
    assert choice.message.reasoning_content == REASONING and "<tool_call>" not in (choice.message.content or "")
    first = choice.message.tool_calls[0].function
    assert (first.name, first.arguments) == ("now", "{}")
    reasoning, _, _, calls = _streamed(qwen3, **required)
    assert reasoning == REASONING and calls[0].function.name == "now"


@pytest.mark.parametrize("stream", [False, True])
def test_the_output_constraint_starts_after_the_thinking(qwen3, stream):
    fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}, "max_tokens": 120}
    if stream:
        reasoning, content, finish, _ = _streamed(qwen3, **fields)
    else:
        (choice,) = _create(qwen3, **fields).choices
        reasoning, content, finish = choice.message.reasoning_content, choice.message.content, choice.finish_reason
    assert reasoning == REASONING and finish == "stop"  # the thinking as the model wrote it, unconstrained
    jsonschema.validate(json.loads(content), SCHEMA)
    off = _create(qwen3, extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **fields)
    assert off.choices[0].message.reasoning_content is None  # the prompt closed the thinking: constrained at once
    jsonschema.validate(json.loads(off.choices[0].message.content), SCHEMA)


def test_deepseek_r1_reads_an_output_without_the_opening_tag(tmp_path):
    proc = _serve(write_think_model(tmp_path / "model", DEEPSEEK_TEMPLATE), tmp_path / "log")
    try:
        assert "deepseek_r1 reasoning parser" in proc.log()
        (choice,) = _create(proc).choices
        assert (choice.message.reasoning_content, choice.message.content) == (REASONING, CONTENT)
        assert _streamed(proc) == (REASONING, CONTENT, "stop", [])
        # the prompt opened the thinking: a constraint waits for the </think> the model writes
        fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}, "max_tokens": 120}
        (choice,) = _create(proc, **fields).choices
        assert (choice.message.reasoning_content, choice.finish_reason) == (REASONING, "stop")
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    finally:
        proc.stop()


def test_flag_none_keeps_the_thinking_in_content(tmp_path):
    proc = _serve(write_think_model(tmp_path / "model"), tmp_path / "log", "--reasoning-parser", "none")
    try:
        (choice,) = _create(proc).choices
        assert choice.message.content == QWEN3_TEXT and getattr(choice.message, "reasoning_content", None) is None
        assert "Traceback" not in proc.log()
    finally:
        proc.stop()


def _needs_harmony() -> None:
    """Skip unless openai-harmony and its o200k vocabulary load here (.ci/run installs both)."""
    from jaxpaged.entrypoints.openai.reasoning import harmony_encoding

    pytest.importorskip("openai_harmony", reason="openai-harmony (the harmony extra) is not installed")
    try:
        harmony_encoding()
    except ValueError as exc:
        pytest.skip(f"openai-harmony cannot load its o200k vocabulary here (offline: no litellm copy, no TIKTOKEN_ENCODINGS_BASE): {exc}")


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    """The harmony model served with --reasoning-parser gpt_oss (the two tests below share it)."""
    _needs_harmony()
    proc = _serve(write_harmony_model(tmp_path_factory.mktemp("harmony")), tmp_path_factory.mktemp("harmony-server") / "log",
                  "--reasoning-parser", "gpt_oss")  # fmt: skip
    yield proc
    proc.stop()


def test_gpt_oss_harmony(harmony):
    proc = harmony
    (choice,) = _create(proc).choices
    assert (choice.message.reasoning_content, choice.message.content) == (HARMONY_REASONING, HARMONY_CONTENT)
    assert _streamed(proc) == (HARMONY_REASONING, HARMONY_CONTENT, "stop", [])


def test_gpt_oss_harmony_tool_calls(tmp_path):
    """Harmony calls (a commentary message `to=functions.add`) as tool_calls, read by openai-harmony: the parsers
    (gpt_oss, and openai for tool_choice "auto") detected from the chat template, the analysis as reasoning."""
    _needs_harmony()
    proc = _serve(write_harmony_model(tmp_path / "model", tools=True), tmp_path / "log")
    try:
        assert "reads calls with the openai parser" in proc.log() and "gpt_oss reasoning parser" in proc.log()
        (choice,) = _create(proc, tools=TOOLS).choices
        message = choice.message
        assert (message.reasoning_content, message.content, choice.finish_reason) == (HARMONY_REASONING, None, "tool_calls")
        assert [(c.type, c.function.name, c.function.arguments) for c in message.tool_calls] == [("function", *HARMONY_CALL)]
        reasoning, content, finish, calls = _streamed(proc, tools=TOOLS)
        assert (reasoning, content, finish) == (HARMONY_REASONING, None, "tool_calls")
        assert calls[0].id.startswith("call_") and calls[0].function.name == HARMONY_CALL[0]
        assert {c.index for c in calls} == {0} and all(c.id is None for c in calls[1:])
        assert "".join(c.function.arguments or "" for c in calls) == HARMONY_CALL[1]
        assert "Traceback" not in proc.log()
    finally:
        proc.stop()


def test_gpt_oss_the_output_constraint_starts_at_the_final_channel(harmony):
    """Harmony's thinking is the analysis channel: a response_format's grammar waits behind
    `<|channel|>final<|message|>`, so the analysis comes back as the model wrote it and only the final message
    follows the schema, whole and streamed (the openai client on the gpt_oss format, as qwen3's test above)."""
    proc = harmony
    fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}, "max_tokens": 120}
    (choice,) = _create(proc).choices  # unconstrained, the final message is not JSON: the grammar is what makes it so
    assert choice.message.content == HARMONY_CONTENT
    (choice,) = _create(proc, **fields).choices
    got = [(choice.message.reasoning_content, choice.message.content, choice.finish_reason), _streamed(proc, **fields)[:3]]
    for reasoning, content, finish in got:
        assert reasoning == HARMONY_REASONING and finish == "stop"
        jsonschema.validate(json.loads(content), SCHEMA)
    assert "Traceback" not in proc.log()


def test_an_unknown_parser_stops_the_start(tmp_path, capsys):
    """The server's main() in this process: the flag is refused as it is parsed, before anything else (a model that
    is not there, so a server that took the flag stops too, with another error, instead of serving)."""
    from jaxpaged.entrypoints import serve

    with pytest.raises(SystemExit) as stopped:
        serve.main(["--model", str(tmp_path / "nowhere"), "--reasoning-parser", "r1", "--port", "1", *ENGINE_ARGS])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "--reasoning-parser" in err and "qwen3" in err, err[-2000:]


def test_no_leak(qwen3):
    assert "Traceback" not in qwen3.log()
    m = qwen3.wait_metrics(lambda v: v["jaxpaged:kv_blocks_used"] == 0)
    assert m["jaxpaged:kv_blocks_used"] == 0 and m["jaxpaged:engine_alive"] == 1

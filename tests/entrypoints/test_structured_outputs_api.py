"""Structured outputs through the server: response_format, vLLM's structured_outputs and guided_* fields,
on both endpoints, streamed and not, through httpx and the openai client; bad constraints are 400s.

The cycle model writes its fixed byte cycle (greedy) or noise (sampled), so an output that parses is
the constraint's doing (tests/engine/test_structured_outputs.py covers the engine side).
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.conftest import CYCLE_MODEL
from tests.structured_cases import CHOICES, GRAMMAR, REGEX, SMALL_SCHEMA as SCHEMA

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "answer"}]

# (name, request fields, check of the text)
CASES = [
    ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ("structured_outputs.regex", {"structured_outputs": {"regex": REGEX}}, lambda t: _assert(re.fullmatch(REGEX, t), t)),
    ("structured_outputs.choice", {"structured_outputs": {"choice": CHOICES}}, lambda t: _assert(t in CHOICES, t)),
    ("guided_json", {"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ("guided_regex", {"guided_regex": REGEX}, lambda t: _assert(re.fullmatch(REGEX, t), t)),
    ("guided_choice", {"guided_choice": CHOICES}, lambda t: _assert(t in CHOICES, t)),
    ("guided_grammar", {"guided_grammar": GRAMMAR}, lambda t: _assert(re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", t), t)),
]


def _assert(ok, text):
    assert ok, text


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _body(path: str, fields: dict, **extra) -> dict:
    base = {"model": CYCLE_MODEL, "max_tokens": 200, "seed": 5, **extra, **fields}
    return {**base, "messages": USER} if path == CHAT else {**base, "prompt": "answer: "}


def _texts(path: str, r: httpx.Response) -> list[tuple[str, str]]:
    assert r.status_code == 200, r.text
    key = (lambda c: c["message"]["content"]) if path == CHAT else (lambda c: c["text"])
    return [(key(c), c["finish_reason"]) for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def _streamed(http: httpx.Client, path: str, body: dict) -> list[tuple[str, str]]:
    texts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for c in json.loads(line.removeprefix("data: "))["choices"]:
            piece = c["delta"].get("content") if path == CHAT else c["text"]
            texts.setdefault(c["index"], []).append(piece or "")
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    return [("".join(texts[i]), finish[i]) for i in sorted(texts)]


@pytest.mark.parametrize("path", [CHAT, C])
@pytest.mark.parametrize(("name", "fields", "check"), CASES, ids=[c[0] for c in CASES])
def test_constraint_greedy_and_sampled(http, path, name, fields, check):
    for temperature, n in ((0.0, 1), (1.0, 2)):
        for text, finish in _texts(path, http.post(path, json=_body(path, fields, temperature=temperature, n=n))):
            assert finish == "stop", (name, text)
            check(text)


@pytest.mark.parametrize("path", [CHAT, C])
@pytest.mark.parametrize(("name", "fields", "check"), [CASES[0], CASES[1]], ids=["json_schema", "regex"])
def test_streamed_equals_unstreamed(http, path, name, fields, check):
    body = _body(path, fields, temperature=1.0, n=2)
    plain = _texts(path, http.post(path, json=body))
    assert _streamed(http, path, body) == plain
    for text, _ in plain:
        check(text)


@pytest.mark.parametrize("path", [CHAT, C])
@pytest.mark.parametrize("stream", [False, True])
def test_json_object(http, path, stream):
    # any key is allowed, which a near-uniform model rarely closes: the samples that end in time must parse
    body = _body(path, {"response_format": {"type": "json_object"}}, temperature=1.0, n=6, max_tokens=48, seed=1)
    outs = _streamed(http, path, body) if stream else _texts(path, http.post(path, json=body))
    stopped = [text for text, finish in outs if finish == "stop"]
    assert stopped, outs
    for text in stopped:
        assert isinstance(json.loads(text), dict), text


def test_text_response_format_is_unconstrained(http):
    plain = _texts(CHAT, http.post(CHAT, json=_body(CHAT, {}, temperature=0, max_tokens=10)))
    text = _texts(CHAT, http.post(CHAT, json=_body(CHAT, {"response_format": {"type": "text"}}, temperature=0, max_tokens=10)))
    assert plain == text


def test_openai_client_response_format(client):
    r = client.chat.completions.create(
        model=CYCLE_MODEL, messages=USER, max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(
        model=CYCLE_MODEL, messages=USER, max_tokens=200, temperature=0, stream=True,
        extra_body={"structured_outputs": {"choice": CHOICES}},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in CHOICES


class Answer(pydantic.BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]
    count: int = pydantic.Field(ge=0, le=99)


def test_openai_client_parse_returns_the_pydantic_object(client):
    parse = client.chat.completions.parse if hasattr(client.chat.completions, "parse") else client.beta.chat.completions.parse
    r = parse(model=CYCLE_MODEL, messages=USER, max_tokens=200, temperature=0, response_format=Answer)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Answer) and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("path", [CHAT, C])
@pytest.mark.parametrize("stream", [False, True])
def test_json_object_with_a_schema_follows_it(http, path, stream):
    body = _body(path, {"response_format": {"type": "json_object", "schema": SCHEMA}}, temperature=1.0, n=2, seed=3)
    outs = _streamed(http, path, body) if stream else _texts(path, http.post(path, json=body))
    for text, finish in outs:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


class ClosedAnswer(Answer):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties false: this model would add keys forever


def test_instructor_json_schema_mode(server):
    """instructor's JSON_SCHEMA mode (1.17 sends response_format json_schema with the model's schema; older versions
    and other OpenAI-compatible clients send {"type": "json_object", "schema": ...}, tested above)."""
    import instructor

    client = instructor.from_openai(openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120),
                                    mode=instructor.Mode.JSON_SCHEMA)  # fmt: skip
    for temperature in (0.0, 1.0):
        answer = client.chat.completions.create(model=CYCLE_MODEL, messages=USER, response_model=ClosedAnswer, max_tokens=200,
                                                temperature=temperature, seed=4, max_retries=0)  # fmt: skip
        assert isinstance(answer, ClosedAnswer) and 0 <= answer.count <= 99


# instructor 1.6's JSON_SCHEMA mode, run in its own interpreter (the installed instructor is 1.17): the request's
# response_format, then the parsed answer, one JSON line each
_INSTRUCTOR_1_6 = """
import json, sys
from typing import Literal
import httpx, instructor, openai, pydantic
sent = []
class Recorded(httpx.HTTPTransport):
    # records response_format; drops the system message instructor adds (the schema again, in words), which the
    # test server's 512-token context cannot hold: what constrains the answer is response_format
    def handle_request(self, request):
        body = json.loads(request.content)
        sent.append(body.get("response_format"))
        body["messages"] = [m for m in body["messages"] if m["role"] != "system"]
        request = httpx.Request(request.method, request.url, headers={k: v for k, v in request.headers.items()
                                if k.lower() != "content-length"}, json=body)
        return super().handle_request(request)
class ClosedAnswer(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    ok: bool
    color: Literal["red", "green", "blue"]
    count: int = pydantic.Field(ge=0, le=99)
http = httpx.Client(transport=Recorded(), timeout=120)
client = instructor.from_openai(openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, http_client=http),
                                mode=instructor.Mode.JSON_SCHEMA)
for temperature in (0.0, 1.0):
    answer = client.chat.completions.create(model=sys.argv[2], messages=[{"role": "user", "content": "answer"}],
                                            response_model=ClosedAnswer, max_tokens=200, temperature=temperature, seed=4,
                                            max_retries=0)
    print(json.dumps({"instructor": instructor.__file__, "response_format": sent[-1], "answer": answer.model_dump()}))
"""


def test_instructor_1_6_json_schema_mode_sends_json_object_with_a_schema(server):
    """The form the issue names, from instructor itself: its JSON_SCHEMA mode sent {"type": "json_object", "schema": ...}
    until 1.7 (1.17 sends json_schema: the test above). .ci/run installs instructor 1.6.4 apart and names its folder."""
    import os
    import subprocess
    import sys

    folder = os.environ.get("JAXPAGED_TEST_INSTRUCTOR_1_6")
    if not folder:
        pytest.skip("JAXPAGED_TEST_INSTRUCTOR_1_6 names a folder holding instructor==1.6.4 (pip install --no-deps --target); .ci/run sets it")
    env = {**os.environ, "PYTHONPATH": folder}
    out = subprocess.run([sys.executable, "-c", _INSTRUCTOR_1_6, f"{server.url}/v1", CYCLE_MODEL], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(runs) == 2 and all(r["instructor"].startswith(folder) for r in runs)
    for run in runs:
        assert run["response_format"]["type"] == "json_object"
        assert run["response_format"]["schema"] == ClosedAnswer.model_json_schema()
        assert ClosedAnswer(**run["answer"]).count <= 99


def _schema_rf(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


# (path, request fields, the param the 400 must name)
BAD = [
    (CHAT, {"response_format": _schema_rf({"type": "not-a-type"})}, "response_format.json_schema.schema"),
    (C, {"response_format": _schema_rf({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})},
     "response_format.json_schema.schema"),
    (CHAT, {"response_format": _schema_rf("{}")}, "response_format.json_schema.schema"),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format.type"),
    (CHAT, {"response_format": {"type": "json_object", "schema": "{}"}}, "response_format.schema"),
    (C, {"response_format": {"type": "json_object", "schema": {"type": "not-a-type"}}}, "response_format.schema"),
    (C, {"response_format": "json"}, "response_format"),
    (CHAT, {"guided_regex": "(ab"}, "guided_regex"),
    (C, {"guided_regex": "(ab"}, "guided_regex"),
    (C, {"guided_json": {"type": "not-a-type"}}, "guided_json"),
    (CHAT, {"guided_json": "{not json"}, "guided_json"),
    (C, {"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    (CHAT, {"guided_choice": []}, "guided_choice"),
    (CHAT, {"guided_choice": "yes"}, "guided_choice"),
    (CHAT, {"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    (C, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    (C, {"structured_outputs": {}}, "structured_outputs"),
    (CHAT, {"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    (C, {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.regex"),
    (CHAT, {"structured_outputs": ["regex"]}, "structured_outputs"),
    (CHAT, {"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    (C, {"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
]


@pytest.mark.parametrize(("path", "fields", "param"), BAD, ids=[f"{i}-{p[4:]}-{f}" for i, (p, _, f) in enumerate(BAD)])
def test_bad_constraint_is_400_naming_the_field(http, server, path, fields, param):
    r = http.post(path, json=_body(path, fields, max_tokens=5, n=2))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["message"].startswith(param), err
    ok = http.post(path, json=_body(path, {}, max_tokens=3, temperature=0))  # still serving
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path", [C, CHAT])
def test_vllm_json_options_and_logprobs_under_a_constraint(http, path):
    """vLLM's JSON options pass through; logprobs come from the masked distribution, and a forbidden token in the
    top list reports -9999.0 (JSON has no -inf), as vLLM's server does."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    so = {"json": schema, "disable_additional_properties": True, "disable_fallback": True}
    logprobs = {"logprobs": 5} if path == C else {"logprobs": True, "top_logprobs": 5}
    r = http.post(path, json=_body(path, {"structured_outputs": so}, max_tokens=60, temperature=1.0, seed=2, **logprobs))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["text"] if path == C else choice["message"]["content"]
    assert set(json.loads(text)) == {"a"}
    if path == C:
        first = choice["logprobs"]["top_logprobs"][0]  # the first token can only be "{"
        assert first["{"] == pytest.approx(0.0, abs=1e-5) and sorted(first.values())[0] == -9999.0
    else:
        first = choice["logprobs"]["content"][0]
        assert first["token"] == "{" and first["logprob"] == pytest.approx(0.0, abs=1e-5)
        assert [t["logprob"] for t in first["top_logprobs"]][1:] == [-9999.0] * 4


def test_no_leak_after_constrained_and_refused_requests(server):
    assert "Traceback" not in server.log()
    m = server.wait_metrics(lambda v: v["jaxpaged:kv_blocks_used"] == 0)
    assert m["jaxpaged:kv_blocks_used"] == 0 and m["jaxpaged:num_requests_waiting"] == 0 and m["jaxpaged:engine_alive"] == 1


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: called with {}
]


def _check_call(call) -> None:
    args = json.loads(call["function"]["arguments"])
    assert call["type"] == "function" and call["id"].startswith("call_")
    if call["function"]["name"] == "weather":
        jsonschema.validate(args, WEATHER)
    else:
        assert call["function"]["name"] == "now" and args == {}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "weather"}}], ids=["required", "named"])
def test_tool_choice_constrains_and_returns_tool_calls(http, tool_choice):
    body = _body(CHAT, {"tools": TOOLS, "tool_choice": tool_choice}, temperature=1.0, n=3, max_tokens=300)
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    plain = []
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        message = choice["message"]
        assert message["content"] is None and message["tool_calls"]
        assert len({c["id"] for c in message["tool_calls"]}) == len(message["tool_calls"])
        for call in message["tool_calls"]:
            _check_call(call)
        if tool_choice != "required":
            assert [c["function"]["name"] for c in message["tool_calls"]] == ["weather"]
        plain.append([c["function"] for c in message["tool_calls"]])
    streamed: dict[int, dict[int, dict]] = {}  # choice -> call index -> its name and arguments, put together
    pieces = 0
    with http.stream("POST", CHAT, json={**body, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line]
    for line in lines[:-1]:
        for c in json.loads(line.removeprefix("data: "))["choices"]:
            assert not c["delta"].get("content")
            for piece in c["delta"].get("tool_calls") or ():
                calls = streamed.setdefault(c["index"], {})
                if "id" in piece:  # a call opens with its id and name, then its arguments come in pieces
                    assert piece["function"]["arguments"] == "" and piece["type"] == "function"
                    calls[piece["index"]] = {"name": piece["function"]["name"], "arguments": ""}
                else:
                    calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
                    pieces += 1
            if c["finish_reason"]:
                assert c["finish_reason"] == "tool_calls"
    assert [[streamed[i][k] for k in sorted(streamed[i])] for i in range(3)] == plain  # same seed: the same calls
    assert pieces > sum(len(p) for p in plain)  # sent as they were written, not at the end


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_cut_short_keeps_its_partial_arguments(http, stream):
    body = _body(CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "weather"}}},
                 temperature=1.0, max_tokens=6)  # fmt: skip
    r = http.post(CHAT, json=body)
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    ((name, arguments),) = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert name == "weather" and arguments.startswith("{") and r.json()["usage"]["completion_tokens"] == 6
    if stream:  # the same seed: the same pieces, and the same end
        with http.stream("POST", CHAT, json={**body, "stream": True}) as s:
            chunks = [json.loads(line.removeprefix("data: ")) for line in s.iter_lines() if line and line != "data: [DONE]"]
        pieces = [t["function"]["arguments"] for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or ()]
        assert "".join(pieces) == arguments and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_tool_choice_none_ignores_tools(http):
    base = _body(CHAT, {}, temperature=0, max_tokens=10)
    with_tools = _texts(CHAT, http.post(CHAT, json={**base, "tools": TOOLS, "tool_choice": "none"}))
    assert with_tools == _texts(CHAT, http.post(CHAT, json=base))


def test_openai_client_tool_calls(client):
    r = client.chat.completions.create(model=CYCLE_MODEL, messages=USER, max_tokens=300, temperature=0, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "weather"}})  # fmt: skip
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "weather"
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), WEATHER)


BAD_TOOLS = [
    ({"tools": TOOLS}, "tool_choice"),  # "auto", the default with tools
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),  # this model's template shows no call format
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "tool_choice": "required"},
     "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_TOOLS, ids=[str(i) for i in range(len(BAD_TOOLS))])
def test_bad_tools_are_400(http, fields, param):
    r = http.post(CHAT, json=_body(CHAT, fields, max_tokens=5))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    if fields.get("tools") and fields.get("tool_choice", "auto") == "auto":
        assert "--tool-call-parser" in r.json()["error"]["message"]
    ok = http.post(CHAT, json=_body(CHAT, {}, max_tokens=3, temperature=0))
    assert ok.status_code == 200


def test_no_leak_at_the_end(server):
    test_no_leak_after_constrained_and_refused_requests(server)

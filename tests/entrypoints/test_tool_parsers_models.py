"""The tool-call readers for newer model families (qwen3_coder, deepseek_v3, deepseek_v31, kimi_k2, mistral,
pythonic) on model outputs in their formats: whole, streamed one character at a time and in random pieces, which
must all agree; text before calls, several calls, calls cut short and malformed blocks kept as content."""

from __future__ import annotations

import json
import random

import pytest

from jaxpaged.entrypoints.openai.tool_parsers import tool_reader
from jaxpaged.entrypoints.openai.tool_parsers_xml import convert

TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"}, "temp": {"type": "number"},
        "opts": {"type": "object"}, "tags": {"type": "array"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "zip": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "now"}},
]  # fmt: skip


def _qc(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


W_ARGS = '{"city": "Oslo", "days": 3}'
# (parser, output, content, [(name, arguments)])
CASES = [
    ("qwen3_coder", "Let me check.\n\n" + _qc("weather", city="Oslo", days="3") + "\n" + _qc("now"), "Let me check.",
     [("weather", W_ARGS), ("now", "{}")]),
    ("qwen3_coder", _qc("weather", city="Oslo", days="3"), None, [("weather", W_ARGS)]),
    # types from the schema: strings stay strings, the rest parsed; a value that does not read stays a string
    ("qwen3_coder", _qc("weather", city="42", days="x", hot="True", temp="2.0", opts='{"a": [1]}', tags="['a', 'b']"),
     None, [("weather", '{"city": "42", "days": "x", "hot": true, "temp": 2, "opts": {"a": [1]}, "tags": ["a", "b"]}')]),
    ("qwen3_coder", _qc("weather", note="null", zip="None", city="null", days="null", other="7"), None,
     [("weather", '{"note": null, "zip": null, "city": "null", "days": null, "other": "7"}')]),
    ("qwen3_coder", _qc("now", x="1", y="{1, 2}"), None, [("now", '{"x": "1", "y": "{1, 2}"}')]),  # no schema: text
    # a value that spans lines and holds the tags themselves (only a </parameter> followed by a tag closes it)
    ("qwen3_coder", _qc("weather", city='a\n</parameter> not yet\n"q"\\n<function=x>'), None,
     [("weather", json.dumps({"city": 'a\n</parameter> not yet\n"q"\\n<function=x>'}))]),
    # text after the calls, a bare <function=...> without <tool_call>, a missing </parameter>
    ("qwen3_coder", "A\n" + _qc("now") + "\nB", "A\nB", [("now", "{}")]),
    ("qwen3_coder", "<function=now>\n</function>\nok", "ok", [("now", "{}")]),
    ("qwen3_coder", "<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n<parameter=days>\n3\n</parameter>\n"
     "</function>\n</tool_call>", None, [("weather", W_ARGS)]),
    # cut short: before the name is whole it is text; after, the call keeps what it has and is closed
    ("qwen3_coder", "Hm <tool_call>\n<function=weat", "Hm <tool_call>\n<function=weat", []),
    ("qwen3_coder", "<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</para",
     None, [("weather", W_ARGS)]),
    ("qwen3_coder", "<tool_call>\n<function=weather>\n<parameter=city>\nOs", None, [("weather", '{"city": "Os"}')]),
    ("qwen3_coder", "<tool_call>\n<function=weather>\n<param", None, [("weather", "{}")]),
    # malformed: no function, or a name that is not one, stays content as written
    ("qwen3_coder", "x <tool_call>not xml</tool_call> y", "x <tool_call>not xml</tool_call> y", []),
    ("qwen3_coder", "<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>\n" + _qc("now"),
     "<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>", [("now", "{}")]),
    ("qwen3_coder", "Plain answer.\n", "Plain answer.\n", []),
    ("qwen3_coder", "", None, []),
]
B, E, CB, SEP, CE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def _v3(name: str, args: str) -> str:
    return f"{CB}function{SEP}{name}\n```json\n{args}\n```{CE}"


def _kimi(name: str, idx: int, args: str) -> str:
    return f"<|tool_call_begin|>functions.{name}:{idx}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


KB, KE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CASES += [
    ("deepseek_v3", f"Let me check.{B}{_v3('weather', W_ARGS)}\n{_v3('now', '{}')}{E}", "Let me check.",
     [("weather", W_ARGS), ("now", "{}")]),
    ("deepseek_v3", B + _v3("weather", '{"s": "```"}') + E + "\nDone.", "Done.", [("weather", '{"s": "```"}')]),
    ("deepseek_v3", f"{B}{CB}function{SEP}weather\n```json\n{{\"city\": \"Os", None, [("weather", '{"city": "Os')]),
    ("deepseek_v3", f"{B}{CB}function{SEP}weather\n```json\n{{}}\n``", None, [("weather", "{}")]),
    ("deepseek_v3", f"A {B}{CB}function{SEP}wea", f"A {B}{CB}function{SEP}wea", []),
    ("deepseek_v3", f"{B}oops{E} after", f"{B}oops{E} after", []),
    ("deepseek_v3", f"{B}{CB}weather{SEP}{{}}{CE}{E}", f"{B}{CB}weather{SEP}{{}}{CE}{E}", []),  # V3.1's shape: not V3's
    ("deepseek_v31", f"Checking.\n\n{B}{CB}weather{SEP}{W_ARGS}{CE}{CB}now{SEP}{{}}{CE}{E}", "Checking.",
     [("weather", W_ARGS), ("now", "{}")]),
    ("deepseek_v31", f"{B}{CB}weather{SEP}{{\"city\": \"<｜tool", None, [("weather", '{"city": "')]),
    ("deepseek_v31", "No calls <｜tool", "No calls <｜tool", []),
    ("kimi_k2", f"Sure.{KB}{_kimi('weather', 0, W_ARGS)}{_kimi('now', 1, ' {} ')}{KE}", "Sure.",
     [("weather", W_ARGS), ("now", "{}")]),
    ("kimi_k2", f"<|tool_call_section_begin|> {_kimi('now', 0, '{}')} <|tool_call_section_end|>ok", "ok", [("now", "{}")]),
    ("kimi_k2", KB + '<|tool_call_begin|>functions.weather:0<|tool_call_argument_begin|>{"a": 1} ', None,
     [("weather", '{"a": 1}')]),
    ("kimi_k2", f"{KB}<|tool_call_begin|>weather<|tool_call_argument_begin|>{{}}<|tool_call_end|>{KE}",
     f"{KB}<|tool_call_begin|>weather<|tool_call_argument_begin|>{{}}<|tool_call_end|>{KE}", []),  # no :IDX
    # Mistral: the pre-v11 array, v11's NAME{...} and the newer NAME[ARGS]{...}, one per [TOOL_CALLS]
    ("mistral", f'Checking. [TOOL_CALLS] [{{"name": "weather", "arguments": {W_ARGS}}}, {{"name": "now", "arguments": {{}}}}]',
     "Checking.", [("weather", W_ARGS), ("now", "{}")]),
    ("mistral", f"[TOOL_CALLS]weather{W_ARGS}[TOOL_CALLS]now{{}}", None, [("weather", W_ARGS), ("now", "{}")]),
    ("mistral", f"Sure.\n[TOOL_CALLS]weather[ARGS]{W_ARGS}[TOOL_CALLS]now[ARGS]{{}}\nDone.", "Sure.\nDone.",
     [("weather", W_ARGS), ("now", "{}")]),
    ("mistral", '[TOOL_CALLS]weather[ARGS]{"city": "[TOOL_CALLS]}', None, [("weather", '{"city": "[TOOL_CALLS]}')]),
    ("mistral", "[TOOL_CALLS]weat", "[TOOL_CALLS]weat", []),
    ("mistral", "[TOOL_CALLS]weather[ARGS]", "[TOOL_CALLS]weather[ARGS]", []),
    ("mistral", "I can't [TOOL_CALLS] that.", "I can't [TOOL_CALLS] that.", []),
    ("mistral", '[TOOL_CALLS] [{"name": 1}]', '[TOOL_CALLS] [{"name": 1}]', []),
    ("mistral", "No calls [TOOL_", "No calls [TOOL_", []),
    # pythonic: a list of calls, keyword literals to JSON; text first, or no list, is content
    ("pythonic", '[weather(city="Oslo", days=3), now()]', None, [("weather", W_ARGS), ("now", "{}")]),
    ("pythonic", "<|python_start|>[weather(city='a\\'(]', days=-3.5, tags=[1, None, True], opts={'k': (1, 2)})]<|python_end|>",
     None, [("weather", '{"city": "a\'(]", "days": -3.5, "tags": [1, null, true], "opts": {"k": [1, 2]}}')]),
    ("pythonic", '[weather(city="Oslo", days=3), now(x=__import__("os"))]', 'now(x=__import__("os"))]',
     [("weather", W_ARGS)]),
    ("pythonic", '[weather(city="Oslo", days=3), now()]\nDone.', "Done.", [("weather", W_ARGS), ("now", "{}")]),
    ("pythonic", 'Let me check: [now()]', 'Let me check: [now()]', []),
    ("pythonic", '[1, 2, 3]', '[1, 2, 3]', []),
    ("pythonic", '[weather("Oslo")]', '[weather("Oslo")]', []),
    ("pythonic", '[weather(city="Oslo", days=3, tags=[1, ', None, [("weather", W_ARGS[:-1] + ', "tags": [1]}')]),
    ("pythonic", '[weather(city="Os', None, [("weather", '{"city": "Os"}')]),
    ("pythonic", "[weat", "[weat", []),
]


def _replay(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    """What a client makes of the stream: content joined, each call's opening then its arguments' pieces."""
    content, calls = "", {}
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        content += d.get("content", "")
        for piece in d.get("tool_calls", ()):
            if "id" in piece:  # a call's first chunk: its id, type and whole name, no arguments yet
                assert piece["index"] not in calls and piece["type"] == "function"
                assert piece["function"]["arguments"] == ""
                calls[piece["index"]] = [piece["function"]["name"], "", piece["id"]]
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}, piece
                assert piece["function"]["arguments"]
                calls[piece["index"]][1] += piece["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [tuple(calls[k][:2]) for k in sorted(calls)], [calls[k][2] for k in sorted(calls)]


def _stream(parser, text, cuts):
    reader, deltas = tool_reader("auto", parser, TOOLS), []
    for cut in cuts:
        deltas += reader.feed(text[:cut])
    deltas += reader.feed(text) + reader.finish()
    content, calls, ids = _replay(deltas)
    assert (content, calls, ids) == (reader.content, [(c.name, c.arguments) for c in reader.calls], [c.id for c in reader.calls])
    return content, calls


def check(parser, text, content, calls):
    """The whole parse, then the same text streamed a character at a time and in 20 random cuts."""
    reader = tool_reader("auto", parser, TOOLS)
    got_content, got_calls = reader.parse(text)
    assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls)
    for _, arguments in calls if parser in ("qwen3_coder", "pythonic") else ():  # JSON these readers wrote
        assert isinstance(json.loads(arguments), dict)
    assert _stream(parser, text, range(len(text) + 1)) == (content, calls)
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        assert _stream(parser, text, cuts) == (content, calls)
    return got_calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_and_streamed_in_any_pieces_agree(parser, text, content, calls):
    got = check(parser, text, content, calls)
    if parser == "kimi_k2":  # vLLM returns Kimi's own id, which its template writes back
        assert [c.id for c in got] == [f"functions.{name}:{i}" for i, (name, _) in enumerate(calls)]
    elif parser == "mistral":  # Mistral refuses ids that are not 9 alphanumeric characters
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got) and len({c.id for c in got}) == len(got)
    else:
        assert all(c.id.startswith("call_") for c in got)


def test_qwen3_coder_streams_each_parameter_as_it_closes():
    text = "<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    reader, pieces, end = tool_reader("auto", "qwen3_coder", TOOLS), [], 0
    for mark in ("<function=weather>", "Oslo\n</parameter>\n<", "parameter=", "3\n</parameter>", "</function>"):
        end = text.index(mark, end) + len(mark)  # each mark after the last
        pieces.append([p["tool_calls"][0]["function"]["arguments"] for p in reader.feed(text[:end])])
    assert pieces == [["", "{"], [], ['"city": "Oslo"'], [], [', "days": 3', "}"]]  # a "<" may open any tag


@pytest.mark.parametrize(("value", "schema", "want"), [
    ("7", {"type": "integer"}, 7), ("7.5", {"type": "number"}, 7.5), ("1e999", {"type": "number"}, "1e999"),
    ("nan", {"type": "number"}, "nan"), ("FALSE", {"type": "boolean"}, False), ("yes", {"type": "boolean"}, False),
    ("[1, 2]", {"type": "array"}, [1, 2]), ('"{\'a\': 1}"', {"type": "object"}, {"a": 1}),
    ("__import__('os')", {"type": "object"}, "__import__('os')"), ("None", {"type": "string"}, "None"),
    ("x", {}, "x"), ("3", {"type": "custom"}, 3),
])  # fmt: skip
def test_values_convert_as_their_schema_types(value, schema, want):
    assert convert(value, "k", {"k": schema}) == want


DEEPSEEK_V3 = ("{%- for tool in message['tool_calls'] %}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
               "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + "
               "'\\n' + '```' + '<｜tool▁call▁end｜>'}}")  # fmt: skip
DEEPSEEK_V31 = ("'IMPORTANT: ALWAYS adhere to this exact format for tool use:\\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
                "tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>")
KIMI_K2 = ("{{render_content(message)}}<|tool_calls_section_begin|>{%- for tool_call in message['tool_calls'] -%}"
           "<|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{{ tool_call['function']['arguments'] }}")
QWEN3_CODER = ("If you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n"
               "<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>")
MISTRAL = ('{%- elif message["role"] == "assistant" %}{%- if message.tool_calls is defined %}{{- "[TOOL_CALLS]" }}'
           '{%- for tool in message.tool_calls %}{{- tool["function"]["name"] + "[ARGS]" + arguments }}')
PYTHONIC = ("- Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]\\nExamples:\\nCORRECT: "
            "[get_weather(location=\\\"Vancouver\\\")")


@pytest.mark.parametrize(("template", "parser"), [
    (DEEPSEEK_V3, "deepseek_v3"), (DEEPSEEK_V31, "deepseek_v31"), (KIMI_K2, "kimi_k2"), (QWEN3_CODER, "qwen3_coder"),
    (MISTRAL, "mistral"), (PYTHONIC, "pythonic"),
])  # fmt: skip
def test_the_template_names_its_parser(template, parser):
    from jaxpaged.entrypoints.openai.tool_parsers import detect_parser

    assert detect_parser(template) == parser

"""The tool-call readers (jaxpaged/entrypoints/openai/tool_parsers.py) on model outputs: whole, streamed one
character at a time and in random pieces, which must all agree; and the parser a chat template asks for."""

from __future__ import annotations

import random

import pytest

from jaxpaged.entrypoints.openai.tool_parsers import PARSERS, ToolCall, detect_parser, tool_reader
from jaxpaged.entrypoints.serve import TOOL_CALL_PARSERS

W = '{"name": "weather", "arguments": {"city": "Oslo", "days": 3}}'

# (mode, parser, output, content, [(name, arguments)])
CASES = [
    # Hermes (Qwen2.5): text before the calls is content, the calls' arguments as written
    ("auto", "hermes", f"Let me check.\n\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n"
     '{"name": "now", "arguments": {}}\n</tool_call>', "Let me check.",
     [("weather", '{"city": "Oslo", "days": 3}'), ("now", "{}")]),
    ("auto", "hermes", f"<tool_call>\n{W}\n</tool_call>", None, [("weather", '{"city": "Oslo", "days": 3}')]),
    ("auto", "hermes", f"A\n<tool_call>{W}</tool_call>\nB\n", "A\nB\n", [("weather", '{"city": "Oslo", "days": 3}')]),
    ("auto", "hermes", "Plain answer, no call.\n\n", "Plain answer, no call.\n\n", []),
    ("auto", "hermes", "", None, []),
    # braces, tags and escaped quotes inside strings; keys in the other order; no closing tag
    ("auto", "hermes", '<tool_call>{"name": "f", "arguments": {"s": "}]\\" </tool_call> {"}}</tool_call>', None,
     [("f", '{"s": "}]\\" </tool_call> {"}')]),
    ("auto", "hermes", '<tool_call>{"arguments": {"a": [1, {"b": null}]}, "name": "f"}', None, [("f", '{"a": [1, {"b": null}]}')]),
    # malformed: not a call object, so the block is content as written
    ("auto", "hermes", "x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),
    ("auto", "hermes", '<tool_call>{"name": 5, "arguments": {}}</tool_call>', '<tool_call>{"name": 5, "arguments": {}}</tool_call>', []),
    ("auto", "hermes", '<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
    ("auto", "hermes", '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', []),
    ("auto", "hermes", f'<tool_call>[1, 2]</tool_call>\n<tool_call>{W}</tool_call>', "<tool_call>[1, 2]</tool_call>",
     [("weather", '{"city": "Oslo", "days": 3}')]),
    # cut short: before the call began it is text; after, the call keeps what it has
    ("auto", "hermes", 'Hm <tool_call>\n{"name": "f", "argu', 'Hm <tool_call>\n{"name": "f", "argu', []),
    ("auto", "hermes", 'Hm <tool_', "Hm <tool_", []),
    ("auto", "hermes", '<tool_call>{"name": "f", "arguments": {"a": "x', None, [("f", '{"a": "x')]),
    ("auto", "hermes", '<tool_call>{"name": "f", "arguments": {"a": 1]}}</tool_call> ok', "ok", [("f", '{"a": 1')]),
    # Llama 3.1 JSON: with or without <|python_tag|>, several separated by ";", "parameters" or "arguments"
    ("auto", "llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", '{"x": 1}'), ("g", "{}")]),
    ("auto", "llama3_json", ' {"name": "f", "arguments": {"x": "a;b"}}\n\nDone.', "Done.", [("f", '{"x": "a;b"}')]),
    ("auto", "llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("auto", "llama3_json", '{"name": "f", "parameters": {"x": 1}; oops', "oops", [("f", '{"x": 1}')]),
    ("auto", "llama3_json", "It is sunny; {\"name\": \"f\"}", 'It is sunny; {"name": "f"}', []),
    ("auto", "llama3_json", "<|python", "<|python", []),
    # "required": vLLM's array of {"name", "parameters"}; a named function: the output is its arguments
    ("required", None, '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]', None,
     [("f", '{"x": 1}'), ("g", "{}")]),
    ("required", None, '[{"name": "f", "parameters": {"x": ', None, [("f", '{"x": ')]),
    ("required", None, "oops", "oops", []),
    ("weather", None, ' {"city": "Oslo"}\n ', None, [("weather", '{"city": "Oslo"}')]),
    ("weather", None, "", None, [("weather", "")]),
]


def _replay(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    """What a client makes of the stream: content joined, each call's opening then its arguments' pieces."""
    content, calls = "", {}
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        content += d.get("content", "")
        for piece in d.get("tool_calls", ()):
            if "id" in piece:  # a call's first chunk: its id, type and whole name, no arguments yet
                assert piece["index"] not in calls and piece["type"] == "function" and piece["id"].startswith("call_")
                assert piece["function"]["arguments"] == ""
                calls[piece["index"]] = [piece["function"]["name"], ""]
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}, piece
                assert piece["function"]["arguments"]
                calls[piece["index"]][1] += piece["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [tuple(calls[k]) for k in sorted(calls)]


def _stream(mode, parser, text, cuts) -> tuple[str | None, list[tuple[str, str]]]:
    reader, deltas = tool_reader(mode, parser), []
    for cut in cuts:
        deltas += reader.feed(text[:cut])
    deltas += reader.feed(text) + reader.finish()
    got = _replay(deltas)
    assert got == (reader.content, [(c.name, c.arguments) for c in reader.calls])
    return got


@pytest.mark.parametrize(("mode", "parser", "text", "content", "calls"), CASES, ids=[str(i) for i in range(len(CASES))])
def test_whole_and_streamed_in_any_pieces_agree(mode, parser, text, content, calls):
    got_content, got_calls = tool_reader(mode, parser).parse(text)
    assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls)
    assert _stream(mode, parser, text, range(len(text) + 1)) == (content, calls)  # one character at a time
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        assert _stream(mode, parser, text, cuts) == (content, calls)


def test_content_streams_before_the_call_and_holds_back_only_a_possible_tag():
    reader = tool_reader("auto", "hermes")
    assert reader.feed("Let me") == [{"content": "Let me"}]
    assert reader.feed("Let me check <") == [{"content": " check"}]  # " <" may open a call
    assert reader.feed("Let me check <b>") == [{"content": " <b>"}]
    assert reader.feed("Let me check <b> <tool_ca") == []
    assert reader.feed("Let me check <b> <tool_call>\n{\"name\": \"f\", ") == []
    opening, args = reader.feed('Let me check <b> <tool_call>\n{"name": "f", "arguments": {"a"')
    assert opening["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}  # the space before the tag went
    assert args == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    assert reader.feed('Let me check <b> <tool_call>\n{"name": "f", "arguments": {"a": 1}}</tool_call>\n') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]
    assert reader.finish() == [] and reader.content == "Let me check <b>"


def test_arguments_stream_token_by_token():
    tokens = ["<tool_call>\n", '{"name": "weather", ', '"arguments": {', '"city": ', '"Oslo"', "}}\n", "</tool_call>"]
    reader, text, pieces = tool_reader("auto", "hermes"), "", []
    for token in tokens:
        text += token
        pieces.append(reader.feed(text))
    pieces.append(reader.finish())
    assert pieces[:2] == [[], []]
    assert pieces[2][0]["tool_calls"][0]["function"] == {"name": "weather", "arguments": ""}
    args = [[p["tool_calls"][0]["function"]["arguments"] for p in step if "id" not in p["tool_calls"][0]] for step in pieces]
    assert args[2:] == [["{"], ['"city": '], ['"Oslo"'], ["}"], [], []]


def test_ids_are_unique():
    assert len({ToolCall("f").id for _ in range(1000)}) == 1000


QWEN25 = ("{%- if tools %}{{- '<|im_start|>system\\n' }}...# Tools\\n\\nYou may call one or more functions to assist "
          "with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
          "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}{{- \"\\n</tools>\\n\\nFor each function "
          "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n"
          "<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}")
LLAMA31 = ("{%- if tools is not none and not tools_in_user_message %}{{- 'Given the following functions, please respond "
           "with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n' }}"
           "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
           "value}.' }}...{%- if builtin_tools is defined and tool_call.name in builtin_tools %}{{- '<|python_tag|>' "
           "+ tool_call.name + '.call(' }}")  # fmt: skip


@pytest.mark.parametrize(
    ("template", "parser"),
    [(QWEN25, "hermes"), (LLAMA31, "llama3_json"), ("<|python_tag|>", "llama3_json"),
     ("<|start_header_id|>...Respond in the format {\"name\": function name, \"parameters\": ...}", "llama3_json"),
     ('{{ "[AVAILABLE_TOOLS]" }}{"type": "function", "function": {"name": ..., "parameters": ...}}', None),
     ("{% for m in messages %}{{ m['content'] }}{% endfor %}", None), (None, None), ("", None),
     ({"default": "{{ messages }}", "tool_use": QWEN25}, "hermes")],
)  # fmt: skip
def test_the_template_names_its_parser(template, parser):
    assert detect_parser(template) == parser


def test_the_command_line_offers_every_parser():
    assert TOOL_CALL_PARSERS == PARSERS

"""Tool calls read from a chat model's output, whole or streamed, in the format of its own chat template
(vLLM's `--tool-call-parser`): Hermes-style `<tool_call>` JSON (Qwen2.5, Hermes) and Llama 3.1's JSON calls for
tool_choice "auto", plus the grammar-shaped outputs of "required" (a JSON array) and a named function. gpt-oss's
harmony calls (`openai`, vLLM's name: a commentary message `to=functions.NAME`) are read by openai-harmony, in the
gpt_oss reasoning parser's reader (reasoning.HarmonyReader), not here. Newer families' formats have their own
modules on the same reader: tool_parsers_xml (qwen3_coder), tool_parsers_marked (deepseek_v3, deepseek_v31,
kimi_k2), tool_parsers_mistral (mistral) and tool_parsers_pythonic (pythonic).

Each format is one reader of the choice's cumulative text that returns OpenAI deltas as it goes; the whole-text
parse is the same reader fed the text at once, so a stream and a plain response always agree. A stream cannot
take back a call it began, so a call begins (and stays a call) once `{"name": "...", "arguments": {` has been
read; anything that is not such an object stays content. `arguments` is the object as the model wrote it.
"""

from __future__ import annotations

import dataclasses
import json
import uuid

PARSERS = ("hermes", "llama3_json", "openai", "qwen3_coder", "deepseek_v3", "deepseek_v31", "kimi_k2", "mistral",
           "pythonic")
# parsers whose markers are special tokens: their requests keep special tokens in the text
SPECIAL_MARKERS = ("deepseek_v3", "deepseek_v31", "kimi_k2", "mistral")
ARG_KEYS = ("arguments", "parameters")  # Llama 3.1's template and vLLM's "required" array say "parameters"
_WS = " \t\r\n"


def detect_parser(chat_template) -> str | None:
    """The parser a chat template's tool-call format needs, or None when it shows none (no tool support)."""
    if isinstance(chat_template, dict):  # named templates ({"default": ..., "tool_use": ...})
        chat_template = "\n".join(t for t in chat_template.values() if isinstance(t, str))
    if not chat_template:
        return None
    if "<｜tool▁calls▁begin｜>" in chat_template:  # DeepSeek: V3/R1-0528 wrap the arguments in ```json, V3.1 not
        return "deepseek_v3" if "```json" in chat_template else "deepseek_v31"
    if "<|tool_calls_section_begin|>" in chat_template or "<|tool_call_section_begin|>" in chat_template:
        return "kimi_k2"
    if "[TOOL_CALLS]" in chat_template:  # Mistral's
        return "mistral"
    if "[func_name1(" in chat_template:  # vLLM's pythonic templates (Llama 3.2, Llama 4) show the list of calls
        return "pythonic"
    if "<function=" in chat_template and "<parameter=" in chat_template:  # Qwen3-Coder's, Qwen3.5's XML calls
        return "qwen3_coder"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|channel|>" in chat_template and "<|message|>" in chat_template:  # gpt-oss's harmony
        return "openai"
    llama3 = "<|start_header_id|>" in chat_template and '"parameters"' in chat_template  # its tool instructions
    if "<|python_tag|>" in chat_template or llama3:
        return "llama3_json"
    return None


def tool_reader(mode: str, parser: str | None = None, tools: list[dict] | None = None) -> ToolCallReader:
    """The reader for a tool mode: "auto" (with the parser's format), "required", or a function's name. `tools`
    (the request's) give qwen3_coder its parameters' types."""
    if mode == "auto":
        if parser == "qwen3_coder":
            from jaxpaged.entrypoints.openai.tool_parsers_xml import Qwen3CoderReader

            return Qwen3CoderReader(tools)
        if parser in ("deepseek_v3", "deepseek_v31", "kimi_k2"):
            from jaxpaged.entrypoints.openai.tool_parsers_marked import MarkedCallsReader

            return MarkedCallsReader(parser)
        if parser == "mistral":
            from jaxpaged.entrypoints.openai.tool_parsers_mistral import MistralReader

            return MistralReader()
        if parser == "pythonic":
            from jaxpaged.entrypoints.openai.tool_parsers_pythonic import PythonicReader

            return PythonicReader()
        return HermesReader() if parser == "hermes" else JsonCallsReader(prefix="<|python_tag|>", sep=";")
    if mode == "required":
        return JsonCallsReader(prefix="[", sep=",", end="]")
    return NamedReader(mode)


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str = ""  # the arguments object as the model wrote it (cut short if the output was)
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class _Bad(Exception):
    def __init__(self, at: int):
        self.at = at


def _ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _value_end(s: str, i: int) -> int | None:
    """Index just past the JSON value at s[i], None when s ends inside it; _Bad where its shape breaks. Strings and
    brackets are all that is checked: the client judges the JSON inside."""
    n = len(s)
    if s[i] not in '"{[':
        j = i
        while j < n and s[j] not in _WS + ",:}]{[\"":
            j += 1
        if j == i:
            raise _Bad(i)
        return j if j < n else None
    closers: list[str] = []
    j = i
    while j < n:
        c = s[j]
        if c == '"':
            j += 1
            while j < n and s[j] != '"':
                j += 2 if s[j] == "\\" else 1
            if j >= n:
                return None
        elif c in "{[":
            closers.append("}" if c == "{" else "]")
        elif c in "}]":
            if closers.pop() != c:
                raise _Bad(j)
        j += 1
        if not closers:
            return j
    return None


@dataclasses.dataclass
class _Object:
    """What is known of a call object `{"name": str, "arguments": {...}}` read so far."""

    status: str = "partial"  # or "done" (closed at `end`) or "bad" (broken at `end`)
    end: int = 0
    name: str | None = None
    args: int | None = None  # where the arguments object starts
    args_end: int | None = None


def _read_object(s: str, i: int) -> _Object:
    """The call object at s[i] == "{"; any other keys are skipped."""
    o = _Object()
    try:
        i = _ws(s, i + 1)
        while i < len(s):
            if s[i] != '"':
                raise _Bad(i)
            e = _value_end(s, i)
            if e is None:
                return o
            key = json.loads(s[i:e])
            i = _ws(s, e)
            if i == len(s):
                return o
            if s[i] != ":":
                raise _Bad(i)
            i = _ws(s, i + 1)
            if i == len(s):
                return o
            if key in ARG_KEYS:
                if s[i] != "{" or o.args is not None:
                    raise _Bad(i)
                o.args = i
            elif key == "name" and (s[i] != '"' or o.name is not None):
                raise _Bad(i)
            e = _value_end(s, i)
            if e is None:
                return o
            if key == "name":
                o.name = json.loads(s[i:e])
            elif key in ARG_KEYS:
                o.args_end = e
            i = _ws(s, e)
            if i == len(s):
                return o
            if s[i] == "}" and o.name is not None and o.args is not None:
                o.status, o.end = "done", i + 1
                return o
            if s[i] != ",":
                raise _Bad(i)
            i = _ws(s, i + 1)
    except _Bad as bad:
        o.status, o.end = "bad", bad.at
    except ValueError:  # a key or name with a broken escape
        o.status, o.end = "bad", i
    return o


def _partial_tag(s: str, start: int, tag: str) -> int:
    """Length of the longest end of s[start:] that begins `tag` (held back until it is known not to be the tag)."""
    for k in range(min(len(tag) - 1, len(s) - start), 0, -1):
        if tag.startswith(s[len(s) - k :]):
            return k
    return 0


class ToolCallReader:
    """One choice's output: feed() it the cumulative text, finish() it once; both return OpenAI deltas
    ({"content": ...} or {"tool_calls": [...]}), and `content`, `calls` hold what was read."""

    def __init__(self):
        self.text = ""
        self.pos = 0  # text[:pos] is accounted for
        self.calls: list[ToolCall] = []
        self._content: list[str] = []
        self._out: list[dict] = []
        self._call: ToolCall | None = None  # the call being read
        self._held = ""  # whitespace at the end of the content: dropped unless content follows
        self._after_call = False  # whitespace right after a call is dropped

    @property
    def content(self) -> str | None:
        return "".join(self._content) or None

    def feed(self, text: str) -> list[dict]:
        self.text = text
        self._advance(final=False)
        return self._take()

    def finish(self) -> list[dict]:
        self._advance(final=True)
        if self._held and not self._after_call:
            self._emit(self._held)
        self._held = ""
        return self._take()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        self.feed(text)
        self.finish()
        return self.content, self.calls

    def _advance(self, final: bool) -> None:
        raise NotImplementedError

    def _take(self) -> list[dict]:
        out, self._out = self._out, []
        return out

    def _emit(self, text: str) -> None:
        self._content.append(text)
        if self._out and "content" in self._out[-1]:
            self._out[-1]["content"] += text
        else:
            self._out.append({"content": text})

    def _say(self, text: str) -> None:
        """Content. Whitespace around calls is left out, but for what stood before the first call that content
        follows ("A\n<call>\nB" is "A\nB")."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body) :]
        if body:
            self._emit(body)

    def _begin(self, name: str, call_id: str | None = None) -> ToolCall:
        call = ToolCall(name) if call_id is None else ToolCall(name, id=call_id)
        self._call = call
        if not self._content:
            self._held = ""
        self.calls.append(call)
        self._out.append({"tool_calls": [{"index": len(self.calls) - 1, **call.openai()}]})
        return call

    def _args(self, arguments: str) -> None:
        """The current call's arguments so far (the ones sent before are a prefix of them)."""
        new = arguments[len(self._call.arguments) :]
        if new and arguments.startswith(self._call.arguments):
            self._call.arguments = arguments
            self._out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": new}}]})

    def _read_call(self, start: int, final: bool) -> int | str | None:
        """Read the call object at text[start] ("{"): where it ended (closed, broken or cut short after it began),
        None to wait for more text, or "text" when it is not a call."""
        o = _read_object(self.text, start)
        if self._call is None and o.name is not None and o.args is not None:
            self._begin(o.name)
        if self._call is None:
            if o.status == "partial" and not final:
                return None
            return "text"
        stop = o.args_end if o.args_end is not None else o.end if o.status == "bad" else len(self.text)
        self._args(self.text[o.args : stop])
        if o.status == "partial" and not final:
            return None
        self._call, self._after_call = None, True
        return o.end if o.status != "partial" else len(self.text)


class HermesReader(ToolCallReader):
    """`text <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` repeated: text outside the tags is
    content; a block that holds no call object stays content, tags and all."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self._state = "text"
        self._block = 0  # where the current block's inside starts

    def _advance(self, final: bool) -> None:
        t = self.text
        while True:
            if self._state == "text":
                j = t.find(self.OPEN, self.pos)
                if j < 0:
                    end = len(t) if final else len(t) - _partial_tag(t, self.pos, self.OPEN)
                    self._say(t[self.pos : end])
                    self.pos = end
                    return
                self._say(t[self.pos : j])
                self.pos, self._block, self._state = j, j + len(self.OPEN), "call"
            elif self._state == "call":
                i = _ws(t, self._block)
                if i == len(t) and not final:
                    return
                got = self._read_call(i, final) if i < len(t) and t[i] == "{" else "text"
                if got is None:
                    return
                self._block, self._state = (self._block, "bad") if got == "text" else (got, "skip")
            elif self._state == "skip":  # after a call: up to its closing tag (or the next call), dropped
                close, nxt = t.find(self.CLOSE, self._block), t.find(self.OPEN, self._block)
                if 0 <= nxt and (close < 0 or nxt < close):
                    self.pos, self._state = nxt, "text"
                elif close >= 0:
                    self.pos, self._state = close + len(self.CLOSE), "text"
                else:
                    return
            else:  # "bad": not a call, so text through its closing tag
                close = t.find(self.CLOSE, self._block)
                end = close + len(self.CLOSE) if close >= 0 else len(t)
                self._say(t[self.pos : end])
                self.pos = end
                if close < 0:
                    return
                self._state = "text"


class JsonCallsReader(ToolCallReader):
    """Call objects from the start of the output, after an optional `prefix` (required when `end` is set),
    separated by `sep`: Llama 3.1's `<|python_tag|>{"name": ..., "parameters": {...}}; {...}` and the
    "required" array `[{"name": ..., "parameters": {...}}, ...]`. Output that does not open with a call is
    content, and so is what follows the last call."""

    def __init__(self, prefix: str, sep: str, end: str | None = None):
        super().__init__()
        self.prefix, self.sep, self.end = prefix, sep, end
        self._state = "start"
        self._block = 0

    def _advance(self, final: bool) -> None:
        t = self.text
        while True:
            if self._state == "start":
                i = _ws(t, 0)
                if t.startswith(self.prefix, i):
                    i = _ws(t, i + len(self.prefix))
                elif self.prefix.startswith(t[i:]) and not final:
                    return  # nothing yet, or what may still become the prefix
                elif self.end is not None:
                    i = -1  # a bracketed list that does not open: not calls
                if i == len(t) and not final:
                    return
                is_call = 0 <= i < len(t) and t[i] == "{"
                self._block, self._state = (i, "call") if is_call else (0, "text")
            elif self._state == "call":
                got = self._read_call(self._block, final)
                if got is None:
                    return
                self._block, self._state = (self._block, "text") if got == "text" else (got, "sep")
            elif self._state == "sep":  # after a call: the next one, the end, or text
                i = _ws(t, self._block)
                if i == len(t):
                    return
                if t[i] == self.sep:
                    j = _ws(t, i + 1)
                    if j == len(t):
                        return
                    self.pos, self._block = j, j
                    self._state = "call" if t[j] == "{" else "text"
                elif t[i] == self.end:
                    self._state = "done"
                else:
                    self.pos, self._state = i, "text"
            elif self._state == "text":
                self._say(t[self.pos :])
                self.pos = len(t)
                return
            else:  # "done"
                return


class NamedReader(ToolCallReader):
    """tool_choice naming a function: the whole output (stripped) is that function's arguments."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def _advance(self, final: bool) -> None:
        t = self.text
        if self._call is None and (t.strip() or final):
            self._begin(self.name)
        if self._call is not None:
            start = _ws(t, 0)
            self._args(t[start : max(start, len(t.rstrip()))])

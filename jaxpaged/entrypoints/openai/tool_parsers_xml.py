"""Qwen3-Coder's (and Qwen3.5's) XML tool calls, vLLM's `qwen3_coder` parser:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is text (one newline after its tag and one before `</parameter>` are not part of it); it becomes JSON by
its type in the called tool's parameter schema, as vLLM converts it: strings stay strings (whatever they spell),
integers, numbers and booleans are read as such, objects and arrays as JSON (or Python literals, read with
ast.literal_eval, never evaluated), and a value that does not read as its type stays a string. A parameter the
schema does not name stays a string. The arguments are streamed as JSON pieces: `{` as the function opens,
`"KEY": VALUE` (after `, `) as each parameter closes, `}` as the function does; they join into the unstreamed
arguments. A `</parameter>` counts only when the next thing after it is another parameter, `</function>`,
`</tool_call>` or the end of the output, so a value may hold the tags themselves (code that writes this format).
"""

from __future__ import annotations

import ast
import json
import math

from jaxpaged.entrypoints.openai.tool_parsers import ToolCallReader, _partial_tag, _ws

CALL, CALL_END, FUNC, FUNC_END, PARAM, PARAM_END = (
    "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")  # fmt: skip
_NOT_IN_NAME = set("{}<>\"' \t\r\n")  # a name with one of these is not a call (a template the model echoed, say)
_STRINGS = ("string", "str", "text", "varchar", "char", "enum")


def tool_properties(tools) -> dict[str, dict]:
    """Each function's name -> its parameters' `properties` schema (empty when it has none)."""
    out = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
            props = params.get("properties")
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _type_of(schema) -> tuple[str, bool]:
    """(the schema's type, lower case, its first non-null one for a union; whether null is allowed)."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    else:
        options = schema.get("anyOf") or schema.get("oneOf")
        types = [o["type"] for o in options if isinstance(o, dict) and "type" in o] if isinstance(options, list) else []
    types = [str(t).strip().lower() for t in types]
    return next((t for t in types if t != "null"), "null" if types else "string"), "null" in types


def _literal(text: str):
    """A Python literal read with ast.literal_eval (which only reads literals), or the text itself."""
    try:
        return ast.literal_eval(text)
    except Exception:  # noqa: BLE001 - a syntax error, a non-literal, or nesting too deep: not a literal
        return text


def convert(value: str, key: str, properties: dict):
    """A parameter's text as the JSON value its schema type says (vLLM's conversion)."""
    if key not in properties:
        return value
    kind, nullable = _type_of(properties[key])
    low = value.lower()
    if nullable and low in ("null", "none"):
        return None
    if kind in _STRINGS:
        return value
    if low in ("null", "none"):
        return None
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        return value if not math.isfinite(number) else int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return low == "true"  # as vLLM: anything but "true" is false
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = _literal(value)
        return _literal(parsed) if isinstance(parsed, str) else parsed  # a JSON string holding a Python repr
    return _literal(value)


def _dump(value, text: str) -> str:
    """JSON of a converted value; its text as a string when it has no JSON form (a set, NaN, bytes)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return json.dumps(text, ensure_ascii=False)


class Qwen3CoderReader(ToolCallReader):
    """Text, then `<tool_call>` blocks (a bare `<function=...>` without one is read too, as vLLM does). A block
    that does not open a function with a valid name stays content, tags and all. Cut short inside a call, the
    call keeps its parameters (the last one as far as it went) and its object is closed."""

    def __init__(self, tools=None):
        super().__init__()
        self.properties = tool_properties(tools)
        self._state = "text"
        self._start = 0  # where the current block (or bare function) starts
        self._at = 0  # where reading resumes inside it
        self._in_block = False  # the call opened with <tool_call> (so it ends with </tool_call>)
        self._json = ""  # the current call's arguments so far
        self._keys: list[str] = []  # its parameters so far

    def _advance(self, final: bool) -> None:
        t = self.text
        while True:
            state = self._state
            if state == "text":
                call, func = t.find(CALL, self.pos), t.find(FUNC, self.pos)
                j = min(k for k in (call, func, len(t)) if k >= 0)
                if j == len(t):
                    held = max(_partial_tag(t, self.pos, CALL), _partial_tag(t, self.pos, FUNC))
                    end = len(t) if final else len(t) - held
                    self._say(t[self.pos : end])
                    self.pos = end
                    return
                self._say(t[self.pos : j])
                self.pos, self._start, self._in_block = j, j, j == call
                self._at, self._state = (j + len(CALL), "open") if j == call else (j, "function")
            elif state == "open":  # inside <tool_call>: its function comes next
                i = _ws(t, self._at)
                if t.startswith(FUNC, i):
                    self._at, self._state = i, "function"
                elif FUNC.startswith(t[i:]) and not final:
                    return
                else:
                    self._state = "bad"
            elif state == "function":  # at <function=: the call begins once its name is whole
                start = self._at + len(FUNC)
                close = t.find(">", start)
                name = t[start : close if close >= 0 else len(t)]
                if any(c in _NOT_IN_NAME for c in name) or (close >= 0 and not name) or (close < 0 and final):
                    self._state = "bad"
                    continue
                if close < 0:
                    return
                self._begin(name)
                self._json, self._keys = "{", []
                self._args(self._json)
                self._at, self._state = close + 1, "params"
            elif state == "params":
                if not self._params(final):
                    return
            elif state == "after":  # after </function>: the block's end (anything else in it is dropped)
                i = _ws(t, self._at)
                if not self._in_block:
                    self.pos, self._state = self._at, "text"
                elif t.startswith(CALL_END, i):
                    self.pos, self._state = i + len(CALL_END), "text"
                elif not final and CALL_END.startswith(t[i:]):
                    return
                else:
                    nxt = [k for k in (t.find(CALL_END, i), t.find(CALL, i)) if k >= 0]
                    if not nxt:
                        return  # (at the end, what is left of the block is dropped)
                    k = min(nxt)
                    self.pos, self._state = k + len(CALL_END) if t.startswith(CALL_END, k) else k, "text"
            else:  # "bad": not a call, so content as written, through the block's end
                if not self._in_block:
                    end = self.pos + len(FUNC)
                else:
                    close = t.find(CALL_END, self._start + len(CALL))
                    end = close + len(CALL_END) if close >= 0 else len(t)
                self._say(t[self.pos : end])
                self.pos = end
                if self._in_block and close < 0:
                    return
                self._state = "text"

    def _params(self, final: bool) -> bool:
        """Read the next parameter or the function's end; False to wait for more text."""
        t = self.text
        i = _ws(t, self._at)
        if t.startswith(PARAM, i):
            close = t.find(">", i + len(PARAM))
            if close < 0 and not final:
                return False
            if close >= 0:
                value = close + 1
                if value == len(t) and not final:
                    return False  # a newline may follow the tag
                value += t.startswith("\n", value)
                key = t[i + len(PARAM) : close]
                end, resume = self._value_end(value, key, final)
                if end is None:
                    return False
                self._add(key, t[value:end])
                self._at = resume
                if resume < len(t) or not final:
                    return True
        elif t.startswith(FUNC_END, i):
            self._close(i + len(FUNC_END))
            return True
        elif not final and (PARAM.startswith(t[i:]) or FUNC_END.startswith(t[i:])):
            return False
        self._close(len(t) if final else i)  # cut short, or text a function does not hold: the call ends here
        return True

    def _value_end(self, start: int, key: str, final: bool) -> tuple[int | None, int]:
        """(end of the value that starts at `start`, where reading resumes), or (None, _) to wait. It ends at the
        first `</parameter>` followed by a tag that may follow one (or the output's end), or just before the next
        `<parameter=NAME>` on its own line naming another parameter of the schema this call has not had (a
        missing `</parameter>`, as vLLM allows)."""
        t = self.text
        known = set(self.properties.get(self.calls[-1].name, ())) - {key, *self._keys}
        implicit, j = None, t.find("\n" + PARAM, start)
        while j >= 0 and implicit is None:
            name_end = t.find(">", j)
            implicit = j if name_end >= 0 and t[j + 1 + len(PARAM) : name_end] in known else None
            j = t.find("\n" + PARAM, j + 1)
        j = t.find(PARAM_END, start)
        while j >= 0 and (implicit is None or j < implicit):
            after = _ws(t, j + len(PARAM_END))
            if any(t.startswith(tag, after) for tag in (PARAM, FUNC_END, CALL_END)) or (after == len(t) and final):
                return j, j + len(PARAM_END)
            if not final and any(tag.startswith(t[after:]) for tag in (PARAM, FUNC_END, CALL_END)):
                return None, 0
            j = t.find(PARAM_END, j + 1)
        if implicit is not None:
            return implicit, implicit + 1
        if not final:
            return None, 0
        end = t.find(FUNC_END, start)  # cut short (or never closed): the value runs to </function> or the end
        end = end if end >= 0 else len(t) - _partial_tag(t, start, PARAM_END)
        return end, end

    def _add(self, key: str, text: str) -> None:
        text = text.removesuffix("\n")
        value = convert(text, key, self.properties.get(self.calls[-1].name, {}))
        self._json += (", " if self._keys else "") + f"{json.dumps(key, ensure_ascii=False)}: {_dump(value, text)}"
        self._keys.append(key)
        self._args(self._json)

    def _close(self, at: int) -> None:
        self._json += "}"
        self._args(self._json)
        self._call, self._after_call = None, True
        self._at, self._state = at, "after"

"""Python-style tool calls (vLLM's `pythonic` parser: Llama 3.2/4 with vLLM's pythonic templates, and others):
the output is a list of calls, `[get_weather(city="Oslo", days=3), now()]` (for Llama 4 optionally inside
`<|python_start|>...<|python_end|>`). Each call is read with Python's `ast` and its keyword arguments with
ast.literal_eval, which only reads literals, so model output is never run; the arguments become a JSON object.
An output that does not open with `[` is content (vLLM reads calls only when the whole output is the list), and
so is a call that is not a name with literal keyword arguments, with what follows it. A call is sent once it is
whole; cut short, the last call is closed where it was cut (a value cut short kept as far as it reads,
else left out).
"""

from __future__ import annotations

import ast
import json
import re

from jaxpaged.entrypoints.openai.tool_parsers import ToolCallReader, _ws

START, END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\s*\(")
_CLOSE = {"(": ")", "[": "]", "{": "}"}


def _scan(s: str, i: int) -> tuple[int | None, str, list[int]]:
    """From the `(` at s[i]: (index past its `)` or None when s ends first, what would close the text cut there,
    where the top-level commas are). None end and "" closers: the brackets do not match."""
    stack, commas, quote, j = [], [], "", i
    while j < len(s):
        c = s[j]
        if quote:
            if c == "\\":
                j += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in _CLOSE:
            stack.append(_CLOSE[c])
        elif c in ")]}":
            if stack.pop() != c:
                return None, "", []
            if not stack:
                return j + 1, "", commas
        elif c == "," and len(stack) == 1:
            commas.append(j)
        j += 1
    return None, quote + "".join(reversed(stack)), commas


def _call(source: str) -> tuple[str, str] | None:
    """(name, arguments as JSON) of `name(key=literal, ...)`, None when it is not such a call."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            return None
        name = ast.unparse(node.func)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", name):
            return None
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        return name, json.dumps(args, ensure_ascii=False, allow_nan=False)
    except Exception:  # noqa: BLE001 - a syntax error, a value that is not a literal or has no JSON form
        return None


class PythonicReader(ToolCallReader):
    def __init__(self):
        super().__init__()
        self._state = "start"
        self._at = 0

    def _advance(self, final: bool) -> None:
        t = self.text
        while True:
            if self._state == "start":
                i = _ws(t, 0)
                if t.startswith(START, i):
                    i = _ws(t, i + len(START))
                elif START.startswith(t[i:]) and not final:
                    return
                if i == len(t) and not final:
                    return
                self._at, self._state = (i + 1, "call") if t.startswith("[", i) else (0, "text")
            elif self._state == "call":
                i = _ws(t, self._at)
                match = _NAME.match(t, i)
                if not match:
                    if final or re.fullmatch(r"[A-Za-z0-9_.\-]*\s*", t[i:]) is None:
                        self._state = "text"
                        continue
                    return
                end, closers, commas = _scan(t, match.end() - 1)
                if end is None and closers and not final:
                    return
                if end is None and closers:  # cut short: the call with its complete arguments, closed
                    got = _call(t[i:] + closers) or next(
                        (g for c in reversed(commas) if (g := _call(t[i:c] + ")"))), _call(t[i : match.end()] + ")"))
                    end = len(t)
                else:
                    got = _call(t[i:end]) if end is not None else None
                if got is None:
                    self._state = "text"
                    continue
                self._begin(got[0])
                self._args(got[1])
                self._call, self._after_call = None, True
                self.pos = self._at = end
                self._state = "sep"
            elif self._state == "sep":  # after a call: the next one, or the list's end
                i = _ws(t, self._at)
                if i == len(t):
                    return
                if t[i] == ",":
                    self.pos = self._at = i + 1
                    self._state = "call"
                elif t[i] == "]":
                    k = _ws(t, i + 1)
                    if not final and len(t) - k < len(END) and END.startswith(t[k:]):
                        return  # Llama 4's <|python_end|> may follow
                    self.pos = k + len(END) if t.startswith(END, k) else i + 1
                    self._state = "text"
                else:
                    self.pos, self._state = i, "text"
            else:  # "text": the rest is content
                self._say(t[self.pos :])
                self.pos = len(t)
                return

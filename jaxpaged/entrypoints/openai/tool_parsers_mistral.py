"""Mistral's tool calls (vLLM's `mistral` parser): content, then `[TOOL_CALLS]` and either a JSON array of
`{"name", "arguments"}` objects (Mistral 7B v0.3 and other pre-v11 tokenizers) or one call per `[TOOL_CALLS]`:
`NAME{ARGS}` (v11) or `NAME[ARGS]{ARGS}` (Mistral Small 3.2, Magistral, Devstral). `[TOOL_CALLS]` and `[ARGS]` are
control tokens, so these requests keep special tokens in the text. Mistral checks that a call's id is 9
alphanumeric characters, so these calls get such ids. Arguments are the JSON object as the model wrote it, streamed
as it comes; what follows the calls is content, and a `[TOOL_CALLS]` that is not followed by calls stays content.
"""

from __future__ import annotations

import random
import re
import string

from jaxpaged.entrypoints.openai.tool_parsers import ToolCall, ToolCallReader, _Bad, _partial_tag, _value_end, _ws

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ID_CHARS = string.ascii_letters + string.digits
_random = random.SystemRandom()


def mistral_call_id() -> str:
    return "".join(_random.choices(_ID_CHARS, k=9))


class MistralReader(ToolCallReader):
    def __init__(self):
        super().__init__()
        self._state = "text"
        self._start = 0  # the [TOOL_CALLS] being read
        self._at = 0

    def _begin(self, name: str, call_id: str | None = None) -> ToolCall:
        return super()._begin(name, call_id or mistral_call_id())

    def _advance(self, final: bool) -> None:
        t = self.text
        while True:
            if self._state == "text":
                j = t.find(BOT, self.pos)
                if j < 0:
                    end = len(t) if final else len(t) - _partial_tag(t, self.pos, BOT)
                    self._say(t[self.pos : end])
                    self.pos = end
                    return
                self._say(t[self.pos : j])
                self.pos, self._start, self._at, self._state = j, j, j + len(BOT), "calls"
            elif self._state == "calls":  # after [TOOL_CALLS]: an array, or a name
                i = _ws(t, self._at)
                if i == len(t) and not final:
                    return
                if t.startswith("[", i):
                    self._at, self._state = i + 1, "array"
                else:
                    self._at, self._state = i, "name"
            elif self._state == "array":  # the next call object, the array's end, or text
                i = _ws(t, self._at)
                if i == len(t) and not final:
                    return
                if t.startswith("{", i):
                    got = self._read_call(i, final)
                    if got is None:
                        return
                    if got == "text":
                        self._state = "bad"
                        continue
                    self.pos = self._at = got
                    self._state = "array_sep"
                else:
                    self._state = "bad"
            elif self._state == "array_sep":
                i = _ws(t, self._at)
                if i == len(t):
                    return
                if t[i] == ",":
                    self._at, self._state = i + 1, "array"
                elif t[i] == "]":
                    self.pos, self._state = i + 1, "text"
                else:
                    self.pos, self._state = i, "text"
            elif self._state == "name":  # NAME{...} or NAME[ARGS]{...}
                match = _NAME.match(t, self._at)
                end = match.end() if match else self._at
                if end == len(t) and not final:
                    return  # the name may go on
                if t.startswith(ARGS, end):
                    brace = _ws(t, end + len(ARGS))
                elif t.startswith("{", end):
                    brace = end
                elif ARGS.startswith(t[end:]) and not final:
                    return
                else:
                    brace = -1
                if brace == len(t) and not final:
                    return
                if not match or not 0 <= brace < len(t) or t[brace] != "{":
                    self._state = "bad"
                    continue
                self._begin(match.group())
                self._at, self._state = brace, "arguments"
            elif self._state == "arguments":
                try:
                    end = _value_end(t, self._at)
                except _Bad as bad:
                    end = bad.at
                self._args(t[self._at : len(t) if end is None else end])
                if end is None and not final:
                    return
                self._call, self._after_call = None, True
                self.pos = self._at = len(t) if end is None else end
                self._state = "next"
            elif self._state == "next":  # after a call: another [TOOL_CALLS], or text
                i = _ws(t, self._at)
                if t.startswith(BOT, i):
                    self.pos, self._start, self._at, self._state = i, i, i + len(BOT), "calls"
                elif not final and BOT.startswith(t[i:]):
                    return
                else:
                    self._state = "text"
            else:  # "bad": not calls, so content as written from where the reading stopped
                self._say(t[self.pos : self._start + len(BOT)] if self.pos <= self._start else "")
                self.pos = max(self.pos, self._start + len(BOT))
                self._state = "text"

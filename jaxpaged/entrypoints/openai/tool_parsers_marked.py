"""Tool calls in a section of special markers (vLLM's `deepseek_v3`, `deepseek_v31` and `kimi_k2` parsers):
content, then `SECTION_BEGIN (CALL_BEGIN header ARGS CALL_END)* SECTION_END`, the arguments JSON as the model wrote
it. The formats differ in the header and the arguments' wrapping:

- deepseek_v3 (DeepSeek-V3, R1-0528): `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`
- deepseek_v31 (DeepSeek-V3.1): `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`
- kimi_k2 (Kimi-K2): `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|>` in
  `<|tool_calls_section_begin|>...<|tool_calls_section_end|>` (or the singular `tool_call_section`); the call's id
  is `functions.NAME:IDX`, as vLLM returns it (Kimi's template writes it back into the conversation).

The markers are special tokens in these models' vocabularies, so requests read with these parsers keep them in
the text (skip_special_tokens off, as for harmony). A call begins once its header is whole; its arguments stream
as they come (a piece that may begin the closing marker held back); cut short, it keeps what it has. A section
that does not hold calls where they belong stays content, markers and all.
"""

from __future__ import annotations

import dataclasses
import re

from jaxpaged.entrypoints.openai.tool_parsers import ToolCallReader, _partial_tag, _ws


@dataclasses.dataclass(frozen=True)
class Markers:
    begins: tuple[str, ...]  # the section's opening marker(s)
    ends: tuple[str, ...]
    call_begin: str
    header_end: str  # what ends a call's header (name or id), before the arguments
    call_end: str
    fence: str = ""  # what the arguments are wrapped in before call_end (deepseek_v3's "\n```"), not part of them
    strip: bool = False  # whitespace around the arguments is not part of them (kimi_k2)


_DS_CALL = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")
MARKERS = {
    "deepseek_v3": Markers((_DS_CALL[0],), (_DS_CALL[1],), _DS_CALL[2], "\n```json\n", _DS_CALL[4], fence="\n```"),
    "deepseek_v31": Markers((_DS_CALL[0],), (_DS_CALL[1],), _DS_CALL[2], _DS_CALL[3], _DS_CALL[4]),
    "kimi_k2": Markers(("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"),
                       ("<|tool_calls_section_end|>", "<|tool_call_section_end|>"), "<|tool_call_begin|>",
                       "<|tool_call_argument_begin|>", "<|tool_call_end|>", strip=True),
}  # fmt: skip
_KIMI_ID = re.compile(r"[^<\s]+:\d+")


def _header(parser: str, header: str) -> tuple[str, str | None] | None:
    """(name, call id or None for a fresh one) from a call's header; None when it names no function."""
    if parser == "deepseek_v3":  # "function<｜tool▁sep｜>NAME"
        kind, sep, name = header.partition(_DS_CALL[3])
        name = name.strip()
        return (name, None) if sep and name and not any(c.isspace() for c in name) else None
    if parser == "kimi_k2":  # "functions.NAME:IDX"
        call_id = header.strip()
        return (call_id.split(":")[0].split(".")[-1], call_id) if _KIMI_ID.fullmatch(call_id) else None
    name = header.strip()
    return (name, None) if name and not any(c.isspace() or c == "<" for c in name) else None


def _find_any(t: str, start: int, tags: tuple[str, ...]) -> tuple[int, str]:
    found = [(t.find(tag, start), tag) for tag in tags]
    return min(((j, tag) for j, tag in found if j >= 0), default=(-1, ""))


class MarkedCallsReader(ToolCallReader):
    """One of MARKERS' formats, by its parser name."""

    def __init__(self, parser: str):
        super().__init__()
        self.parser, self.m = parser, MARKERS[parser]
        self._state = "text"
        self._start = 0  # where the current section starts
        self._at = 0  # where reading resumes inside it
        self._args_at = 0  # where the current call's arguments start

    def _advance(self, final: bool) -> None:
        t, m = self.text, self.m
        while True:
            if self._state == "text":
                j, tag = _find_any(t, self.pos, m.begins)
                if j < 0:
                    end = len(t) if final else len(t) - max(_partial_tag(t, self.pos, b) for b in m.begins)
                    self._say(t[self.pos : end])
                    self.pos = end
                    return
                self._say(t[self.pos : j])
                self.pos, self._start, self._at, self._state = j, j, j + len(tag), "section"
            elif self._state == "section":  # between calls: the next call or the section's end
                i = _ws(t, self._at)
                j, end = _find_any(t, i, m.ends)
                if t.startswith(m.call_begin, i):
                    self._at, self._state = i + len(m.call_begin), "header"
                elif j == i:
                    self.pos, self._state = i + len(end), "text"
                elif not final and any(tag.startswith(t[i:]) for tag in (m.call_begin, *m.ends)):
                    return
                else:
                    self._state = "bad"
            elif self._state == "header":
                j = t.find(m.header_end, self._at)
                ends = (t.find(tag, self._at) for tag in (m.call_end, *m.ends))
                stop = min((k for k in ends if k >= 0), default=len(t))
                got = _header(self.parser, t[self._at : j]) if 0 <= j < stop else None
                if got is None:
                    if j < 0 and stop == len(t) and not final:
                        return
                    self._state = "bad"
                    continue
                self._begin(*got)
                self._args_at = j + len(m.header_end)
                self._state = "arguments"
            elif self._state == "arguments":
                start = _ws(t, self._args_at) if m.strip else self._args_at
                j = t.find(m.call_end, start)
                if j < 0 and not final:
                    if start == len(t) and m.strip:
                        return
                    end = len(t) - _partial_tag(t, start, m.fence + m.call_end)
                    self._args(self._trim(t[start:end]))
                    return
                end = j if j >= 0 else len(t) - _partial_tag(t, start, m.fence + m.call_end)
                self._args(self._trim(t[start:end].removesuffix(m.fence) if j >= 0 else t[start:end]))
                self._call, self._after_call = None, True
                self.pos = self._at = j + len(m.call_end) if j >= 0 else len(t)
                self._state = "section"
                if j < 0:
                    return
            else:  # "bad": not calls, so content as written, through the section's end
                j, end = _find_any(t, self._start + 1, m.ends)
                stop = j + len(end) if j >= 0 else len(t)
                self._say(t[self.pos : stop])
                self.pos = stop
                if j < 0:
                    return
                self._state = "text"

    def _trim(self, args: str) -> str:
        """Arguments without the whitespace kimi_k2 puts around them (at the end: held back until text follows)."""
        return args.rstrip() if self.m.strip else args

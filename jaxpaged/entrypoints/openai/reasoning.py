"""Reasoning outputs (vLLM's `--reasoning-parser`): a thinking model's output split into its reasoning, sent as
`reasoning_content`, and its answer, sent as `content` (and read for tool calls).

qwen3 and deepseek_r1 read `<think>...</think>`. Where the output's thinking starts is decided with the prompt's
help: a chat template may open the thinking itself (`<think>` at the end of the prompt, so the model writes only
`...</think>`) or close it (an empty `<think></think>` when thinking is off), and the prompt's last marker says
which. qwen3: reasoning when the output opens `<think>` or the prompt left it open; otherwise (thinking off, or a
model that answers at once) all of it is content. deepseek_r1: everything before `</think>` is reasoning (the
template adds `<think>`; one the model writes anyway is dropped), unless the prompt closed the thinking. gpt_oss: OpenAI's harmony format, read with the `openai-harmony` package (the `harmony` extra): the
analysis channel is reasoning, the final (and commentary) channels are content; with tools (the `openai` tool-call
parser) a commentary message addressed `to=functions.NAME` is a call of NAME, its content the arguments. harmony's
encoding and its vocabulary (o200k_base.tiktoken, read offline from an installed litellm's copy when there is one)
come from jaxpaged/utils/harmony.py, which also renders GPT-OSS's chat prompts.

Each parser is a reader of the choice's cumulative text that returns OpenAI deltas as it goes; the whole-text
parse is the same reader fed the text at once, so a stream and a plain response agree. A marker split across
deltas is held back until it is known.
"""

from __future__ import annotations

import contextlib

from jaxpaged.engine.structured_output import thinking_closed
from jaxpaged.entrypoints.openai.tool_parsers import ToolCall, _partial_tag, _ws
from jaxpaged.utils.extras import require

# harmony's encoding and its offline vocabulary (re-exported: the engine renders GPT-OSS's prompts with them too)
from jaxpaged.utils.harmony import BUNDLED_O200K, O200K_SHA256, bundled_vocabulary, harmony_encoding  # noqa: F401

REASONING_PARSERS = ("qwen3", "deepseek_r1", "gpt_oss", "deepseek_v3", "mistral")
THINK = ("<think>", "</think>")
MISTRAL_THINK = ("[THINK]", "[/THINK]")  # Magistral's control tokens (special: kept in the text for the reader)
# (start, end): the markers the grammar of structured outputs waits behind (StructuredOutputsParams.reasoning_end)
MARKERS = {"qwen3": THINK, "deepseek_r1": THINK, "gpt_oss": ("<|start|>", "<|channel|>final<|message|>"),
           "deepseek_v3": THINK, "mistral": MISTRAL_THINK}  # fmt: skip
SPECIAL_MARKERS = ("gpt_oss", "mistral")  # parsers whose markers are special tokens: kept in the text


def check_reasoning_parser(name: str | None) -> None:
    """A start-up check: ValueError naming the parameter for an unknown parser, MissingExtraError for gpt_oss
    without openai-harmony, ValueError when harmony's vocabulary cannot be loaded (it downloads it once)."""
    if name is None:
        return
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} (got {name!r})")
    if name == "gpt_oss":
        harmony_encoding()


def detect_reasoning_parser(chat_template, generation_prompt: str | None = None) -> str | None:
    """The parser a chat template's thinking format needs, or None when it shows none. `generation_prompt` (the
    template rendered for one user turn) tells deepseek_r1's shape, a prompt that opens `<think>` itself, from
    qwen3's, where the model writes it."""
    if isinstance(chat_template, dict):  # named templates
        chat_template = "\n".join(t for t in chat_template.values() if isinstance(t, str))
    if not chat_template:
        return None
    if "<|channel|>" in chat_template and "<|message|>" in chat_template:
        return "gpt_oss"
    if MISTRAL_THINK[0] in chat_template:  # Magistral's
        return "mistral"
    if THINK[0] not in chat_template and THINK[1] not in chat_template:
        return None
    prompt_end = generation_prompt.rstrip() if generation_prompt is not None else ""
    if "<｜Assistant｜>" in chat_template and prompt_end.endswith(THINK[1]):  # DeepSeek-V3.1: thinking off by default
        return "deepseek_v3"
    return "deepseek_r1" if prompt_end.endswith(THINK[0]) else "qwen3"


def prompt_thinking(name: str, prompt_text: str) -> str | None:
    """"open" when the prompt's last thinking marker opens it, "closed" when it closes it, None when it has none."""
    start, end = MARKERS[name]
    if thinking_closed(prompt_text, start, end):
        return "closed"
    return "open" if start in prompt_text else None


def reasoning_reader(name: str, prompt_text: str = "") -> ReasoningReader:
    """A reader for one choice of a request whose prompt is `prompt_text` (special tokens kept)."""
    if name == "gpt_oss":
        return HarmonyReader()
    state = prompt_thinking(name, prompt_text)
    if name == "mistral":
        return MistralThinkReader(thinking=state == "open")
    if name == "deepseek_v3":  # V3.1 thinks only when its template opened <think> (the `thinking` kwarg)
        return ThinkReader(thinking=True) if state == "open" else ContentReader()
    return ThinkReader(thinking=state == "open" if name == "qwen3" else state != "closed")


class ReasoningReader:
    """One choice's output: feed() it the cumulative text, finish() it once; both return OpenAI deltas
    ({"reasoning_content": ...} or {"content": ...}), and `reasoning`, `content` hold what was read."""

    def __init__(self):
        self._parts: dict[str, list[str]] = {"reasoning_content": [], "content": []}
        self._out: list[dict] = []

    @property
    def reasoning(self) -> str | None:
        return "".join(self._parts["reasoning_content"]) or None

    @property
    def content(self) -> str | None:
        return "".join(self._parts["content"]) or None

    def feed(self, text: str) -> list[dict]:
        self._advance(text, final=False)
        return self._take()

    def finish(self, text: str | None = None) -> list[dict]:
        self._advance(text, final=True)
        return self._take()

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output."""
        self.feed(text)
        self.finish(text)
        return self.reasoning, self.content

    def _advance(self, text: str | None, final: bool) -> None:
        raise NotImplementedError

    def _emit(self, key: str, text: str) -> None:
        if not text:
            return
        self._parts[key].append(text)
        if self._out and key in self._out[-1]:
            self._out[-1][key] += text
        else:
            self._out.append({key: text})

    def _take(self) -> list[dict]:
        out, self._out = self._out, []
        return out


class ThinkReader(ReasoningReader):
    """`<think>reasoning</think>content`: `thinking` says whether an output that does not open `<think>` starts
    inside the thinking (the prompt opened it, or deepseek_r1's template does) or in the answer."""

    def __init__(self, thinking: bool):
        super().__init__()
        self.text, self.pos = "", 0
        self._state = "start"
        self._fallback = "reasoning" if thinking else "content"

    def _advance(self, text: str | None, final: bool) -> None:
        t = self.text = self.text if text is None else text
        start, end = THINK
        while True:
            if self._state == "start":
                i = _ws(t, self.pos)
                if t.startswith(start, i):
                    self.pos, self._state = i + len(start), "reasoning"
                elif start.startswith(t[i:]) and not final:
                    return  # nothing yet, or what may still become `<think>`
                else:
                    self._state = self._fallback
            elif self._state == "reasoning":
                j = t.find(end, self.pos)
                if j < 0:
                    stop = len(t) if final else len(t) - _partial_tag(t, self.pos, end)
                    self._emit("reasoning_content", t[self.pos : stop])
                    self.pos = stop
                    return
                self._emit("reasoning_content", t[self.pos : j])
                self.pos, self._state = j + len(end), "content"
            else:
                self._emit("content", t[self.pos :])
                self.pos = len(t)
                return


class HarmonyReader(ReasoningReader):
    """gpt-oss's harmony messages, parsed by openai-harmony's StreamableParser from the output's text (special
    tokens kept): the text is encoded with harmony's own vocabulary, so any tokenizer that spells the markers works.
    A marker (`<|...|>`) cut at the end of a delta waits for its rest. With `tools`, a commentary message addressed
    `to=functions.NAME` is a call (in `calls`, sent as OpenAI's tool_calls deltas: the call's id and name as its
    header is read, then its arguments as they come); one in the analysis channel stays reasoning."""

    def __init__(self, tools: bool = False):
        super().__init__()
        harmony = require("openai_harmony", "the gpt_oss reasoning parser")
        self._encoding = harmony_encoding()
        self._parser = harmony.StreamableParser(self._encoding, role=harmony.Role.ASSISTANT)
        self._in_message = harmony.StreamState.CONTENT
        self.text = ""
        self._sent = 0  # text[:_sent] has gone to the parser
        self.tools = tools
        self.calls: list[ToolCall] = []
        self._call: ToolCall | None = None  # the call whose arguments are being read

    def _advance(self, text: str | None, final: bool) -> None:
        text = self.text if text is None else text
        self.text = text
        stop = len(text)
        if not final:
            opened = text.rfind("<|", self._sent)
            if opened >= 0 and text.find("|>", opened) < 0:
                stop = opened
            elif text.endswith("<"):
                stop -= 1
        piece, self._sent = text[self._sent : stop], max(self._sent, stop)
        for token in self._encoding.encode(piece, allowed_special="all") if piece else ():
            self._process(token)
        if final:
            with contextlib.suppress(Exception):  # an output cut short mid-header: what was read stands
                self._parser.process_eos()

    def _process(self, token: int) -> None:
        parser = self._parser
        try:
            parser.process(token)
        except Exception:  # noqa: BLE001 - text outside harmony's shape: kept as content, not lost
            self._emit("content", self._encoding.decode([token]))
            return
        if parser.state != self._in_message:  # a header, or between messages
            self._call = None
            return
        delta, channel, recipient = parser.last_content_delta, parser.current_channel, parser.current_recipient
        if self.tools and channel == "commentary" and recipient and recipient.startswith("functions."):
            if self._call is None:  # the header just ended: the call opens
                self._call = ToolCall(recipient.removeprefix("functions."))
                self.calls.append(self._call)
                self._out.append({"tool_calls": [{"index": len(self.calls) - 1, **self._call.openai()}]})
            if delta:
                self._call.arguments += delta
                last = self._out[-1]["tool_calls"][0] if self._out and "tool_calls" in self._out[-1] else {}
                if last.get("index") == len(self.calls) - 1 and "id" not in last:  # this delta's earlier pieces
                    last["function"]["arguments"] += delta
                else:
                    self._out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": delta}}]})
        elif delta:
            self._emit("reasoning_content" if channel == "analysis" else "content", delta)


class ContentReader(ReasoningReader):
    """No reasoning: all of the output is content (deepseek_v3 with thinking off, as vLLM's identity parser)."""

    def _advance(self, text: str | None, final: bool) -> None:
        if text is not None:
            self._emit("content", text[len(self.content or "") :])


class MistralThinkReader(ReasoningReader):
    """Magistral's `[THINK]reasoning[/THINK]content`, as vLLM reads it: no `[THINK]`, all content (a stray `[/THINK]`
    dropped); text before `[THINK]` is content too. `thinking`: the prompt opened `[THINK]` itself."""

    def __init__(self, thinking: bool = False):
        super().__init__()
        self.text, self.pos = "", 0
        self._state = "reasoning" if thinking else "before"

    def _advance(self, text: str | None, final: bool) -> None:
        t = self.text = self.text if text is None else text
        start, end = MISTRAL_THINK
        while True:
            if self._state == "content":
                self._emit("content", t[self.pos :])
                self.pos = len(t)
                return
            key = "reasoning_content" if self._state == "reasoning" else "content"
            tags = (end,) if self._state == "reasoning" else (start, end)
            found = [(j, tag) for tag in tags if (j := t.find(tag, self.pos)) >= 0]
            if not found:
                stop = len(t) if final else len(t) - max(_partial_tag(t, self.pos, tag) for tag in tags)
                self._emit(key, t[self.pos : stop])
                self.pos = stop
                return
            j, tag = min(found)
            self._emit(key, t[self.pos : j])
            self.pos = j + len(tag)
            if tag == start:
                self._state = "reasoning"
            elif self._state == "reasoning":
                self._state = "content"

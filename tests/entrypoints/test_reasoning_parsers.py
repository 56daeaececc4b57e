"""The reasoning parsers on whole outputs and on streamed deltas (a marker split across them), their detection from
chat templates, the flag's choices, and the grammar that waits behind the thinking (engine/structured_output.py).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxpaged.engine.structured_output import AfterReasoning, StructuredOutputManager, thinking_closed
from jaxpaged.entrypoints.openai.reasoning import (
    REASONING_PARSERS,
    check_reasoning_parser,
    detect_reasoning_parser,
    harmony_encoding,
    reasoning_reader,
)  # fmt: skip
from jaxpaged.entrypoints.serve import REASONING_PARSERS as FLAG_CHOICES
from jaxpaged.entrypoints.serve import build_parser
from jaxpaged.sampling_params import StructuredOutputsParams
from tests.reasoning_model import DEEPSEEK_TEMPLATE, HARMONY_TEMPLATE, QWEN3_TEMPLATE

OPEN, CLOSED, NONE = "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<|im_start|>assistant\n"


def _streamed(reader, text: str, cuts) -> tuple[str | None, str | None, list[dict]]:
    """Feed `text` cumulatively, cut at `cuts`; (reasoning, content) joined from the deltas, and the deltas."""
    deltas = []
    for end in [*cuts, len(text)]:
        deltas += reader.feed(text[:end])
    deltas += reader.finish(text)
    joined = {k: "".join(d.get(k, "") for d in deltas) or None for k in ("reasoning_content", "content")}
    return joined["reasoning_content"], joined["content"], deltas


QWEN3_CASES = [  # (prompt, output, reasoning, content)
    (NONE, "<think>\nsteps</think>\n\nAnswer.", "\nsteps", "\n\nAnswer."),
    (NONE, "Answer at once.", None, "Answer at once."),  # no <think>: all content
    (CLOSED, "Answer.", None, "Answer."),  # enable_thinking false: the template closed it
    (CLOSED, "A </think> B", None, "A </think> B"),  # no thinking to end: the marker is content
    (OPEN, "steps</think>Answer.", "steps", "Answer."),  # the template opened it
    (NONE, "<think>cut short", "cut short", None),  # max_tokens inside the thinking
]
DEEPSEEK_CASES = [
    (OPEN, "steps</think>Answer.", "steps", "Answer."),
    (OPEN, "<think>steps</think>Answer.", "steps", "Answer."),  # a <think> the model writes anyway is dropped
    (OPEN, "all thinking", "all thinking", None),
    (NONE, "steps</think>Answer.", "steps", "Answer."),  # everything before </think>, as vLLM
    (CLOSED, "Answer.", None, "Answer."),
]


@pytest.mark.parametrize(("name", "case"), [("qwen3", c) for c in QWEN3_CASES] + [("deepseek_r1", c) for c in DEEPSEEK_CASES])
def test_think_parsers_whole_and_streamed(name, case):
    prompt, output, reasoning, content = case
    assert reasoning_reader(name, prompt).parse(output) == (reasoning, content)
    for cuts in ([], range(1, len(output)), [3, 9, 11]):  # every character a delta; the markers cut in pieces
        got_reasoning, got_content, deltas = _streamed(reasoning_reader(name, prompt), output, cuts)
        assert (got_reasoning, got_content) == (reasoning, content), cuts
        assert all(len(d) == 1 and next(iter(d.values())) for d in deltas)  # one non-empty kind per delta
        assert "</think>" not in (got_reasoning or "") and "<think>" not in (got_reasoning or "")


def test_end_marker_split_across_deltas_is_held_back():
    reader = reasoning_reader("qwen3", NONE)
    assert reader.feed("<think>abc</th") == [{"reasoning_content": "abc"}]  # "</th" may begin the end marker
    assert reader.feed("<think>abc</think>\nok") == [{"content": "\nok"}]
    opening = reasoning_reader("qwen3", NONE)
    assert opening.feed("<th") == [] and opening.feed("<think>x") == [{"reasoning_content": "x"}]


@pytest.mark.parametrize(
    ("template", "want"),
    [(QWEN3_TEMPLATE, "qwen3"), (DEEPSEEK_TEMPLATE, "deepseek_r1"), (HARMONY_TEMPLATE, "gpt_oss"),
     ("{% for m in messages %}{{ m['content'] }}{% endfor %}", None), (None, None)],
)  # fmt: skip
def test_detection_from_the_chat_template(template, want):
    from jinja2 import Template

    prompt = Template(template).render(messages=[{"role": "user", "content": "x"}], add_generation_prompt=True) if template else None
    assert detect_reasoning_parser(template, prompt) == want
    if template is not None:
        assert detect_reasoning_parser({"default": template}, prompt) == want  # named templates


def test_flag_choices_and_unknown_names():
    assert FLAG_CHOICES == REASONING_PARSERS
    args = build_parser().parse_args(["--reasoning-parser", "deepseek_r1"])
    assert args.reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--reasoning-parser", "r1"])
    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3, deepseek_r1, gpt_oss"):
        check_reasoning_parser("r1")
    from jaxpaged.entrypoints.openai import ServerSettings

    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerSettings(served_model_names=["m"], reasoning_parser="think")
    ServerSettings(served_model_names=["m"], reasoning_parser="none")


def _harmony_or_skip():
    pytest.importorskip("openai_harmony", reason="openai-harmony (the harmony extra) is not installed")
    try:
        harmony_encoding()
    except ValueError as exc:
        pytest.skip(f"openai-harmony cannot load its o200k vocabulary here (offline: no litellm copy, no TIKTOKEN_ENCODINGS_BASE): {exc}")


HARMONY = ("<|channel|>analysis<|message|>Think first.<|end|><|start|>assistant<|channel|>final<|message|>"
           "Final answer.")  # fmt: skip


def test_gpt_oss_whole_and_streamed():
    _harmony_or_skip()
    assert reasoning_reader("gpt_oss").parse(HARMONY) == ("Think first.", "Final answer.")
    for cuts in ([], range(1, len(HARMONY)), [5, 20, 40]):
        reasoning, content, _ = _streamed(reasoning_reader("gpt_oss"), HARMONY, cuts)
        assert (reasoning, content) == ("Think first.", "Final answer."), cuts


def _calls(deltas: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments) of each call in tool_calls deltas: its opening (id, name), then its arguments' pieces."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.get("tool_calls", ()):
            if "id" in c:
                assert c["index"] not in calls and c["type"] == "function" and c["id"].startswith("call_")
                calls[c["index"]] = [c["function"]["name"], c["function"]["arguments"]]
            else:
                calls[c["index"]][1] += c["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]


def test_harmony_round_trip():
    """A conversation rendered by openai-harmony (system, developer with a function tool, user), the completions it
    renders for the assistant (analysis, then a call `to=functions.get_weather` in the role's header; after the
    tool's answer, a final message) read back by HarmonyReader, whole and streamed, as openai-harmony's own
    parse_messages_from_completion_tokens reads them."""
    _harmony_or_skip()
    import openai_harmony as h

    from jaxpaged.entrypoints.openai.reasoning import HarmonyReader

    enc = harmony_encoding()
    weather = h.ToolDescription.new("get_weather", "A city's weather", parameters={
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})  # fmt: skip
    messages = [
        h.Message.from_role_and_content(h.Role.SYSTEM, h.SystemContent.new()),
        h.Message.from_role_and_content(h.Role.DEVELOPER, h.DeveloperContent.new().with_function_tools([weather])),
        h.Message.from_role_and_content(h.Role.USER, "Weather in Oslo?"),
    ]
    prompt = enc.decode(enc.render_conversation_for_completion(h.Conversation.from_messages(messages), h.Role.ASSISTANT))
    assert "namespace functions" in prompt and "type get_weather" in prompt and prompt.endswith("<|start|>assistant")
    thought, args = "The user wants Oslo's weather: call get_weather.", '{"city": "Oslo"}'
    turn = [
        h.Message.from_role_and_content(h.Role.ASSISTANT, thought).with_channel("analysis"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, args).with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
    ]  # fmt: skip
    answer = [h.Message.from_role_and_content(h.Role.ASSISTANT, "3 degrees and snow.").with_channel("final")]
    tool = h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, "functions.get_weather"), '{"temp": 3}')
    tool = tool.with_recipient("assistant").with_channel("commentary")
    for done, completion, want in ((messages, turn, (thought, None, [("get_weather", args)])),
                                   ([*messages, *turn, tool], answer, (None, "3 degrees and snow.", []))):  # fmt: skip
        tokens = [t for m in completion for t in enc.render(m)]
        assert enc.decode(tokens[-1:]) == ("<|call|>" if want[2] else "<|end|>")
        # the model writes what follows the prompt's "<|start|>assistant"
        conversation = enc.render_conversation_for_completion(h.Conversation.from_messages(done), h.Role.ASSISTANT)
        assert enc.decode(conversation).endswith("<|start|>assistant") and enc.decode(tokens).startswith("<|start|>assistant")
        text = enc.decode(tokens).removeprefix("<|start|>assistant")
        oracle = enc.parse_messages_from_completion_tokens(enc.encode(text, allowed_special="all"), h.Role.ASSISTANT)
        assert [m.to_dict() for m in oracle] == [m.to_dict() for m in completion]
        for cuts in ([], range(1, len(text)), [7, 30, 90, 120]):
            reader = HarmonyReader(tools=True)
            reasoning, content, deltas = _streamed(reader, text, cuts)
            assert (reasoning, content, _calls(deltas)) == want, cuts
            assert [(c.name, c.arguments) for c in reader.calls] == want[2]
            assert (reader.reasoning, reader.content) == want[:2]


HARMONY_CALLS = [  # (output, reasoning, content, calls): calls in the channel's header or the role's, cut short
    (('<|channel|>analysis<|message|>Add.<|end|><|start|>assistant<|channel|>commentary to=functions.add '
      '<|constrain|>json<|message|>{"a": 2}<|call|>'), "Add.", None, [("add", '{"a": 2}')]),
    (('<|channel|>commentary to=functions.now json<|message|>{}<|call|><|start|>assistant to=functions.add'
      '<|channel|>commentary json<|message|>{"a": 1}'), None, None, [("now", "{}"), ("add", '{"a": 1}')]),
    ('<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a"', None, None, [("add", '{"a"')]),
    # a call in the analysis channel stays reasoning; a commentary message to no one is content
    (('<|channel|>analysis to=functions.add<|message|>{"a": 3}<|end|><|start|>assistant<|channel|>commentary<|message|>'
      'Calling.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>'), '{"a": 3}', "Calling.Done.", []),
]  # fmt: skip


@pytest.mark.parametrize("case", HARMONY_CALLS)
def test_harmony_calls_whole_and_streamed(case):
    _harmony_or_skip()
    from jaxpaged.entrypoints.openai.reasoning import HarmonyReader

    text, *want = case
    for cuts in ([], range(1, len(text)), [3, 40, 41, 60]):
        reasoning, content, deltas = _streamed(HarmonyReader(tools=True), text, cuts)
        assert [reasoning, content, _calls(deltas)] == want, cuts
    # without tools (tool_choice "none", or no tools) a call's arguments are content
    reasoning, content = HarmonyReader().parse(text)
    assert reasoning == want[0] and content == ((want[1] or "") + "".join(a for _, a in want[2]) or None)


def test_harmony_vocabulary_from_litellm_offline(monkeypatch):
    """o200k_base.tiktoken from litellm's wheel (what .ci/run installs): its SHA-256 is harmony's, openai-harmony
    loads it from there (TIKTOKEN_RS_CACHE_DIR only while it loads), and a copy with another hash is not used."""
    pytest.importorskip("openai_harmony", reason="openai-harmony (the harmony extra) is not installed")
    from jaxpaged.utils import harmony as reasoning  # the vocabulary's loader (reasoning.py re-exports it)

    folder = reasoning.bundled_vocabulary()
    if folder is None:
        pytest.skip("litellm (pip install --no-deps litellm) is not installed here")
    assert (folder / reasoning.BUNDLED_O200K[1].rsplit("/", 1)[1]).stat().st_size == 3613922
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.delenv("TIKTOKEN_RS_CACHE_DIR", raising=False)
    monkeypatch.setattr(reasoning, "_ENCODING", None)
    encoding = reasoning.harmony_encoding()
    assert "TIKTOKEN_RS_CACHE_DIR" not in os.environ
    assert encoding.encode("<|channel|>analysis<|message|>Hi", allowed_special="all") == [200005, 35644, 200008, 12194]
    monkeypatch.setattr(reasoning, "O200K_SHA256", "0" * 64)
    assert reasoning.bundled_vocabulary() is None


def test_gpt_oss_without_the_package_says_which_extra(monkeypatch):
    import sys

    from jaxpaged.utils import harmony as reasoning  # where the encoding is cached
    from jaxpaged.utils.extras import MissingExtraError

    monkeypatch.setitem(sys.modules, "openai_harmony", None)
    monkeypatch.setattr(reasoning, "_ENCODING", None)
    with pytest.raises(MissingExtraError, match=r"gpt_oss reasoning parser needs the openai_harmony package.*jaxpaged\[harmony\]"):
        check_reasoning_parser("gpt_oss")


# -- the grammar behind the thinking -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.cycle_model import EOS_ID
    from tests.reasoning_model import write_think_model

    tokenizer = AutoTokenizer.from_pretrained(str(write_think_model(tmp_path_factory.mktemp("think"))))
    return StructuredOutputManager(tokenizer, [EOS_ID], len(tokenizer))


def _allowed(state, manager) -> set[int]:
    row = np.zeros(-(-len(manager.tokenizer) // 32), np.int32)
    state.fill_bitmask(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return {int(t) for t in np.flatnonzero(bits) if t < len(manager.tokenizer)}


def test_thinking_closed():
    assert thinking_closed(CLOSED, "<think>", "</think>") and not thinking_closed(OPEN, "<think>", "</think>")
    assert not thinking_closed(NONE, "<think>", "</think>") and thinking_closed("x</think>", None, "</think>")


def test_the_grammar_starts_after_the_end_marker(manager):
    tok = manager.tokenizer
    params = StructuredOutputsParams(choice=["yes", "no"], reasoning_start="<think>", reasoning_end="</think>")
    everything = set(range(len(tok)))
    state = manager.new_state(params, tok.encode(NONE))
    assert isinstance(state, AfterReasoning) and state.thinking
    thinking = tok.encode("<think>Hmm, yes or no? </th", add_special_tokens=False)
    assert state.valid_prefix(thinking) == len(thinking)
    for t in thinking:
        assert _allowed(state, manager) == everything and state.accept(t) and not state.is_terminated
    rest = tok.encode("ink>", add_special_tokens=False)  # the marker ends in another token than it began
    view = state.after(rest)
    assert view.num_consumed == len(thinking) + len(rest) and _allowed(view, manager) != everything
    for t in rest:
        state.accept(t)
    assert not state.thinking and state.num_consumed == len(thinking) + len(rest)
    allowed = _allowed(state, manager)
    assert tok.encode("y", add_special_tokens=False)[0] in allowed and tok.encode("<think>", add_special_tokens=False)[0] not in allowed
    copy = state.copy()
    for t in tok.encode("yes", add_special_tokens=False):
        assert state.accept(t)
    assert state.is_terminated and not copy.is_terminated  # a beam's copy goes on alone
    closed = manager.new_state(params, tok.encode(CLOSED))  # enable_thinking false: the grammar from the start
    assert not closed.thinking and _allowed(closed, manager) != everything
    plain = manager.new_state(StructuredOutputsParams(choice=["yes", "no"]), tok.encode(NONE))
    assert not isinstance(plain, AfterReasoning)

"""The mistral (Magistral's [THINK]) and deepseek_v3 (DeepSeek-V3.1: thinking only when the template opened it)
reasoning parsers, whole and streamed at every cut, and their detection from the real chat templates' markers."""

from __future__ import annotations

import pytest

from jaxpaged.entrypoints.openai.reasoning import detect_reasoning_parser, reasoning_reader

# DeepSeek-V3.1's generation prompt: `<think>` with thinking on, `</think>` with it off (the default)
DS_ON, DS_OFF = "<｜User｜>2+2?<｜Assistant｜><think>", "<｜User｜>2+2?<｜Assistant｜></think>"
CASES = [  # (parser, prompt, output, reasoning, content)
    ("mistral", "[INST]2+2?[/INST]", "[THINK]Two and two.[/THINK]It is 4.", "Two and two.", "It is 4."),
    ("mistral", "[INST]2+2?[/INST]", "It is 4.", None, "It is 4."),  # no [THINK]: all content
    ("mistral", "[INST]2+2?[/INST]", "Hm. [THINK]steps", "steps", "Hm. "),  # cut short in the thinking
    ("mistral", "[INST]2+2?[/INST]", "4[/THINK] done", None, "4 done"),  # a stray end marker is dropped
    ("mistral", "[INST]2+2?[/INST][THINK]", "steps[/THINK]4", "steps", "4"),  # a prompt that opened it
    ("mistral", "[INST]x[/INST]", "a [THINK", None, "a [THINK"),
    ("deepseek_v3", DS_ON, "steps</think>It is 4.", "steps", "It is 4."),
    ("deepseek_v3", DS_ON, "all thinking", "all thinking", None),
    ("deepseek_v3", DS_OFF, "It is 4.", None, "It is 4."),
    ("deepseek_v3", DS_OFF, "<think>not parsed</think>4", None, "<think>not parsed</think>4"),  # thinking off
    ("deepseek_v3", "<｜User｜>x<｜Assistant｜>", "a</think>b", None, "a</think>b"),
]


@pytest.mark.parametrize(("parser", "prompt", "output", "reasoning", "content"), CASES)
def test_whole_and_streamed_agree(parser, prompt, output, reasoning, content):
    assert reasoning_reader(parser, prompt).parse(output) == (reasoning, content)
    for cuts in (range(1, len(output)), [2, 5, 7, 12]):
        reader, deltas = reasoning_reader(parser, prompt), []
        for end in [*cuts, len(output)]:
            deltas += reader.feed(output[:end])
        deltas += reader.finish(output)
        joined = ["".join(d.get(k, "") for d in deltas) or None for k in ("reasoning_content", "content")]
        assert joined == [reasoning, content] and (reader.reasoning, reader.content) == (reasoning, content)
        assert all(len(d) == 1 and next(iter(d.values())) for d in deltas)


MAGISTRAL = ('{%- set default_system_message = "First draft your thinking process (inner monologue) until you arrive at '
             'a response. Format your response using Markdown, and use LaTeX for any mathematical equations. Write both '
             'your thoughts and the response in the same language as the input.\\n\\nYour thinking process must follow '
             'the template below:[THINK]Your thoughts or/and draft, like working through an exercise on scratch paper.'
             '[/THINK]Here, provide a self-contained response." %}{{- bos_token }}[SYSTEM_PROMPT]{{ m }}[/SYSTEM_PROMPT]')
DEEPSEEK_V31 = ("{% if not thinking is defined %}{% set thinking = false %}{% endif %}{{ bos_token }}{%- for message in "
                "messages %}{{'<｜User｜>' + message['content']}}{%- endfor -%}{%- if add_generation_prompt %}"
                "{{'<｜Assistant｜>'}}{%- if not thinking %}{{'</think>'}}{%- else %}{{'<think>'}}{%- endif %}{% endif %}")


@pytest.mark.parametrize(("template", "want"), [(MAGISTRAL, "mistral"), (DEEPSEEK_V31, "deepseek_v3")])
def test_detection_from_the_chat_template(template, want):
    from jinja2 import Template

    prompt = Template(template).render(messages=[{"role": "user", "content": "x"}], add_generation_prompt=True, bos_token="")
    assert detect_reasoning_parser(template, prompt) == want

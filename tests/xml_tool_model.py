"""The cycle model (tests/cycle_model.py) taught Qwen3-Coder's XML tool calls: whole-word tokens and a successor
table whose greedy answer to a chat prompt is `CALL_TEXT` (some text, then a `<tool_call>` whose `days` parameter
is written as text and typed by the tool's schema), in a Qwen3-Coder-shaped chat template that shows the
`<function=...>`/`<parameter=...>` format, so the server picks the qwen3_coder parser by itself.
"""

from __future__ import annotations

from pathlib import Path

from tests.cycle_model import EOS_ID, VOCAB, successor, write_cycle_model

CALL_WORDS = ["Let me check.", "\n<tool_call>\n<function=weather>\n", "<parameter=city>\n", "Oslo", "\n</parameter>\n",
              "<parameter=days>\n", "3\n</parameter>\n</function>", "\n</tool_call>"]  # fmt: skip (each word once)
CALL_TEXT = "".join(CALL_WORDS)
CONTENT = "Let me check."
CALLS = [("weather", '{"city": "Oslo", "days": 3}')]  # days typed by the schema ("integer")
WORD_ID = {w: VOCAB + i for i, w in enumerate(CALL_WORDS)}
_NEXT = {ord("\n"): WORD_ID[CALL_WORDS[0]], WORD_ID[CALL_WORDS[-1]]: EOS_ID}
_NEXT.update({WORD_ID[a]: WORD_ID[b] for a, b in zip(CALL_WORDS, CALL_WORDS[1:])})

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}<function><name>{{ t['function']['name'] }}</name>"
    "</function>{% endfor %}\nReply in the format:\n<tool_call>\n<function=example_function_name>\n"
    "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_xml_tool_model(folder: Path) -> Path:
    return write_cycle_model(folder, words=CALL_WORDS, succ=lambda t: _NEXT.get(t, successor(t)), chat_template=CHAT_TEMPLATE)

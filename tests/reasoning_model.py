"""The cycle model (tests/cycle_model.py) taught to think: whole-word tokens and a successor table whose greedy
answer to a chat prompt is `<think>` reasoning `</think>` and an answer, in Qwen3- and DeepSeek-R1-shaped chat
templates (the server detects qwen3 and deepseek_r1 from them), and a gpt-oss harmony one.

After the Qwen3 template's generation prompt (its last token is "\\n") the model writes `QWEN3_TEXT`: `<think>`,
the thinking (with a Hermes tool call in it, which must not be read as one), `</think>`, "\\n\\n" and the answer,
then EOS. `enable_thinking` false in chat_template_kwargs makes the template close the thinking itself (the
prompt ends "</think>\\n\\n"), so the model answers at once. The DeepSeek-R1 template's generation prompt ends with
`<think>`, so the model writes the rest of the same text without it (`DEEPSEEK_TEXT`). The harmony model writes
an analysis message and then a final one, its markers as words (ordinary tokens, so they stay in the text).
"""

from __future__ import annotations

import itertools
from pathlib import Path

from tests.cycle_model import EOS_ID, VOCAB, successor, write_cycle_model

THINKING = ["Let me think.", ' Maybe <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>']
ANSWER = "The answer is 4."
THINK_WORDS = ["<think>", *THINKING, "</think>", "\n\n", ANSWER]
REASONING = "".join(THINKING)
QWEN3_TEXT = "".join(THINK_WORDS)
DEEPSEEK_TEXT = "".join(THINK_WORDS[1:])
CONTENT = "\n\n" + ANSWER  # after </think>, as the model wrote it

HARMONY_WORDS = ["<|channel|>analysis<|message|>", "Think first.", "<|end|><|start|>assistant<|channel|>final<|message|>",
                 "Final answer."]  # fmt: skip
HARMONY_REASONING, HARMONY_CONTENT = "Think first.", "Final answer."

_TOOLS = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n"
    'Call one with <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n{% endif %}'
)
_MESSAGES = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
QWEN3_TEMPLATE = (
    _TOOLS + _MESSAGES + "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
DEEPSEEK_TEMPLATE = _TOOLS + _MESSAGES + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}"
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def _successor(words: list[str], first_after: int):
    ids = {w: VOCAB + i for i, w in enumerate(words)}
    table = {first_after: ids[words[0]], ids[words[-1]]: EOS_ID}
    table.update({ids[a]: ids[b] for a, b in itertools.pairwise(words)})
    return lambda token: table.get(token, successor(token))


def write_think_model(folder: Path, template: str = QWEN3_TEMPLATE) -> Path:
    """QWEN3_TEMPLATE or DEEPSEEK_TEMPLATE: "\\n" (the generation prompt's end) starts the thinking."""
    return write_cycle_model(folder, words=THINK_WORDS, succ=_successor(THINK_WORDS, ord("\n")), chat_template=template)


def write_harmony_model(folder: Path) -> Path:
    """The generation prompt's "t" (of `assistant`) starts the analysis message."""
    return write_cycle_model(folder, words=HARMONY_WORDS, succ=_successor(HARMONY_WORDS, ord("t")),
                             chat_template=HARMONY_TEMPLATE)  # fmt: skip

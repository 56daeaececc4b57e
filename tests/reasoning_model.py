"""The cycle model (tests/cycle_model.py) taught to think: whole-word tokens and a successor table whose greedy
answer to a chat prompt is `<think>` reasoning `</think>` and an answer, in Qwen3- and DeepSeek-R1-shaped chat
templates (the server detects qwen3 and deepseek_r1 from them), and a gpt-oss harmony one.

After the Qwen3 template's generation prompt (its last token is "\\n") the model writes `QWEN3_TEXT`: `<think>`,
the thinking (with a Hermes tool call in it, which must not be read as one), `</think>`, "\\n\\n" and the answer,
then EOS. `enable_thinking` false in chat_template_kwargs makes the template close the thinking itself (the
prompt ends "</think>\\n\\n"), so the model answers at once. The DeepSeek-R1 template's generation prompt ends with
`<think>`, so the model writes the rest of the same text without it (`DEEPSEEK_TEXT`). The harmony model writes
an analysis message and then a final one ended by `<|return|>`, its markers as words (ordinary tokens, so they
stay in the text); with `tools=True` the analysis message is followed by a call of `add`, a commentary message
`to=functions.add` whose arguments come in two tokens, ended by `<|call|>`. As in gpt-oss's checkpoints,
`<|return|>` and `<|call|>` are end-of-sequence tokens (config.json's eos_token_id), so the text ends with them.
"""

from __future__ import annotations

import itertools
import json
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
                 "Final answer.", "<|return|>"]  # fmt: skip
HARMONY_REASONING, HARMONY_CONTENT = "Think first.", "Final answer."
HARMONY_CALL_WORDS = ["<|channel|>analysis<|message|>", "Think first.",
                      "<|end|><|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>",
                      '{"a": ', "2}", "<|call|>"]  # fmt: skip
HARMONY_CALL = ("add", '{"a": 2}')  # (name, arguments)

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
    "{% if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {\n{% for t in tools %}"
    "type {{ t['function']['name'] }} = (_: any) => any;\n{% endfor %}} // namespace functions<|end|>{% endif %}"
    "{% for m in messages %}<|start|>{{ m['role'] }}{% if m['role'] == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m['content'] }}<|end|>{% endfor %}"
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


def write_harmony_model(folder: Path, tools: bool = False) -> Path:
    """The generation prompt's "t" (of `assistant`) starts the analysis message; `<|return|>` and `<|call|>` end."""
    words = HARMONY_CALL_WORDS if tools else HARMONY_WORDS
    folder = write_cycle_model(folder, words=words, succ=_successor(words, ord("t")), chat_template=HARMONY_TEMPLATE)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = [EOS_ID, VOCAB + len(words) - 1]  # the last word: <|return|> or <|call|>
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder

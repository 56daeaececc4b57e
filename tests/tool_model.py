"""The cycle model (tests/cycle_model.py) taught to call tools: whole-word tokens and a successor table whose
greedy answer to a chat prompt is a Hermes tool call, in a Qwen2.5-shaped chat template.

After the generation prompt (its last token is "\\n") the model writes `CALL_TEXT`, one word a token, then EOS:
some text, then two `<tool_call>` blocks, the first one's arguments spread over three tokens (so a stream sends
them in pieces). After ":" (an assistant message the template leaves open, with add_generation_prompt false) it
writes " Sunny." and EOS: a plain answer. Other tokens follow the byte cycle. The template lists the tools' names
in a system turn and shows the `<tool_call>` format, so the server picks the hermes parser by itself, and a
prompt with tools is longer than one without.
"""

from __future__ import annotations

from pathlib import Path

from tests.cycle_model import EOS_ID, VOCAB, successor, write_cycle_model

CALL_WORDS = [
    "Let me check.", "\n<tool_call>\n", '{"name": "weather", ', '"arguments": {', '"city": "Oslo", ', '"days": 3}',
    "}\n</tool_call>\n", '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
]  # fmt: skip
CALL_TEXT = "".join(CALL_WORDS)
CONTENT = "Let me check."
CALLS = [("weather", '{"city": "Oslo", "days": 3}'), ("now", "{}")]  # (name, arguments) as the model wrote them
TEXT_WORDS = [" Sunny."]
WORDS = CALL_WORDS + TEXT_WORDS
WORD_ID = {w: VOCAB + i for i, w in enumerate(WORDS)}

_NEXT = {ord("\n"): WORD_ID[CALL_WORDS[0]], ord(":"): WORD_ID[" Sunny."], WORD_ID[" Sunny."]: EOS_ID}
_NEXT.update({WORD_ID[a]: WORD_ID[b] for a, b in zip(CALL_WORDS, CALL_WORDS[1:])})
_NEXT[WORD_ID[CALL_WORDS[-1]]] = EOS_ID

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n"
    'Call one with <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant\n"
    "{% for c in m['tool_calls'] %}<tool_call>\n{{ c['function'] | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif loop.last and m['role'] == 'assistant' and not add_generation_prompt %}<|im_start|>assistant\n{{ m['content'] }}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tool_successor(token: int) -> int:
    return _NEXT.get(token, successor(token))


def write_tool_model(folder: Path) -> Path:
    return write_cycle_model(folder, words=WORDS, succ=tool_successor, chat_template=CHAT_TEMPLATE)

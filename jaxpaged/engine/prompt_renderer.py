"""Text prompts and text-only conversations templated and tokenized away from the engine's thread.

A long conversation takes milliseconds to render and tokenize (18k tokens: 10-20 ms on a CPU core), a few GPU steps
that every running request would wait through if the engine's thread did it. AsyncLLMEngine has it done in a worker
thread instead, with a copy of the tokenizer of its own: the engine's thread keeps decoding with the original (a
fast tokenizer is not to be used by two threads at once), and a lock keeps the copy to one thread at a time. What comes
out is the prompt as the engine would have made it: {"prompt": text, "prompt_token_ids": ids}.
"""

from __future__ import annotations

import copy
import threading

from jaxpaged.utils.text import ChatPrompt, render_chat_prompt


class PromptRenderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._copy = None
        self._lock = threading.Lock()

    def render(self, prompt):
        """A string, {"prompt": str} or a ChatPrompt without images as {"prompt": text, "prompt_token_ids": ids} (a
        conversation's text: its rendering, as the engine reports it); any other prompt as it is."""
        from jaxpaged.multimodal.engine import has_image_parts

        chat = isinstance(prompt, ChatPrompt) and not has_image_parts(prompt.messages)
        text = prompt.get("prompt") if isinstance(prompt, dict) and prompt.keys() == {"prompt"} else prompt
        if not chat and not isinstance(text, str):
            return prompt
        with self._lock:
            if self._copy is None:
                self._copy = copy.deepcopy(self.tokenizer)
            if chat:
                ids = render_chat_prompt(self._copy, prompt)
                text = self._copy.decode(ids, skip_special_tokens=False)
            else:
                ids = list(self._copy.encode(text))
        return {"prompt": text, "prompt_token_ids": ids}

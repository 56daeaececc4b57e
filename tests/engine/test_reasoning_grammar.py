"""An output constraint behind a reasoning model's thinking, in the engine (no server): with
StructuredOutputsParams.reasoning_end the think model (tests/reasoning_model.py) thinks as it likes and the grammar
starts after `</think>`; without it the same constraint holds from the first token; speculative decoding (n-gram
proposals, cut where the grammar refuses them) gives the same tokens; a prompt that closed the thinking is
constrained at once.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams
from tests.reasoning_model import QWEN3_TEXT, write_think_model

USER = [{"role": "user", "content": "2 + 2?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"], "additionalProperties": False}
THOUGHT = QWEN3_TEXT[: QWEN3_TEXT.index("</think>") + len("</think>")]
ENGINE = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 8,
          "num_kv_blocks": 256, "log_level": "WARNING"}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_think_model(tmp_path_factory.mktemp("think")))


def _params(**markers) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA, **markers))


MARKERS = {"reasoning_start": "<think>", "reasoning_end": "</think>"}


def _answer(text: str) -> dict:
    answer = json.loads(text)
    jsonschema.validate(answer, SCHEMA)
    return answer


def test_the_grammar_waits_for_the_thinking(model_dir):
    llm = LLM(model_dir, **ENGINE)
    behind, plain = (llm.chat(USER, p, use_tqdm=False)[0].outputs[0] for p in (_params(**MARKERS), _params()))
    assert behind.text.startswith(THOUGHT) and behind.finish_reason == "stop"
    _answer(behind.text[len(THOUGHT) :])
    assert "<think>" not in plain.text  # constrained from the first token, the thinking cannot start
    _answer(plain.text)
    off = llm.chat(USER, _params(**MARKERS), use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert off[0].prompt_token_ids != llm.chat(USER, _params(**MARKERS), use_tqdm=False)[0].prompt_token_ids
    _answer(off[0].outputs[0].text)  # the prompt closed the thinking: constrained at once
    n = llm.chat(USER, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=120,
                                      structured_outputs=StructuredOutputsParams(json=SCHEMA, **MARKERS)), use_tqdm=False)  # fmt: skip
    for out in n[0].outputs:  # sampled: whatever the thinking, the answer after </think> follows the schema
        if out.finish_reason == "stop" and "</think>" in out.text:
            _answer(out.text.split("</think>", 1)[1])
    spec = LLM(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, **ENGINE)
    assert spec.chat(USER, _params(**MARKERS), use_tqdm=False)[0].outputs[0].text == behind.text

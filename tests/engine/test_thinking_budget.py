"""thinking_token_budget (vLLM's): the think model (tests/reasoning_model.py) writes `<think>`, two thinking tokens,
`</think>` and its answer; with a budget of k its thinking stops after k tokens, `</think>` forced, and the answer
follows; the DeepSeek-R1 template's prompt opens the thinking itself (counted from the first output token); a prompt
that closed the thinking is left alone; with structured outputs the grammar still starts after the forced marker;
n > 1 and a model without markers (a ValueError naming the field); through the server's chat completions and
Anthropic's messages (thinking.budget_tokens)."""

from __future__ import annotations

import pytest
from jaxpaged import LLM, SamplingParams
from jaxpaged.utils.text import ChatPrompt

from tests.reasoning_model import ANSWER, DEEPSEEK_TEMPLATE, QWEN3_TEXT, write_think_model

USER = [{"role": "user", "content": "2 + 2?"}]
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 8, "num_kv_blocks": 64, "log_level": "WARNING"}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return LLM(str(write_think_model(tmp_path_factory.mktemp("think"))), **ENGINE)


def _chat(llm, budget, n=1, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=12, thinking_token_budget=budget, n=n, **kwargs)
    (out,) = llm.generate([ChatPrompt(USER)], params, use_tqdm=False)
    return [o.text for o in out.outputs]


def test_the_budget_forces_the_end_marker(qwen3):
    assert _chat(qwen3, None) == [QWEN3_TEXT]  # unbudgeted: the model's own thinking
    assert _chat(qwen3, 10) == [QWEN3_TEXT]  # a budget it does not reach changes nothing
    assert _chat(qwen3, 1) == ["<think>Let me think.</think>\n\n" + ANSWER]
    assert _chat(qwen3, 0, n=2) == ["<think></think>\n\n" + ANSWER] * 2
    stats = qwen3.get_stats()
    assert stats["num_compiles_after_warmup"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_the_grammar_starts_after_the_forced_marker(qwen3):
    pytest.importorskip("llguidance")
    from jaxpaged.sampling_params import StructuredOutputsParams

    answer = StructuredOutputsParams(choice=["Four.", "4"], reasoning_start="<think>", reasoning_end="</think>")
    assert _chat(qwen3, 1, structured_outputs=answer) in (["<think>Let me think.</think>Four."], ["<think>Let me think.</think>4"])


def test_a_prompt_that_closed_the_thinking_is_left_alone(qwen3):
    params = SamplingParams(temperature=0.0, max_tokens=12, thinking_token_budget=0)
    prompt = ChatPrompt(USER, template_kwargs={"enable_thinking": False})  # the template writes <think>\n\n</think>
    (out,) = qwen3.generate([prompt], params, use_tqdm=False)
    (free,) = qwen3.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert out.outputs[0].text == free.outputs[0].text


def test_a_prompt_that_opens_the_thinking_counts_from_the_first_token(tmp_path):
    llm = LLM(str(write_think_model(tmp_path, DEEPSEEK_TEMPLATE)), **ENGINE)
    assert _chat(llm, 1) == ["Let me think.</think>\n\n" + ANSWER]


def test_a_model_without_thinking_markers_is_refused(tmp_path):
    from tests.cycle_model import write_cycle_model

    llm = LLM(str(write_cycle_model(tmp_path)), **ENGINE)
    with pytest.raises(ValueError, match="thinking_token_budget"):
        llm.generate(["hello"], SamplingParams(max_tokens=2, thinking_token_budget=4), use_tqdm=False)
    with pytest.raises(ValueError, match="thinking_token_budget must be >= 0"):
        SamplingParams(thinking_token_budget=-1)

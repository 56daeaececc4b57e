"""The offline API as a vLLM user calls it (LLM.generate, LLM.chat), on the tiny cycle model: its greedy output is
known in advance (tests/cycle_model.py), so each check compares with exact text."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, SamplingParams
from tests.cycle_model import CHAT_TEMPLATE, greedy_text


@pytest.fixture(scope="module")
def llm(cycle_model_dir):
    return LLM(str(cycle_model_dir), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, block_size=8,
               max_model_len=512, log_level="WARNING")  # fmt: skip


GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def _rendered(messages, add_generation_prompt=True) -> str:
    import jinja2

    return jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt)


def test_chat_outputs_report_the_rendered_prompt(llm):
    """As vLLM's LLM.chat: each RequestOutput's `prompt` is its conversation's templated text (it was None)."""
    one = [{"role": "user", "content": "ab"}]
    two = [{"role": "system", "content": "x"}, {"role": "user", "content": "ж"}]
    outs = llm.chat([one, two], GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for conversation, out in zip([one, two], outs, strict=True):
        assert out.prompt == _rendered(conversation)
        assert out.prompt_token_ids == tokenizer.encode(out.prompt, add_special_tokens=False)
        assert out.outputs[0].text == greedy_text(out.prompt_token_ids[-1], 6)
    (single,) = llm.chat(one, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert single.prompt == _rendered(one, add_generation_prompt=False)


def test_chat_continue_final_message(llm):
    """vLLM's continue_final_message: the prompt ends inside the last assistant message, which the output continues."""
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "é日🚀"}]
    five = SamplingParams(temperature=0.0, max_tokens=5)
    (out,) = llm.chat(conversation, five, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\né日🚀"
    assert out.outputs[0].text == greedy_text("🚀".encode()[-1], 5) == "ж ab"  # the cycle goes on after 🚀
    with pytest.raises(ValueError, match="continue_final_message"):  # vLLM refuses both at once
        llm.chat(conversation, GREEDY, use_tqdm=False, continue_final_message=True)
    assert llm.chat(conversation[:1], GREEDY, use_tqdm=False)[0].outputs[0].text == greedy_text(ord("\n"), 6)


def test_chat_text_content_parts(llm):
    """OpenAI-style text parts, as vLLM's LLM.chat takes them: joined by newlines for a template that reads a string
    (the cycle model's, like SmolLM2's, concatenates the content; a list made it fail)."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "ж"}]}]
    (out,) = llm.chat(parts, GREEDY, use_tqdm=False)
    assert out.prompt == _rendered([{"role": "user", "content": "ab\nж"}])
    assert out.outputs[0].text == greedy_text(out.prompt_token_ids[-1], 6)
    assert parts[0]["content"][0] == {"type": "text", "text": "ab"}  # the caller's messages are left as they were


@pytest.mark.parametrize("min_tokens", [513, 2**31, 2**40])
def test_min_tokens_past_the_context_is_refused_and_serving_continues(llm, min_tokens):
    """With max_tokens=None SamplingParams cannot bound min_tokens: one past max_model_len is a ValueError naming it
    when the request is added (one past int32 was an OverflowError inside the step loop)."""
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate(["ab", "ab"], SamplingParams(max_tokens=None, min_tokens=min_tokens), use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert llm.generate("ab", GREEDY, use_tqdm=False)[0].outputs[0].text == greedy_text(ord("b"), 6)
    capped = llm.generate("ab", SamplingParams(max_tokens=None, min_tokens=512, temperature=0.0), use_tqdm=False)[0]
    assert len(capped.outputs[0].token_ids) == 510 and capped.outputs[0].finish_reason == "length"  # as vLLM: the room


def test_truncate_prompt_tokens_keeps_the_prompts_tail(llm):
    """vLLM's truncate_prompt_tokens: the last k prompt tokens run (the cycle model reads only the last one, so the
    text is that of the whole prompt), `prompt` stays the text given; -1 keeps up to max_model_len."""
    prompt = "hello there"
    ids = llm.get_tokenizer().encode(prompt, add_special_tokens=False)
    (cut,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, truncate_prompt_tokens=3), use_tqdm=False)
    assert cut.prompt == prompt and cut.prompt_token_ids == ids[-3:]
    assert cut.outputs[0].text == greedy_text(ids[-1], 5)
    (whole,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, truncate_prompt_tokens=-1),
                            use_tqdm=False)  # fmt: skip
    assert whole.prompt_token_ids == ids
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_detokenize_false_gives_token_ids_only(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, detokenize=False, logprobs=2, prompt_logprobs=1)
    (out,) = llm.generate(["ab"], params, use_tqdm=False)
    (texted,) = llm.generate(["ab"], SamplingParams(temperature=0.0, max_tokens=6, logprobs=2), use_tqdm=False)
    assert out.outputs[0].text == "" and out.outputs[0].token_ids == texted.outputs[0].token_ids
    assert all(lp.decoded_token is None for step in out.outputs[0].logprobs for lp in step.values())
    assert all(lp.decoded_token is None for step in out.prompt_logprobs[1:] for lp in step.values())
    assert all(lp.decoded_token is not None for step in texted.outputs[0].logprobs for lp in step.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])


def test_spaces_between_special_tokens_is_accepted_as_transformers_reads_it(llm):
    """A fast tokenizer's decode has no such option (transformers and vLLM ignore it there): the text is the same."""
    params = SamplingParams(temperature=0.0, max_tokens=6, skip_special_tokens=False, spaces_between_special_tokens=False)
    (out,) = llm.generate(["ab"], params, use_tqdm=False)
    assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids, skip_special_tokens=False)
    with pytest.raises(ValueError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens="no")


def test_use_tqdm_takes_a_progress_bar_class(llm):
    """vLLM's use_tqdm may be a tqdm-like class (tqdm.notebook.tqdm in a notebook): it draws the bar."""
    made = []

    class Bar:
        def __init__(self, **kwargs):
            made.append(kwargs)
            self.n = 0

        def update(self, k):
            self.n += k

        def close(self):
            made.append(self.n)

    llm.generate(["ab", "cd"], GREEDY, use_tqdm=Bar)
    assert made[0]["total"] == 2 and made[-1] == 2


def test_sampling_params_of_the_wrong_type_say_so(llm):
    with pytest.raises(ValueError, match=r"sampling_params must be a SamplingParams .*got dict"):
        llm.generate("ab", {"max_tokens": 3}, use_tqdm=False)
    assert llm.generate("ab", GREEDY, use_tqdm=False)[0].outputs[0].text == greedy_text(ord("b"), 6)


def test_loading_and_compiling_bars_follow_the_log_level(cycle_model_dir, tmp_path, capfd):
    """--quiet and log_level="WARNING" hide the loader's and the warm-up's progress bars; INFO shows them."""
    kwargs = dict(dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, block_size=8, max_model_len=64,
                  cache_dir=str(tmp_path))  # fmt: skip
    capfd.readouterr()
    LLM(str(cycle_model_dir), log_level="WARNING", **kwargs)
    quiet = capfd.readouterr().err
    LLM(str(cycle_model_dir), log_level="INFO", **kwargs)
    loud = capfd.readouterr().err
    assert "Loading weights" not in quiet and "Compiling step buckets" not in quiet
    assert "Loading weights" in loud and "Compiling step buckets" in loud


def test_compiles_on_another_thread_are_not_the_engines(llm):
    """A trainer compiling beside the engine (another thread) adds nothing to num_compiles_after_warmup; the count
    is of the lowerings the engine's own steps cause (test_startup.py checks that those count)."""
    import threading

    import jax
    import jax.numpy as jnp

    stop, compiled = threading.Event(), []

    def trainer():
        width = 1
        while not stop.is_set():
            width += 1
            jax.jit(lambda x: x * 2 + 1)(jnp.ones(width)).block_until_ready()  # a new shape: a new lowering
            compiled.append(width)

    before = llm.get_stats()["num_compiles_after_warmup"]
    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        for _ in range(3):
            llm.generate(["ab", "cd"], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    finally:
        stop.set()
        thread.join()
    assert len(compiled) > 0
    assert llm.get_stats()["num_compiles_after_warmup"] == before


@pytest.mark.parametrize("ids", [[1.5, 2], [True, 3], [None], "ab", [[1, 2]], 7])
def test_prompt_token_ids_must_be_ints(llm, ids):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert llm.generate({"prompt_token_ids": [ord("a")]}, GREEDY, use_tqdm=False)[0].outputs[0].text == greedy_text(ord("a"), 6)

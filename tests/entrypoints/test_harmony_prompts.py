"""GPT-OSS's chat prompts rendered by openai-harmony (jaxpaged/utils/harmony.py), not by a chat template: the ids
the server hands the engine for a conversation with a system message, a user message, tools, an earlier assistant
turn with its reasoning and a tool call, and the tool's result are openai-harmony's own rendering of the equivalent
Conversation built here message by message; reasoning_effort reaches the system message; a bad one is a 400 naming
it; LLM.chat renders the same ids; harmony's `<|return|>` and `<|call|>` are the engine's end-of-sequence ids. The model is a tiny random
GPT-OSS with GPT-OSS's vocabulary (tests/harmony_model.py), served in-process and called with the openai client.
"""

from __future__ import annotations

import asyncio
import datetime

import pytest

pytest.importorskip("openai_harmony", reason="openai-harmony (the harmony extra) is not installed")

SERVED = "gpt-oss-tiny"
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
}}]  # fmt: skip
MESSAGES = [
    {"role": "system", "content": "Answer with one number."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": None, "reasoning_content": "I should call add.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "4"},
]  # fmt: skip


def _expected(effort: str, date: str) -> list[int]:
    """openai-harmony's rendering of MESSAGES, built here with its own classes."""
    import openai_harmony as h

    from jaxpaged.utils.harmony import harmony_encoding

    system = (
        h.SystemContent.new()
        .with_reasoning_effort({"low": h.ReasoningEffort.LOW, "high": h.ReasoningEffort.HIGH}[effort])
        .with_conversation_start_date(date)
    )
    fn = TOOLS[0]["function"]
    developer = (
        h.DeveloperContent.new()
        .with_instructions("Answer with one number.")
        .with_function_tools([h.ToolDescription.new(fn["name"], fn["description"], parameters=fn["parameters"])])
    )
    conversation = h.Conversation.from_messages([
        h.Message.from_role_and_content(h.Role.SYSTEM, system),
        h.Message.from_role_and_content(h.Role.DEVELOPER, developer),
        h.Message.from_role_and_content(h.Role.USER, "What is 2 + 2?"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "I should call add.").with_channel("analysis"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, '{"a": 2, "b": 2}').with_channel("commentary")
        .with_recipient("functions.add").with_content_type("<|constrain|>json"),
        h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, "functions.add"), "4")
        .with_recipient("assistant").with_channel("commentary"),
    ])  # fmt: skip
    return list(harmony_encoding().render_conversation_for_completion(conversation, h.Role.ASSISTANT))


def _today_expected(effort: str, got: list[int]) -> list[int]:
    """The expected ids for today's date (or yesterday's, when the day turned during the request)."""
    today = datetime.date.today()
    options = [_expected(effort, d.isoformat()) for d in (today, today - datetime.timedelta(days=1))]
    return got if got in options else options[0]


def _encoding_or_skip():
    from jaxpaged.utils.harmony import harmony_encoding

    try:
        return harmony_encoding()
    except ValueError as exc:
        pytest.skip(f"openai-harmony cannot load its o200k vocabulary here (offline: no litellm copy): {exc}")


def test_renderer_maps_developer_parts_and_earlier_answers():
    """No tools: the developer message carries only the instructions (a developer message's text parts), the
    system message leaves out the commentary channel; an earlier answer is a final message; a tool result that
    answers no call is refused naming messages."""
    import openai_harmony as h

    from jaxpaged.utils.harmony import render_harmony_prompt

    encoding = _encoding_or_skip()
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "terse."}]},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]  # fmt: skip
    got = render_harmony_prompt(messages, reasoning_effort="low", start_date="2026-01-02")
    system = (h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort.LOW).with_conversation_start_date("2026-01-02")
              .with_channel_config(h.ChannelConfig.require_channels(["analysis", "final"])))  # fmt: skip
    conversation = h.Conversation.from_messages([
        h.Message.from_role_and_content(h.Role.SYSTEM, system),
        h.Message.from_role_and_content(h.Role.DEVELOPER, h.DeveloperContent.new().with_instructions("Be terse.")),
        h.Message.from_role_and_content(h.Role.USER, "Hi"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "Hello.").with_channel("final"),
        h.Message.from_role_and_content(h.Role.USER, "Bye"),
    ])  # fmt: skip
    assert got == list(encoding.render_conversation_for_completion(conversation, h.Role.ASSISTANT))
    assert "# Valid channels: analysis, final." in encoding.decode(got)
    with pytest.raises(ValueError, match="messages: a tool message must answer"):
        render_harmony_prompt(
            [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "nope", "content": "1"}]
        )
    with pytest.raises(ValueError, match="reasoning_effort must be one of"):
        render_harmony_prompt(messages, reasoning_effort="minimal")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    pytest.importorskip("torch")
    from jaxpaged import LLM
    from tests.harmony_model import harmony_tokenizer, write_gpt_oss_harmony_model

    _encoding_or_skip()
    tokenizer = harmony_tokenizer()
    if tokenizer is None:
        pytest.skip("litellm's o200k_base.tiktoken (pip install --no-deps litellm) is not installed here")
    folder = write_gpt_oss_harmony_model(tmp_path_factory.mktemp("gpt_oss_harmony"), tokenizer)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=2, max_num_batched_tokens=64, block_size=8, num_kv_blocks=128,
              precompile=False, log_level="WARNING")  # fmt: skip
    return llm


def _serve(llm, calls):
    """The app in-process over the engine, its add_request recording each prompt's ids as the engine holds them."""
    from jaxpaged.engine.async_engine import AsyncLLMEngine
    from jaxpaged.entrypoints.openai import ServerSettings, build_app

    engine = llm.engine
    original = engine.add_request

    def add_request(request_id, prompt, *args, **kwargs):
        rid = original(request_id, prompt, *args, **kwargs)
        calls.append((prompt, engine.get_prompt_token_ids(rid)))
        return rid

    engine.add_request = add_request
    async_engine = AsyncLLMEngine(engine)
    return async_engine, build_app(async_engine, ServerSettings([SERVED]))


def test_server_renders_the_conversation_with_openai_harmony(gpt_oss):
    import httpx
    import openai

    from jaxpaged.utils.harmony import harmony_encoding
    from jaxpaged.utils.text import ChatPrompt

    llm = gpt_oss
    assert llm.engine.harmony
    assert {200002, 200012} <= set(llm.engine.eos_token_ids)  # <|return|> from config.json, <|call|> from harmony
    calls: list = []
    async_engine, app = _serve(llm, calls)
    async_engine.start()

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="unused", http_client=http, max_retries=0)
            done = await client.chat.completions.create(
                model=SERVED, messages=MESSAGES, tools=TOOLS, reasoning_effort="high", max_tokens=3, temperature=0
            )
            with pytest.raises(openai.BadRequestError) as bad:
                await client.chat.completions.create(
                    model=SERVED, messages=MESSAGES, reasoning_effort="extreme", max_tokens=3
                )
            low = await client.chat.completions.create(
                model=SERVED, messages=MESSAGES[1:2], reasoning_effort="low", max_tokens=2, temperature=0
            )
            return done, bad.value, low

    try:
        done, bad, low = asyncio.run(main())
    finally:
        async_engine.shutdown()
        del llm.engine.add_request
    # (1) the engine's prompt: openai-harmony's rendering of the same conversation, the effort in its system message
    (prompt, ids), (_, low_ids) = calls
    assert isinstance(prompt, ChatPrompt) and prompt.reasoning_effort == "high"
    assert ids == _today_expected("high", ids)
    text = harmony_encoding().decode(ids)
    assert "Reasoning: high" in text and text.endswith("<|start|>assistant")
    assert "to=functions.add<|channel|>commentary <|constrain|>json<|message|>" in text  # the earlier call
    assert "<|start|>functions.add to=assistant<|channel|>commentary<|message|>4<|end|>" in text  # its result
    assert done.usage.prompt_tokens == len(ids)
    # (2) the answer is read by the gpt_oss parser, chosen for a harmony-rendered model without the flag (random
    # weights write no harmony message: the fields are there, empty; test_reasoning_api.py reads real ones)
    (choice,) = done.choices
    assert choice.finish_reason == "length" and done.usage.completion_tokens == 3
    assert "reasoning_content" in choice.message.model_extra and choice.message.tool_calls == []
    # without tools the system message leaves out the commentary channel, and says low
    low_text = harmony_encoding().decode(low_ids)
    assert "Reasoning: low" in low_text and "Valid channels: analysis, final." in low_text
    assert low.usage.prompt_tokens == len(low_ids)
    # (3) a bad effort: a 400 in OpenAI's format naming the parameter
    assert bad.status_code == 400
    assert bad.body["param"] == "reasoning_effort" and "low, medium, high" in bad.body["message"]


def test_llm_chat_renders_the_same_ids(gpt_oss):
    """LLM.chat goes through the same renderer; the effort from chat_template_kwargs, as gpt-oss's template takes it."""
    llm = gpt_oss
    from jaxpaged import SamplingParams

    (out,) = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False, tools=TOOLS,
                      chat_template_kwargs={"reasoning_effort": "high"})  # fmt: skip
    assert out.prompt_token_ids == _today_expected("high", out.prompt_token_ids)
    with pytest.raises(ValueError, match="reasoning_effort must be one of low, medium, high"):
        llm.chat(MESSAGES, use_tqdm=False, chat_template_kwargs={"reasoning_effort": "max"})

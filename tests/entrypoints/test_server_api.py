"""The server through the official openai client: completions, chat, streaming, n, seeds, logprobs, load."""

from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest

from tests.conftest import CYCLE_MODEL
from tests.cycle_model import CYCLE, CYCLE_TEXT, MARGIN, VOCAB, greedy_bytes, greedy_text

NL = ord("\n")  # the chat template ends with "assistant\n"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _last_token(prompt: str) -> int:
    return prompt.encode("utf-8")[-1]  # the cycle model's tokens are bytes


def test_models_lists_every_served_name(client):
    assert [m.id for m in client.models.list().data] == [CYCLE_MODEL, "other-name"]


def test_version_and_ping_as_vllm(server):
    from jaxpaged import __version__

    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{server.url}/ping").status_code == 200


def test_completion_greedy_text_usage_and_ids(client):
    r = client.completions.create(model=CYCLE_MODEL, prompt="hello", max_tokens=20, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.created > 0 and r.model == CYCLE_MODEL
    (choice,) = r.choices
    assert choice.text == greedy_text(_last_token("hello"), 20)
    assert choice.finish_reason == "length" and choice.index == 0
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 20, 25)


def test_second_served_name_works_and_token_id_prompts(client):
    r = client.completions.create(model="other-name", prompt=[[104, 105], [7]], max_tokens=5, temperature=0)
    assert [c.text for c in r.choices] == [greedy_text(105, 5), greedy_text(7, 5)]
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 10


def test_stop_string_and_echo(client):
    r = client.completions.create(model=CYCLE_MODEL, prompt="xy", max_tokens=30, temperature=0, stop=["🚀"], echo=True)
    assert r.choices[0].text == "xy" + "é日" and r.choices[0].finish_reason == "stop"


def test_streaming_keeps_multibyte_characters_whole(client):
    """Tokens are single bytes, so every character above U+007F spans 2-4 tokens; no chunk may cut one."""
    want = greedy_text(_last_token("stream me"), 37)
    stream = client.completions.create(
        model=CYCLE_MODEL, prompt="stream me", max_tokens=37, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == want
    assert CYCLE_TEXT in want and "\ufffd" not in "".join(pieces[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 37
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_count_tokens_in_every_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    completions = client.completions.create(model=CYCLE_MODEL, prompt="count", max_tokens=12, temperature=0, n=2,
                                            stream=True, stream_options=options)  # fmt: skip
    chat = client.chat.completions.create(model=CYCLE_MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=12,
                                          temperature=0, stream=True, stream_options=options)  # fmt: skip
    for chunks, total in ((list(completions), 24), (list(chat), 12)):
        counts = [c.usage.completion_tokens for c in chunks]
        assert len(counts) > 3 and counts == sorted(counts) and counts[0] < total and counts[-1] == total
        assert len({c.usage.prompt_tokens for c in chunks}) == 1
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + total


def test_raw_sse_framing_ends_with_done(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", json={
        "model": CYCLE_MODEL, "prompt": "a", "max_tokens": 3, "temperature": 0, "stream": True,
    }, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1


def test_chat_non_streaming_and_streaming_agree(client, server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sag etwas auf Japanisch: 日本"}]
    r = client.chat.completions.create(model=CYCLE_MODEL, messages=messages, max_completion_tokens=25, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == greedy_text(NL, 25) and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 25 and r.usage.prompt_tokens > 25
    chunks = list(client.chat.completions.create(
        model=CYCLE_MODEL, messages=messages, max_tokens=25, temperature=0, stream=True, stream_options={"include_usage": True}
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    m = server.metrics()  # the second request found the first one's prompt blocks
    assert 0 < m["jaxpaged:prefix_cache_hits_total"] <= m["jaxpaged:prefix_cache_queries_total"]


def test_n_and_seeds(client):
    def sample(seed, n=3, prompt=("p", "q")):
        r = client.completions.create(model=CYCLE_MODEL, prompt=list(prompt), max_tokens=12, temperature=1.0, n=n, seed=seed)
        assert [c.index for c in r.choices] == list(range(len(prompt) * n))
        assert 0 < r.usage.completion_tokens <= len(prompt) * n * 12  # a sampled EOS may end a choice early
        return [c.text for c in r.choices]

    first = sample(7)
    assert first == sample(7)  # a seed makes sampling reproducible
    assert len(set(first[:3])) > 1  # the n samples of one prompt differ (seed + i each)
    assert first != sample(8)
    chat = [client.chat.completions.create(model=CYCLE_MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                           temperature=1.0, seed=3, max_tokens=8) for _ in range(2)]
    assert [c.message.content for c in chat[0].choices] == [c.message.content for c in chat[1].choices]
    assert len(chat[0].choices) == 2


def test_seeded_stream_equals_seeded_response(client):
    kwargs = {"model": CYCLE_MODEL, "prompt": "seeded", "max_tokens": 16, "temperature": 0.9, "top_p": 0.9, "seed": 123}
    whole = client.completions.create(**kwargs).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)) == whole


def test_completion_logprobs(client):
    r = client.completions.create(model=CYCLE_MODEL, prompt="ab", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and chosen == pytest.approx(max(top.values()))  # greedy picks the most likely
    assert lp.text_offset[0] == 0


def test_completion_top_logprobs_hold_the_sampled_token_as_vllm(client):
    """At temperature 1 the cycle model mostly samples a token outside the top 1: it joins the dict (2 entries)."""
    r = client.completions.create(model=CYCLE_MODEL, prompt="ab", max_tokens=16, temperature=1.0, seed=3, logprobs=1)
    lp = r.choices[0].logprobs
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and len(top) <= 2
        if token != "\ufffd":  # a UTF-8 character's bytes all read "\ufffd": one key for several tokens
            assert top[token] == chosen
    assert any(len(top) == 2 for top in lp.top_logprobs)


# The cycle model's logits: 0, and MARGIN for the successor, shrunk by RMSNorm's eps (1e-6) on a one-hot of width VOCAB.
_LOGIT = MARGIN / math.sqrt(1 + VOCAB * 1e-6)
LOG_Z = math.log(math.exp(_LOGIT) + VOCAB - 1)
SUCCESSOR, OTHER = _LOGIT - LOG_Z, -LOG_Z


def test_echo_with_logprobs_scores_the_prompt_then_the_answer(client):
    """'y'->'x'->' ' are not cycle steps, ' '->'a' and 'a'->'b' are: their logprobs are known exactly."""
    r = client.completions.create(model=CYCLE_MODEL, prompt="yx a", max_tokens=1, temperature=0, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text == "yx ab"
    lp = c.logprobs
    assert lp.tokens == ["y", "x", " ", "a", "b"] and lp.text_offset == [0, 1, 2, 3, 4]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([OTHER, OTHER, SUCCESSOR, SUCCESSOR], abs=1e-4)
    assert list(lp.top_logprobs[3])[0] == "a" and len(lp.top_logprobs[3]) == 2
    assert lp.top_logprobs[3]["a"] == pytest.approx(SUCCESSOR, abs=1e-4)
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 1


def test_echo_with_max_tokens_0_only_scores_the_prompt(client):
    r = client.completions.create(model=CYCLE_MODEL, prompt=[[121, 32, 97], [32, 97]], max_tokens=0, echo=True, logprobs=0)
    assert [c.text for c in r.choices] == ["y a", " a"]
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    assert r.choices[0].logprobs.token_logprobs == [None, pytest.approx(OTHER, abs=1e-4), pytest.approx(SUCCESSOR, abs=1e-4)]
    assert r.choices[0].logprobs.top_logprobs[1:] == [{" ": pytest.approx(OTHER, abs=1e-4)},
                                                       {"a": pytest.approx(SUCCESSOR, abs=1e-4)}]  # the token alone, as vLLM
    assert r.choices[1].logprobs.tokens == [" ", "a"]
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 5


def test_streamed_echo_logprobs_equal_the_whole_response(client):
    kwargs = {"model": CYCLE_MODEL, "prompt": "yx a", "max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 2,
              "echo": True, "logprobs": 3}
    whole = client.completions.create(**kwargs)
    chunks = [ch.choices[0] for ch in client.completions.create(stream=True, **kwargs) if ch.choices]
    for choice in whole.choices:
        mine = [ch for ch in chunks if ch.index == choice.index]
        assert "".join(ch.text for ch in mine) == choice.text and choice.text.startswith("yx a")
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [v for ch in mine for v in getattr(ch.logprobs, key)] == getattr(choice.logprobs, key), key
        assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == 4 + 6
    for ch in client.completions.create(stream=True, **{**kwargs, "max_tokens": 0}):
        assert ch.choices[0].text == "yx a" and ch.choices[0].finish_reason == "length"
        assert ch.choices[0].logprobs.token_logprobs[1:] == pytest.approx([OTHER, OTHER, SUCCESSOR], abs=1e-4)


def test_chat_logprobs_bytes_rebuild_the_text(client):
    r = client.chat.completions.create(model=CYCLE_MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=9,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 9 and all(len(t.top_logprobs) == 2 for t in content)
    assert bytes(b for t in content for b in t.bytes) == greedy_bytes(NL, 9)
    assert r.choices[0].message.content == greedy_text(NL, 9)


def test_vllm_extras_are_honoured(server):
    r = httpx.post(f"{server.url}/v1/completions", json={
        "model": CYCLE_MODEL, "prompt": "q", "max_tokens": 10, "min_tokens": 10, "ignore_eos": True, "top_k": 1,
        "min_p": 0.1, "repetition_penalty": 1.0, "temperature": 0.7, "stop_token_ids": [1000 % 256],
    }, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 10
    assert r.json()["choices"][0]["text"] == greedy_text(ord("q"), 10)  # top_k=1 is greedy


def test_logit_bias_allowed_token_ids_and_bad_words(client):
    """OpenAI's logit_bias (token ids as strings, clamped to [-100, 100]) and vLLM's allowed_token_ids and bad_words
    (extra_body), on the cycle model: +5 beats the successor's margin of 4, and "ab" is never written."""
    b = ord("b")
    r = client.completions.create(model=CYCLE_MODEL, prompt="q", max_tokens=4, temperature=0, logit_bias={str(b): 500})
    assert r.choices[0].text == "bbbb"
    allowed = [ord("x"), ord("y")]
    r = client.completions.create(model=CYCLE_MODEL, prompt="q", max_tokens=16, temperature=1.0, seed=1, n=3,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True})  # fmt: skip
    assert {ch for c in r.choices for ch in c.text} <= {"x", "y"}
    plain = client.completions.create(model=CYCLE_MODEL, prompt=" ", max_tokens=3, temperature=0)
    assert plain.choices[0].text == "ab" + greedy_text(b, 1)
    r = client.chat.completions.create(model=CYCLE_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=24,
                                       temperature=0, extra_body={"bad_words": ["ab"], "ignore_eos": True})  # fmt: skip
    text = r.choices[0].message.content
    assert "a" in text and "ab" not in text


def test_choices_carry_vllms_stop_reason(server, client):
    """The stop string or token id that ended a choice (vLLM's field), None for a length or EOS end; streamed, in
    the choice's last chunk."""
    r = httpx.post(f"{server.url}/v1/completions", json={"model": CYCLE_MODEL, "prompt": ["xy", "q"], "max_tokens": 30,
                   "temperature": 0, "stop": ["🚀"], "stop_token_ids": [ord("b")]}, timeout=30).json()  # fmt: skip
    assert [c["stop_reason"] for c in r["choices"]] == ["🚀", "🚀"]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": CYCLE_MODEL, "prompt": " ", "max_tokens": 30,
                   "temperature": 0, "stop_token_ids": [ord("b")]}, timeout=30).json()  # fmt: skip
    assert r["choices"][0]["stop_reason"] == ord("b") and r["choices"][0]["finish_reason"] == "stop"
    r = client.chat.completions.create(model=CYCLE_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=30,
                                       temperature=0, stop=["ж"])  # fmt: skip
    assert r.choices[0].stop_reason == "ж"
    chunks = list(client.chat.completions.create(model=CYCLE_MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=30, temperature=0, stop=["ж"], stream=True))  # fmt: skip
    assert [getattr(ch.choices[0], "stop_reason", None) for ch in chunks if ch.choices][-1] == "ж"
    stream = client.completions.create(model=CYCLE_MODEL, prompt="q", max_tokens=3, temperature=0, stream=True)
    last = [ch.choices[0] for ch in stream if ch.choices][-1]
    assert last.finish_reason == "length" and last.stop_reason is None


def test_prompt_logprobs_as_vllm(server):
    """vLLM's prompt_logprobs: per choice (completions) or beside the choices (chat), None first, then each prompt
    token's logprob, rank and text and the top N's, keyed by token id; the cycle model's numbers are known."""
    r = httpx.post(f"{server.url}/v1/completions", json={"model": CYCLE_MODEL, "prompt": [[CYCLE[0], CYCLE[1], 7]],
                   "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1, "n": 2, "seed": 1}, timeout=30).json()  # fmt: skip
    z, top = LOG_Z, _LOGIT - LOG_Z
    for choice in r["choices"]:
        first, hit, miss = choice["prompt_logprobs"]
        assert first is None
        assert hit[str(CYCLE[1])]["rank"] == 1 and hit[str(CYCLE[1])]["logprob"] == pytest.approx(top, abs=1e-5)
        assert len(hit) == 1  # the top 1 is the token itself
        assert miss["7"]["logprob"] == pytest.approx(-z, abs=1e-5) and miss["7"]["rank"] > 1
        assert miss[str(CYCLE[2])]["rank"] == 1 and miss[str(CYCLE[2])]["logprob"] == pytest.approx(top, abs=1e-5)
    plain = httpx.post(f"{server.url}/v1/completions", json={"model": CYCLE_MODEL, "prompt": "ab", "max_tokens": 2},
                       timeout=30).json()  # fmt: skip
    assert "prompt_logprobs" not in plain["choices"][0]
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"model": CYCLE_MODEL, "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0}, timeout=30).json()  # fmt: skip
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])


def test_truncate_prompt_tokens(client):
    """vLLM's extra: the prompt's last tokens run, and the usage counts those."""
    r = client.completions.create(model=CYCLE_MODEL, prompt="hello", max_tokens=3, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 2})  # fmt: skip
    assert r.usage.prompt_tokens == 2 and r.choices[0].text == greedy_text(_last_token("hello"), 3)


async def _one_stream(client: openai.AsyncOpenAI, i: int) -> tuple[int, str, int, str]:
    max_tokens = 8 + i % 24
    stream = await client.completions.create(
        model=CYCLE_MODEL, prompt=f"client {i}", max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, reason = [], None, None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return max_tokens, "".join(text), usage, reason


def test_64_concurrent_streaming_clients(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(_one_stream(client, i) for i in range(64)))

    before = server.metrics()["jaxpaged:generation_tokens_total"]
    results = asyncio.run(main())
    for i, (max_tokens, text, usage, reason) in enumerate(results):
        assert usage == max_tokens and reason == "length", i
        assert text == greedy_text(ord(str(i)[-1]), max_tokens), i
    expected = before + sum(r[0] for r in results)
    after = server.wait_metrics(lambda m: m["jaxpaged:generation_tokens_total"] >= expected)
    assert after["jaxpaged:generation_tokens_total"] == expected
    assert after["jaxpaged:kv_blocks_used"] == 0 and after["jaxpaged:num_requests_running"] == 0


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_choice_finishes_once_when_the_others_run_on(client, endpoint):
    """n > 1: a choice that stops early is still listed in its siblings' later updates; its finish_reason goes out
    once (it was sent again with every later update)."""
    kwargs = {"model": CYCLE_MODEL, "max_tokens": 40, "temperature": 1.0, "seed": 11, "n": 4,
              "extra_body": {"stop_token_ids": list(range(0, 256, 4))}, "stream": True}  # fmt: skip
    if endpoint == "chat":
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "x"}], **kwargs))
    else:
        chunks = list(client.completions.create(prompt="go", **kwargs))
    finishes = [(c.index, c.finish_reason) for ch in chunks for c in ch.choices if c.finish_reason]
    assert sorted(i for i, _ in finishes) == [0, 1, 2, 3], finishes
    assert {reason for _, reason in finishes} >= {"stop"}
    last_chunk = {c.index: k for k, ch in enumerate(chunks) for c in ch.choices}
    assert len(set(last_chunk.values())) > 1  # the choices did end at different times
    for index, _ in finishes:  # nothing follows a choice's finish
        assert [c.finish_reason for ch in chunks for c in ch.choices if c.index == index][-1] is not None


def test_null_n_echo_and_logprobs_mean_their_defaults(client):
    """OpenAI's spec lets n, echo and chat's logprobs be null, and the openai client sends null for a None argument;
    they were 400s."""
    r = client.completions.create(model=CYCLE_MODEL, prompt="ab", max_tokens=4, temperature=0, n=None, echo=None, logprobs=None)
    assert [c.text for c in r.choices] == [greedy_text(ord("b"), 4)] and r.choices[0].logprobs is None
    r = client.chat.completions.create(model=CYCLE_MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       temperature=0, n=None, logprobs=None, top_logprobs=None)  # fmt: skip
    assert [c.message.content for c in r.choices] == [greedy_text(NL, 4)] and r.choices[0].logprobs is None


def test_chat_text_parts_join_by_newlines_and_continue_final_message(server, client):
    """As vLLM's server: text parts are joined by newlines, and continue_final_message ends the prompt inside the
    last (assistant) message, which the answer continues (it was ignored: the answer started a new line)."""
    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]
    joined = client.chat.completions.create(model=CYCLE_MODEL, messages=[{"role": "user", "content": parts}], max_tokens=2)
    plain = client.chat.completions.create(model=CYCLE_MODEL, messages=[{"role": "user", "content": "ab\ncd"}], max_tokens=2)
    specials = 3  # <|im_start|>, <|im_end|>, <|im_start|>: a token each; every other byte is a token
    assert joined.usage.prompt_tokens == plain.usage.prompt_tokens == len("user\nab\ncd\n" "assistant\n") + specials
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "yx a"}]
    r = client.chat.completions.create(model=CYCLE_MODEL, messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})  # fmt: skip
    assert r.choices[0].message.content == greedy_text(ord("a"), 6)
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": CYCLE_MODEL, "messages": messages,
                                                               "continue_final_message": True}, timeout=30)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_tokenize_and_detokenize_as_vllm(server, client):
    """vLLM's /tokenize (a prompt, or messages rendered as chat renders them) and /detokenize (they were 404s)."""
    url = server.url
    r = httpx.post(f"{url}/tokenize", json={"model": CYCLE_MODEL, "prompt": "hé🚀", "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == list("hé🚀".encode("utf-8")) and body["count"] == 7 and body["max_model_len"] == 512
    assert len(body["token_strs"]) == 7
    messages = [{"role": "user", "content": "Sag etwas"}]
    r = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=30).json()
    chat = client.chat.completions.create(model=CYCLE_MODEL, messages=messages, max_tokens=1)
    assert r["count"] == len(r["tokens"]) == chat.usage.prompt_tokens and r["token_strs"] is None
    r = httpx.post(f"{url}/detokenize", json={"model": CYCLE_MODEL, "tokens": list("hé🚀".encode("utf-8"))}, timeout=30)
    assert r.status_code == 200 and r.json() == {"prompt": "hé🚀"}
    for path, body, status, param in [
        ("/tokenize", {}, 400, "prompt"), ("/tokenize", {"prompt": "a", "messages": messages}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"), ("/tokenize", {"model": "gpt-9", "prompt": "a"}, 404, "model"),
        ("/tokenize", {"messages": messages, "chat_template_kwargs": {"tokenize": False}}, 400, "chat_template_kwargs"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"), ("/detokenize", {"tokens": [VOCAB]}, 400, "tokens"),
        ("/detokenize", {"tokens": "a"}, 400, "tokens"),
    ]:
        r = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert r.status_code == status and r.json()["error"]["param"] == param, (path, body, r.text)

"""Bad input gets the right status and OpenAI's error body, never a 500, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import CYCLE_MODEL

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def _c(**fields):
    return {"model": CYCLE_MODEL, "prompt": "hi", **fields}


def _chat(**fields):
    return {"model": CYCLE_MODEL, "messages": USER, **fields}


# (path, body, param the error must name)
BAD_JSON_BODIES = [
    (C, _c(n=0), "n"),
    (C, _c(n=129), "n"),
    (C, _c(n="2"), "n"),
    (C, _c(max_tokens=0), "max_tokens"),
    (C, _c(max_tokens=-5), "max_tokens"),
    (C, _c(max_tokens=1.5), "max_tokens"),
    (C, _c(temperature=-0.1), "temperature"),
    (C, _c(temperature="hot"), "temperature"),
    (C, _c(top_p=0), "top_p"),
    (C, _c(top_p=1.5), "top_p"),
    (C, _c(top_k=-2), "top_k"),
    (C, _c(min_p=2), "min_p"),
    (C, _c(presence_penalty=2.5), "presence_penalty"),
    (C, _c(frequency_penalty=-3), "frequency_penalty"),
    (C, _c(repetition_penalty=0), "repetition_penalty"),
    (C, _c(min_tokens=-1), "min_tokens"),
    (C, _c(min_tokens=20, max_tokens=10), "min_tokens"),
    (C, _c(min_tokens=2**31, max_tokens=None), "min_tokens"),  # past int32: it killed the engine loop
    (C, _c(min_tokens=513, max_tokens=None), "min_tokens"),  # more than max_model_len can ever hold
    (C, _c(seed=-1), "seed"),
    (C, _c(seed=2**64), "seed"),
    (C, _c(logprobs=21), "logprobs"),
    (C, _c(logprobs=-1), "logprobs"),
    (C, _c(stop=[f"s{i}" for i in range(17)]), "stop"),
    (C, _c(stop=["x" * 257]), "stop"),
    (C, _c(stop=[1, 2]), "stop"),
    (C, _c(stop_token_ids=[-1]), "stop_token_ids"),
    (C, _c(ignore_eos="yes"), "ignore_eos"),
    (C, _c(stream="true"), "stream"),
    (C, _c(stream_options={"include_usage": True}), "stream_options"),
    (C, _c(stream=False, stream_options={"include_usage": True}), "stream_options"),
    (C, _c(best_of=3), "best_of"),
    (C, _c(logit_bias={"five": 1.0}), "logit_bias"),
    (C, _c(logit_bias={"5": "x"}), "logit_bias"),
    (C, _c(logit_bias={"100000": 1.0}), "logit_bias"),  # outside the vocabulary
    (C, _c(logit_bias={str(i): 1.0 for i in range(301)}), "logit_bias"),
    (C, _c(allowed_token_ids=[]), "allowed_token_ids"),
    (C, _c(allowed_token_ids=[1, 100000]), "allowed_token_ids"),
    (C, _c(bad_words=["x", ""]), "bad_words"),
    (C, _c(bad_words="x"), "bad_words"),
    # vLLM's fields this server lacks: refused, not dropped as unknown (which changed the output silently)
    (C, _c(use_beam_search=True, stop=["x"]), "stop"),  # beam search takes no stop strings (tests/entrypoints/test_beam_search_api.py)
    (C, _c(prompt_logprobs=21), "prompt_logprobs"),
    (C, _c(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    (CHAT, _chat(prompt_logprobs=-1), "prompt_logprobs"),
    (C, _c(length_penalty=0.5), "length_penalty"),
    (C, _c(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (C, _c(spaces_between_special_tokens="no"), "spaces_between_special_tokens"),
    (CHAT, _chat(echo=True), "echo"),
    (C, _c(echo=True, logprobs=21), "logprobs"),
    (C, _c(max_tokens=0), "max_tokens"),  # 0 is for scoring a prompt, with echo
    (C, _c(echo=True, max_tokens=0, min_tokens=2), "min_tokens"),
    (C, _c(prompt=""), "prompt"),
    (C, _c(prompt=[]), "prompt"),
    (C, _c(prompt=[[]]), "prompt"),
    (C, _c(prompt=["ok", ""]), "prompt"),
    (C, _c(prompt=[1, "a"]), "prompt"),
    (C, _c(prompt=5), "prompt"),
    (C, _c(prompt=None), "prompt"),
    (C, _c(prompt=[1, 2, 264]), "prompt"),
    (C, _c(prompt=[[1], [-1]]), "prompt"),
    (C, _c(prompt=[True]), "prompt"),
    (C, _c(prompt=[-5], echo=True), "prompt"),
    (C, _c(prompt=[7] * 600), "prompt"),
    (C, _c(prompt=[7] * 500, max_tokens=20), "max_tokens"),
    (C, _c(prompt=[7] * 512, max_tokens=None), "prompt"),
    (C, {"prompt": "hi"}, "model"),
    (C, {"model": CYCLE_MODEL}, "prompt"),
    (C, {"model": 5, "prompt": "hi"}, "model"),
    (CHAT, {"model": CYCLE_MODEL}, "messages"),
    (CHAT, _chat(messages=[]), "messages"),
    (CHAT, _chat(messages="hi"), "messages"),
    (CHAT, _chat(messages=[{"role": "wizard", "content": "hi"}]), "messages.0.role"),
    (CHAT, _chat(messages=[{"content": "hi"}]), "messages.0.role"),
    (CHAT, _chat(messages=[{"role": "user"}]), "messages.0.content"),
    (CHAT, _chat(messages=[{"role": "user", "content": None}]), "messages.0.content"),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), "messages.0.content"),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "x"}}]}]), "messages.0.content"),
    # an image for a text-only model: the engine refuses it, naming the messages
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "messages"),
    (CHAT, _chat(messages=[USER[0], "hi"]), "messages.1"),
    (CHAT, _chat(messages=[{"role": "user", "content": "x " * 600}]), "messages"),
    (CHAT, _chat(max_tokens=0), "max_tokens"),
    (CHAT, _chat(max_completion_tokens=0), "max_completion_tokens"),
    (CHAT, _chat(max_completion_tokens=600), "max_completion_tokens"),
    (CHAT, _chat(min_tokens=10**12), "min_tokens"),
    (CHAT, _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (CHAT, _chat(top_logprobs=2), "top_logprobs"),
    (CHAT, _chat(logprobs=3), "logprobs"),
    (CHAT, _chat(n=1000), "n"),
    (CHAT, _chat(temperature=-1), "temperature"),
    (CHAT, _chat(top_p=-1), "top_p"),
    (CHAT, _chat(seed=1.5), "seed"),
    (CHAT, _chat(stop="x" * 300), "stop"),
    (CHAT, _chat(stream_options={"include_usage": True}), "stream_options"),
    (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),  # "auto"
    (CHAT, _chat(tools=[{"type": "function"}], tool_choice="required"), "tools"),
    (CHAT, _chat(response_format={"type": "json_object", "json_schema": 1}, guided_regex="a"), "guided_regex"),
    (C, _c(response_format={"type": "xml"}), "response_format.type"),
]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def _assert_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize(("path", "body", "param"), BAD_JSON_BODIES, ids=[f"{p[-16:]}-{i}" for i, (p, _, _) in enumerate(BAD_JSON_BODIES)])
def test_bad_field_is_400_naming_it(http, path, body, param):
    err = _assert_error(http.post(path, json=body), 400)
    assert err["param"] == param or (err["param"] or "").startswith(param), err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{bad json", b"", b"[1, 2]", b'"a string"', b"null", b"\xff\xfe", b'{"model": "cycle", "prompt": "hi"'])
def test_malformed_or_non_object_body_is_400(http, raw):
    _assert_error(http.post(C, content=raw, headers={"content-type": "application/json"}), 400, code="invalid_json")


def test_unknown_model_is_404(http):
    _assert_error(http.post(C, json={"model": "gpt-9", "prompt": "hi"}), 404, param="model", code="model_not_found")
    _assert_error(http.post(CHAT, json={"model": "gpt-9", "messages": USER}), 404, param="model", code="model_not_found")
    _assert_error(http.get("/v1/models/gpt-9"), 404, param="model")


def test_unknown_route_and_method_use_the_error_body(http):
    _assert_error(http.get("/v1/nothing"), 404)
    _assert_error(http.get(C), 405)


def test_oversized_body_is_413(http):
    big = {"model": CYCLE_MODEL, "prompt": "x" * (5 << 20)}
    _assert_error(http.post(C, json=big), 413, code="request_too_large")


def test_still_serving_after_every_bad_request(http, server):
    r = http.post(C, json=_c(max_tokens=3, temperature=0))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert "Traceback" not in server.log()
    m = server.metrics()
    assert m["jaxpaged:kv_blocks_used"] == 0 and m["jaxpaged:num_requests_waiting"] == 0 and m["jaxpaged:engine_alive"] == 1


def test_priority_other_than_0_is_400_under_fcfs(http):
    """vLLM's `priority` field: this server schedules fcfs, so 0 is served and any other value is refused, as vLLM's."""
    for path, body in ((C, _c), (CHAT, _chat)):
        assert http.post(path, json=body(max_tokens=2, priority=0)).status_code == 200
        err = _assert_error(http.post(path, json=body(priority=-1)), 400, param="priority")
        assert "scheduling_policy 'priority'" in err["message"], err
        _assert_error(http.post(path, json=body(priority="1")), 400, param="priority")


def test_vllm_fields_at_their_inert_values_are_accepted(http):
    r = http.post(C, json=_c(max_tokens=2, use_beam_search=False, length_penalty=1.0, prompt_logprobs=None))
    assert r.status_code == 200, r.text
    r = http.post(CHAT, json=_chat(max_tokens=2, echo=False))
    assert r.status_code == 200, r.text

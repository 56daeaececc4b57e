"""Abort on disconnect (blocks back at once, seen through /metrics), the API key, the waiting-queue limit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.conftest import API_KEY, CYCLE_MODEL
from tests.server_harness import REPO

LONG = 480  # tokens a request would generate if nobody stopped it


def _finished(m: dict, reason: str) -> float:
    return m.get(f'jaxpaged:request_finished_total{{finished_reason="{reason}"}}', 0.0)


def _idle(m: dict) -> bool:
    return m["jaxpaged:num_requests_running"] == 0 and m["jaxpaged:kv_blocks_used"] == 0


def _assert_aborted(server, before: dict, sequences: int) -> None:
    after = server.wait_metrics(lambda m: _idle(m) and _finished(m, "abort") >= _finished(before, "abort") + sequences)
    assert _idle(after), after
    assert _finished(after, "abort") - _finished(before, "abort") == sequences
    assert _finished(after, "length") == _finished(before, "length")  # none ran to the end
    generated = after["jaxpaged:generation_tokens_total"] - before["jaxpaged:generation_tokens_total"]
    assert generated < sequences * LONG


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = server.metrics()
    body = {"model": CYCLE_MODEL, "prompt": "go", "max_tokens": LONG, "n": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        during = server.metrics()
        assert during["jaxpaged:num_requests_running"] == 4 and during["jaxpaged:kv_blocks_used"] > 0
    # leaving the block closed the connection mid-stream
    _assert_aborted(server, before, 4)


def test_disconnect_while_waiting_for_a_plain_response(server):
    """No token is sent before the end, so only the connection dropping can tell the server."""
    before = server.metrics()
    body = json.dumps({"model": CYCLE_MODEL, "prompt": "go", "max_tokens": LONG, "n": 4, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        running = server.wait_metrics(lambda m: m["jaxpaged:kv_blocks_used"] > 0)
        assert running["jaxpaged:num_requests_running"] == 4
    _assert_aborted(server, before, 4)


def test_cancelled_openai_stream_aborts(server):
    before = server.metrics()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=CYCLE_MODEL, messages=[{"role": "user", "content": "x"}],
                                            max_tokens=LONG, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    client.close()
    _assert_aborted(server, before, 1)


# -- API key and queue limit (the keyed server) ------------------------------------------------------


def test_probes_are_open_everything_else_needs_the_key(keyed_server):
    url = keyed_server.url
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/version")):
        assert httpx.request(method, f"{url}{path}").status_code == 200, (method, path)
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/nowhere")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": f"Basic {API_KEY}"}):
            r = httpx.request(method, f"{url}{path}", headers=headers, json={})
            assert r.status_code == 401, (method, path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models", headers=keyed_server.headers).status_code == 200
    assert httpx.get(f"{url}/metrics", headers=keyed_server.headers).status_code == 200


def test_openai_client_with_key(keyed_server):
    good = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0)
    r = good.completions.create(model=CYCLE_MODEL, prompt="k", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    bad = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=CYCLE_MODEL, prompt="k", max_tokens=4)


def test_small_body_limit_is_413_after_auth(keyed_server):
    r = httpx.post(f"{keyed_server.url}/v1/completions", headers=keyed_server.headers,
                   json={"model": CYCLE_MODEL, "prompt": "x" * 5000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_full_waiting_queue_is_503_with_retry_after(keyed_server):
    """32 sequences fill the batch (max_num_seqs 32), one request waits (max_waiting 1), the next is refused."""
    url, headers = f"{keyed_server.url}/v1/completions", keyed_server.headers
    fill = {"model": CYCLE_MODEL, "prompt": "a", "max_tokens": LONG, "n": 32, "temperature": 0, "stream": True}
    wait = {**fill, "n": 1}
    with httpx.Client(timeout=30, headers=headers) as http, http.stream("POST", url, json=fill) as running:
        lines = running.iter_lines()  # keep the iterator: dropping it closes the connection (and aborts)
        next(lines)  # admitted: the batch is full
        with http.stream("POST", url, json=wait) as waiting:
            assert waiting.status_code == 200
            deadline = time.monotonic() + 5
            while keyed_server.metrics()["jaxpaged:num_requests_waiting"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            r = http.post(url, json={**wait, "stream": False})
            assert r.status_code == 503, r.text
            assert r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
    m = keyed_server.wait_metrics(_idle)
    assert _idle(m)
    ok = httpx.post(url, headers=headers, json={"model": CYCLE_MODEL, "prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200  # served again once the queue drained


# -- the command line ---------------------------------------------------------------------------------


def _serve(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "jaxpaged.serve", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_help_names_the_server_flags():
    out = _serve("--help")
    assert out.returncode == 0
    for flag in ("--model", "--host", "--port", "--api-key", "--served-model-name", "--dtype", "--max-num-seqs",
                 "--max-waiting", "--max-model-len", "--num-kv-blocks"):
        assert flag in out.stdout


def test_pickle_checkpoint_is_refused_before_serving(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    out = _serve("--model", str(tmp_path), "--port", "0")  # any free port: it is bound before the model loads
    assert out.returncode == 2 and "pickle" in out.stderr

"""Images through the OpenAI server (issue 46, step 3), on a tiny Qwen2.5-VL served by `python -m jaxpaged.serve`:
a chat message with an `image_url` part (a data: URL, a local file under --allowed-local-media-path, an http URL of
an --allowed-media-domains host) goes through the model's chat template and processor to the tokens transformers
makes, and its answer is transformers' greedy one; a corrupt, disallowed or missing image, or more than
--limit-mm-per-prompt, is a 400 naming the problem, and nothing is held afterwards."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading

import httpx
import pytest

from tests.server_harness import ServerProcess
from tests.vlm_models import hf_inputs, hf_vlm_greedy, images, qwen2_5_vl_checkpoint

openai = pytest.importorskip("openai")

MODEL = "qwen-vl"
CHAT = "/v1/chat/completions"


def _png(picture) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(picture) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(picture)).decode()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("qwen-vl-server"), seed=1)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A folder of images the server may read, and a local http server (its host allowed) serving it."""
    folder = tmp_path_factory.mktemp("media")
    for i, picture in enumerate(images((57, 77), (112, 64), seed=30)):
        picture.save(folder / f"{i}.png")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield folder, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(qwen, media, tmp_path_factory):
    folder = media[0]
    args = ["--model", str(qwen[2]), "--served-model-name", MODEL, "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
            "--num-kv-blocks", "64", "--allowed-local-media-path", str(folder), "--allowed-media-domains", "127.0.0.1",
            "--limit-mm-per-prompt", '{"image": 2}']  # fmt: skip
    proc = ServerProcess(args, tmp_path_factory.mktemp("log") / "server.log")
    yield proc
    proc.stop()


def _message(*urls, text="What is in the picture?"):
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                         {"type": "text", "text": text}]}]  # fmt: skip


def _want(qwen, pictures, text="What is in the picture?", max_tokens=8):
    """transformers' tokens for the same conversation: (prompt ids, greedy answer ids)."""
    hf, processor, _ = qwen
    messages = [{"role": "user", "content": [*({"type": "image", "image": p} for p in pictures), {"type": "text", "text": text}]}]
    inputs = hf_inputs(processor, messages=messages)
    return inputs["input_ids"][0].tolist(), hf_vlm_greedy(hf, inputs, max_tokens)


def test_image_url_chat_equals_transformers_with_the_openai_client(server, qwen, media):
    folder, http_root = media
    pictures = images((57, 77), (112, 64), seed=30)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    tokenizer = qwen[1].tokenizer
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731 (as the server does)
    for how, url, picture in (("data", _data_url(pictures[0]), pictures[0]), ("file", (folder / "1.png").as_uri(), pictures[1]),
                              ("http", f"{http_root}/0.png", pictures[0])):  # fmt: skip
        prompt, answer = _want(qwen, [picture])
        reply = client.chat.completions.create(model=MODEL, messages=_message(url), max_tokens=8, temperature=0.0,
                                               extra_body={"ignore_eos": True})  # fmt: skip
        assert reply.usage.prompt_tokens == len(prompt), how
        assert reply.choices[0].message.content == decode(answer), how
    # two images in one message, streamed
    prompt, answer = _want(qwen, pictures, text="Which is larger?")
    stream = client.chat.completions.create(model=MODEL, messages=_message(_data_url(pictures[0]), _data_url(pictures[1]), text="Which is larger?"),
                                            max_tokens=8, temperature=0.0, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == decode(answer)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("data:image/png;base64,!!notbase64", "base64"),
        ("data:image/png;base64," + base64.b64encode(b"just some bytes").decode(), "not a readable image"),
        ("file:///etc/hostname", "outside the allowed media folder"),
        ("https://example.com/cat.png", "not allowed"),
        ("ftp://example.com/cat.png", "scheme"),
    ],
)
def test_a_bad_image_is_a_400_naming_the_problem(server, url, problem):
    r = httpx.post(f"{server.url}{CHAT}", json={"model": MODEL, "messages": _message(url), "max_tokens": 4}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert problem in err["message"] and err["param"].startswith("messages"), err


def test_more_images_than_the_limit_and_broken_files_are_refused_and_nothing_is_held(server, media):
    folder, _ = media
    urls = [(folder / f"{i}.png").as_uri() for i in (0, 1, 0)]
    r = httpx.post(f"{server.url}{CHAT}", json={"model": MODEL, "messages": _message(*urls), "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and "at most 2" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.url}{CHAT}", json={"model": MODEL, "messages": _message((folder / "broken.png").as_uri()),
                                                "max_tokens": 4}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and "not a readable image" in r.json()["error"]["message"], r.text
    values = server.wait_metrics(lambda v: v.get("jaxpaged:num_requests_running") == 0)
    assert values["jaxpaged:num_requests_running"] == 0 and values["jaxpaged:num_requests_waiting"] == 0
    assert values["jaxpaged:kv_blocks_used"] == 0
    ok = httpx.post(f"{server.url}{CHAT}", json={"model": MODEL, "messages": _message(urls[0]), "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200, ok.text  # still serving

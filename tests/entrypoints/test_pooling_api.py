"""The pooling endpoints (vLLM's /v1/embeddings, /classify, /score, /rerank) against transformers: one server process
for an embedding model (runner "auto" picks pooling for its LlamaModel checkpoint), driven by the openai client; a
classifier, a cross-encoder and a generating model in-process through an ASGI transport (no process start each)."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest

from tests.hf_reference import random_hf_model, save_hf_model, tiny_llama_config, torch
from tests.vlm_models import byte_tokenizer

TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
ENGINE = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 8, "num_kv_blocks": 64,
          "dtype": "float32", "precompile": False}  # fmt: skip
ATOL = 1e-5


def _tokenizer():
    return byte_tokenizer(["<s>", "</s>"], TEMPLATE, bos_token="<s>", eos_token="</s>")


def _cli(engine: dict) -> list[str]:
    args = []
    for name, value in engine.items():
        flag = "--" + name.replace("_", "-")
        args += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return args


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """A random Llama saved as its base model (LlamaModel: an embedding checkpoint) with a byte tokenizer."""
    # matryoshka_dimensions: `dimensions` allowed, at these values (vLLM's check)
    hf = random_hf_model(tiny_llama_config(num_key_value_heads=2, vocab_size=258, matryoshka_dimensions=[16, 32, 64]))
    folder = tmp_path_factory.mktemp("embedder")
    hf.model.save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return hf, folder


@pytest.fixture(scope="module")
def server(embedder, tmp_path_factory):
    from tests.server_harness import ServerProcess

    proc = ServerProcess(["--model", str(embedder[1]), "--served-model-name", "emb", *_cli(ENGINE)],
                         tmp_path_factory.mktemp("pooling-server") / "server.log")  # fmt: skip
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def reference(hf, ids: list[int], dimensions: int | None = None) -> np.ndarray:
    """transformers' last_hidden_state at the last token, cut and normalized: what the engine's LAST pooling gives."""
    with torch.no_grad():
        v = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()[:dimensions]
    return v / np.linalg.norm(v)


def _ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))  # the byte tokenizer's ids, no special tokens added


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


# -- the embedding server -------------------------------------------------------------------------------------------


def test_embeddings_base64_float_and_token_ids_match_transformers(embedder, client):
    hf, _ = embedder
    texts = ["The cat sat on the mat.", "Paris is the capital of France."]
    default = client.embeddings.create(model="emb", input=texts)  # the client asks for base64 and decodes it
    floats = client.embeddings.create(model="emb", input=texts, encoding_format="float")
    tokens = client.embeddings.create(model="emb", input=[_ids(t) for t in texts])
    for r in (default, floats, tokens):
        assert r.object == "list" and r.model == "emb" and [d.index for d in r.data] == [0, 1]
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(_ids(t)) for t in texts)
        for text, d in zip(texts, r.data):
            assert d.object == "embedding"
            np.testing.assert_allclose(d.embedding, reference(hf, _ids(text)), atol=ATOL, rtol=0)
    assert default.id.startswith("embd-")


def test_dimensions_normalize_and_the_raw_base64(embedder, server, client):
    hf, _ = embedder
    text = "Matryoshka dolls nest."
    cut = client.embeddings.create(model="emb", input=text, dimensions=16, encoding_format="float").data[0].embedding
    np.testing.assert_allclose(cut, reference(hf, _ids(text), 16), atol=ATOL, rtol=0)
    body = _post(server, "/v1/embeddings", {"input": text, "encoding_format": "base64", "normalize": False}).json()
    raw = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")  # little-endian float32 bytes
    with torch.no_grad():
        want = hf.model(torch.tensor([_ids(text)])).last_hidden_state[0, -1].numpy()
    np.testing.assert_allclose(raw, want, atol=ATOL, rtol=0)


def test_pooling_endpoint_serves_the_embedding_tasks(embedder, server):
    """vLLM's /pooling: the model's own task by default (embed), token_embed's rows on request, float or base64."""
    hf, _ = embedder
    text = "Pool every token."
    body = _post(server, "/pooling", {"model": "emb", "input": [_ids(text), _ids(text)]}).json()
    assert body["id"].startswith("pool-") and body["object"] == "list" and body["model"] == "emb"
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "pooling"), (1, "pooling")]
    assert body["usage"] == {"prompt_tokens": 2 * len(_ids(text)), "total_tokens": 2 * len(_ids(text))}
    for d in body["data"]:
        np.testing.assert_allclose(d["data"], reference(hf, _ids(text)), atol=ATOL, rtol=0)
    with torch.no_grad():
        h = hf.model(torch.tensor([_ids(text)])).last_hidden_state[0].numpy()[:, :16]
    want = h / np.linalg.norm(h, axis=-1, keepdims=True)
    rows = _post(server, "/pooling", {"input": text, "task": "token_embed", "dimensions": 16}).json()["data"][0]["data"]
    np.testing.assert_allclose(rows, want, atol=ATOL, rtol=0)
    packed = _post(server, "/pooling", {"input": text, "task": "token_embed", "dimensions": 16, "use_activation": False,
                                        "encoding_format": "base64"}).json()["data"][0]["data"]  # fmt: skip
    raw = np.frombuffer(base64.b64decode(packed), dtype="<f4").reshape(len(_ids(text)), 16)  # row after row
    np.testing.assert_allclose(raw, h, atol=ATOL, rtol=0)


def test_chat_form_embeds_the_rendered_conversation(embedder, server):
    hf, _ = embedder
    messages = [{"role": "user", "content": "hello there"}]
    ids = _tokenizer().apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    body = _post(server, "/v1/embeddings", {"model": "emb", "messages": messages}).json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    np.testing.assert_allclose(body["data"][0]["embedding"], reference(hf, ids), atol=ATOL, rtol=0)


def test_score_and_rerank_are_cosines_in_order(embedder, server):
    hf, _ = embedder
    query, docs = "a cat on a mat", ["a dog in a fog", "a cat on a hat", "zebra stripes"]
    cosines = [float(reference(hf, _ids(query)) @ reference(hf, _ids(d))) for d in docs]
    for path in ("/score", "/v1/score"):
        body = _post(server, path, {"model": "emb", "text_1": query, "text_2": docs}).json()
        assert body["id"].startswith("score-") and body["object"] == "list"
        assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["data"][0]["object"] == "score"
        np.testing.assert_allclose([d["score"] for d in body["data"]], cosines, atol=ATOL, rtol=0)
    pairs = _post(server, "/score", {"text_1": docs[:2], "text_2": [query, docs[0]]}).json()["data"]  # N -> N
    np.testing.assert_allclose([d["score"] for d in pairs], [cosines[0], float(reference(hf, _ids(docs[1])) @
                               reference(hf, _ids(docs[0])))], atol=ATOL, rtol=0)  # fmt: skip
    order = sorted(range(3), key=lambda i: -cosines[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = _post(server, path, {"model": "emb", "query": query, "documents": docs, "top_n": 2}).json()
        assert body["id"].startswith("rerank-") and body["usage"]["total_tokens"] > 0
        assert [r["index"] for r in body["results"]] == order[:2]
        assert [r["document"]["text"] for r in body["results"]] == [docs[i] for i in order[:2]]
        np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], [cosines[i] for i in order[:2]],
                                   atol=ATOL, rtol=0)  # fmt: skip
    assert len(_post(server, "/rerank", {"query": query, "documents": docs}).json()["results"]) == 3


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/v1/embeddings", {"input": ""}, "input", "empty"),
    ("/v1/embeddings", {"input": []}, "input", "non-empty"),
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions", ">= 1"),
    ("/v1/embeddings", {"input": "x", "dimensions": 24}, "dimensions", "one of the model's matryoshka_dimensions"),
    ("/pooling", {"input": "x", "dimensions": 65, "task": "token_embed"}, "dimensions", "matryoshka_dimensions"),
    ("/pooling", {"input": "x", "task": "token_classify"}, "task", "serves 'embed', 'token_embed'"),
    ("/pooling", {"input": "x", "task": "generate"}, "task", "must be one of"),
    ("/pooling", {"input": "x", "step_tag_id": 3}, "step_tag_id", "STEP pooling"),
    ("/v1/embeddings", {"input": [[5, 258]]}, "input", "[0, 258)"),
    ("/v1/embeddings", {"input": [[5] * 129]}, "input", "max_model_len"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format", "float"),
    ("/v1/embeddings", {"input": "x", "messages": [{"role": "user", "content": "x"}]}, "input", "one of them"),
    ("/v1/embeddings", {"input": "x", "activation": True}, "activation", "classifiers"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1", "as many as text_2"),
    ("/rerank", {"query": "a", "documents": []}, "documents", "non-empty"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", ">= 0"),
    ("/score", {"text_1": "a", "text_2": "b", "priority": 1}, "priority", "scheduling_policy"),
    ("/classify", {"input": "x"}, None, "embedding model"),
])  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(server, path, body, param, words):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"], error


def test_a_pooling_server_refuses_generation_and_keeps_serving(embedder, server, client):
    with pytest.raises(openai.BadRequestError, match="embedding model.*/v1/embeddings, /pooling, /score, /rerank"):
        client.completions.create(model="emb", prompt="hello", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="/v1/chat/completions is not served"):
        client.chat.completions.create(model="emb", messages=[{"role": "user", "content": "hi"}])
    assert [m.id for m in client.models.list().data] == ["emb"]
    kept = _post(server, "/v1/embeddings", {"input": [[5] * 129], "truncate_prompt_tokens": -1}).json()
    assert kept["usage"]["prompt_tokens"] == 128  # the last max_model_len tokens
    np.testing.assert_allclose(kept["data"][0]["embedding"], reference(embedder[0], [5] * 128), atol=ATOL, rtol=0)
    finished = server.wait_metrics(lambda m: any("finished_reason=\"stop\"" in k and v > 0 for k, v in m.items()))
    assert any("finished_reason=\"stop\"" in k and v > 0 for k, v in finished.items())  # pooled prompts count as stop


# -- in-process: a classifier, a cross-encoder and a generating model -------------------------------------------------


def _app(folder, **kwargs):
    from jaxpaged import LLM
    from jaxpaged.engine.async_engine import AsyncLLMEngine
    from jaxpaged.entrypoints.openai import ServerSettings, build_app

    engine = AsyncLLMEngine(LLM(str(folder), log_level="WARNING", **{**ENGINE, **kwargs}).engine)
    return build_app(engine, ServerSettings(["m"])), engine


def _call(app, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            return [await c.post(path, json=body) for path, body in requests]

    return asyncio.run(main())


def _classifier(folder, num_labels: int, **config):
    import transformers

    torch.manual_seed(num_labels)
    hf = transformers.LlamaForSequenceClassification(
        tiny_llama_config(num_key_value_heads=2, vocab_size=258, num_labels=num_labels, pad_token_id=0, **config)).eval()  # fmt: skip
    save_hf_model(hf, folder)
    _tokenizer().save_pretrained(folder)
    return hf


def _logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def test_classify_labels_and_probs_as_transformers_and_async_encode(tmp_path):
    from jaxpaged.outputs import PoolingRequestOutput
    from jaxpaged.pooling_params import PoolingParams

    labels = {0: "neg", 1: "neu", 2: "pos"}
    hf = _classifier(tmp_path, 3, id2label=labels, label2id={v: k for k, v in labels.items()})
    app, engine = _app(tmp_path)
    texts = ["I loved it", "It was fine, I suppose, on the whole."]
    try:
        r, embed, score = _call(app, [("/classify", {"model": "m", "input": texts}), ("/v1/embeddings", {"input": "x"}),
                                      ("/score", {"text_1": "a", "text_2": "b"})])  # fmt: skip
        body = r.json()
        assert r.status_code == 200 and body["id"].startswith("classify-") and body["object"] == "list"
        for i, (text, d) in enumerate(zip(texts, body["data"])):
            logits = _logits(hf, _ids(text))
            want = np.exp(logits) / np.exp(logits).sum()
            assert (d["index"], d["num_classes"], d["label"]) == (i, 3, labels[int(np.argmax(want))])
            np.testing.assert_allclose(d["probs"], want, atol=ATOL, rtol=0)
        assert body["usage"]["prompt_tokens"] == sum(len(_ids(t)) for t in texts)
        for refused in (embed, score):
            assert refused.status_code == 400 and "classifier with 3 label(s)" in refused.json()["error"]["message"]
            assert refused.json()["error"]["message"].endswith("serves /classify, /pooling")

        async def encode():  # vLLM's AsyncLLM.encode: the final PoolingRequestOutput
            return [out async for out in engine.encode(texts[0], PoolingParams(), "encode-0")]

        (out,) = asyncio.run(encode())
        assert isinstance(out, PoolingRequestOutput) and out.finished and out.prompt_token_ids == _ids(texts[0])
        np.testing.assert_allclose(out.outputs.data, body["data"][0]["probs"], atol=ATOL, rtol=0)
    finally:
        engine.shutdown()


def test_a_cross_encoder_reranks_by_its_sigmoid_over_the_pair(tmp_path):
    hf = _classifier(tmp_path, 1)
    app, engine = _app(tmp_path)
    tok = _tokenizer()
    query, docs = "capital of France", ["Paris is the capital.", "Bananas are yellow.", "France's capital: Paris"]
    try:
        rerank, score = _call(app, [("/rerank", {"query": query, "documents": docs}),
                                    ("/score", {"text_1": query, "text_2": docs[0]})])  # fmt: skip
    finally:
        engine.shutdown()
    want = [float(1 / (1 + np.exp(-_logits(hf, tok(query, d)["input_ids"])[0]))) for d in docs]
    results = rerank.json()["results"]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -want[i])
    np.testing.assert_allclose([r["relevance_score"] for r in results], sorted(want, reverse=True), atol=ATOL, rtol=0)
    assert score.json()["data"][0]["score"] == pytest.approx(want[0], abs=ATOL)


def test_a_generating_server_refuses_the_pooling_endpoints(cycle_model_dir):
    app, engine = _app(cycle_model_dir, max_model_len=64, num_kv_blocks=16)
    bodies = {"/v1/embeddings": {"input": "x"}, "/classify": {"input": "x"}, "/score": {"text_1": "a", "text_2": "b"},
              "/v1/rerank": {"query": "a", "documents": ["b"]}}  # fmt: skip
    try:
        responses = _call(app, list(bodies.items()))
    finally:
        engine.shutdown()
    for r in responses:
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "generates text" in message and message.endswith("serves /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages")

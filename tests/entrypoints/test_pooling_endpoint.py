"""vLLM's /pooling on a token classifier (a *ForTokenClassification checkpoint): per-token softmax rows equal to
transformers', the raw logits, base64; the other pooling endpoints refused with a 400; bad fields are 400s."""

from __future__ import annotations

import base64

import numpy as np

from tests.entrypoints.test_pooling_api import ATOL, _app, _call, _ids, _tokenizer
from tests.hf_reference import save_hf_model, tiny_llama_config, torch


def test_pooling_serves_a_token_classifier_and_refuses_the_rest(tmp_path):
    import transformers

    torch.manual_seed(4)
    hf = transformers.LlamaForTokenClassification(tiny_llama_config(num_key_value_heads=2, vocab_size=258,
                                                                    num_labels=2)).eval()  # fmt: skip
    with torch.no_grad():
        hf.score.bias.normal_(0.0, 1.0)  # (zero at init: a bias left out must show)
    save_hf_model(hf, tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    app, engine = _app(tmp_path)
    texts = ["a step. another step.", "one"]
    try:
        ok, raw, packed, *refused = _call(app, [
            ("/pooling", {"model": "m", "input": texts}),
            ("/pooling", {"input": [_ids(texts[0])], "use_activation": False, "task": "token_classify"}),
            ("/pooling", {"input": texts[1], "encoding_format": "base64"}),
            ("/classify", {"input": "x"}), ("/v1/embeddings", {"input": "x"}), ("/score", {"text_1": "a", "text_2": "b"}),
            ("/v1/completions", {"model": "m", "prompt": "x"}),
            ("/pooling", {"input": "x", "dimensions": 8}), ("/pooling", {"input": "x", "task": "embed"}),
            ("/pooling", {"input": "x", "normalize": True}),
        ])  # fmt: skip
        again = _call(app, [("/pooling", {"input": texts[1]})])[0]  # it keeps serving
    finally:
        engine.shutdown()
    body = ok.json()
    assert ok.status_code == 200 and body["id"].startswith("pool-")
    assert body["usage"]["prompt_tokens"] == sum(len(_ids(t)) for t in texts)
    for i, (text, d) in enumerate(zip(texts, body["data"])):
        with torch.no_grad():
            logits = hf(torch.tensor([_ids(text)])).logits[0].numpy()
        assert (d["index"], d["object"]) == (i, "pooling")
        np.testing.assert_allclose(d["data"], np.exp(logits) / np.exp(logits).sum(-1, keepdims=True), atol=ATOL, rtol=0)
        if i == 0:
            np.testing.assert_allclose(raw.json()["data"][0]["data"], logits, atol=ATOL, rtol=0)
    rows = np.frombuffer(base64.b64decode(packed.json()["data"][0]["data"]), dtype="<f4").reshape(len(_ids(texts[1])), 2)
    np.testing.assert_allclose(rows, body["data"][1]["data"], atol=ATOL, rtol=0)
    for r in refused[:4]:
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_endpoint", r.text
        assert "token classifier with 2 label(s)" in r.json()["error"]["message"]
        assert r.json()["error"]["message"].endswith("serves /pooling")
    for r, param in zip(refused[4:], ("dimensions", "task", "normalize")):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert again.status_code == 200 and again.json()["data"][0]["data"] == body["data"][1]["data"]

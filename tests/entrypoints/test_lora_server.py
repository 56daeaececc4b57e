"""LoRA on the OpenAI server: --lora-modules adapters listed by /v1/models with their parent and selected by `model`
(greedy text equal to transformers + PEFT), runtime load/unload behind --allow-runtime-lora-updating and the API key,
errors in OpenAI's format."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import CYCLE_MODEL, ENGINE_ARGS
from tests.server_harness import ServerProcess

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
openai = pytest.importorskip("openai")
import transformers  # noqa: E402

from tests.models.test_lora import write_peft_adapter  # noqa: E402

KEY = "lora-key"
PROMPT = "ab"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(cycle_model_dir, tmp_path_factory):
    """Two PEFT adapters on the cycle model, and each one's (and the base's) greedy text from transformers + PEFT."""
    base = transformers.AutoModelForCausalLM.from_pretrained(cycle_model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(cycle_model_dir)
    root = tmp_path_factory.mktemp("cycle-adapters")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids

    def greedy(model):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, pad_token_id=0)  # fmt: skip
        return tokenizer.decode(out[0, ids.shape[1]:])

    texts = {"base": greedy(base)}
    for i, name in enumerate(("first", "second")):
        model = write_peft_adapter(base, root / name, 4, 8, ["q_proj", "up_proj", "down_proj"], False, seed=30 + i)
        texts[name] = greedy(model)
    return root, texts


@pytest.fixture(scope="module")
def server(cycle_model_dir, adapters, tmp_path_factory):
    root, _ = adapters
    proc = ServerProcess(
        ["--model", str(cycle_model_dir), "--served-model-name", CYCLE_MODEL, *ENGINE_ARGS, "--enable-lora", "--max-loras", "2",
         "--max-lora-rank", "8", "--lora-modules", f"first={root / 'first'}", "--allow-runtime-lora-updating"],
        tmp_path_factory.mktemp("lora-server") / "server.log", api_key=KEY,
    )  # fmt: skip
    yield proc
    proc.stop()


def _client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)


def _complete(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    return out.choices[0].text, out.model


def test_models_lists_adapters_with_their_parent(server):
    models = {m.id: m for m in _client(server).models.list().data}
    assert CYCLE_MODEL in models and "first" in models
    assert models["first"].model_dump()["parent"] == CYCLE_MODEL


def test_model_name_selects_the_adapter(server, adapters):
    _, texts = adapters
    assert texts["first"] != texts["base"]  # not vacuous: the adapter changes the greedy text
    client = _client(server)
    assert _complete(client, "first") == (texts["first"], "first")
    assert _complete(client, CYCLE_MODEL) == (texts["base"], CYCLE_MODEL)
    chat = client.chat.completions.create(model="first", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "first"


def test_runtime_load_and_unload(server, adapters):
    root, texts = adapters
    client = _client(server)
    url, auth = server.url, {"Authorization": f"Bearer {KEY}"}
    body = {"lora_name": "second", "lora_path": str(root / "second")}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401  # the key is needed
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth).status_code == 200
    assert _complete(client, "second")[0] == texts["second"]
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(root / "nowhere")}, headers=auth)
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "lora_path" and "not a folder" in bad.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "second"}, headers=auth).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "second")
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "second"}, headers=auth)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_not_found"
    assert _complete(client, "first")[0] == texts["first"]  # still serving

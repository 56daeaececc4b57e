"""An is_causal=false embedding model (gte-Qwen2's attention, set as vLLM users set it: hf_overrides
{"is_causal": false}) against transformers in float32: a tiny Qwen2Model whose every prompt token attends to the
whole prompt (transformers' own model given a full attention mask), MEAN pooling (every position counts), prompts batched in one
step and never chunked (each waits for a step with room), max_model_len capped at max_num_batched_tokens, prefix
caching off; the causal reading differs (so the check could not pass causally); refusals for a generating runner,
a port without bidirectional attention and hf_overrides on a non-folder; no compiles after warm-up."""

from __future__ import annotations

import json

import numpy as np
import pytest
from jaxpaged import LLM

from tests.hf_reference import random_prompts, torch
from tests.vlm_models import byte_tokenizer

transformers = pytest.importorskip("transformers")
LENGTHS = [3, 17, 30, 9, 25]  # 17 + 30 > 32: the 30-token prompt waits for the next step
BIDIRECTIONAL = {"is_causal": False}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    config = transformers.Qwen2Config(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      architectures=["Qwen2Model"])  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Qwen2Model(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    folder = tmp_path_factory.mktemp("gte")
    hf.save_pretrained(folder)
    byte_tokenizer(["<s>", "</s>"], "", bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    return hf, folder


def _hf(hf, prompt, bidirectional: bool) -> np.ndarray:
    ids = torch.tensor([prompt])
    mask = torch.zeros((1, 1, len(prompt), len(prompt))) if bidirectional else None  # 4-D: used as given
    with torch.no_grad():
        return hf(ids, attention_mask=mask).last_hidden_state[0].numpy()


def _pooled(h: np.ndarray, kind: str) -> np.ndarray:
    v = h.mean(0) if kind == "MEAN" else h[-1]
    return v / np.linalg.norm(v)


def test_bidirectional_embeddings_equal_transformers(qwen2):
    hf, folder = qwen2
    llm = LLM(str(folder), runner="pooling", hf_overrides=BIDIRECTIONAL, max_num_batched_tokens=32, max_num_seqs=4,
              log_level="WARNING", pooler_config={"pooling_type": "MEAN"})  # fmt: skip
    assert llm.engine.max_model_len == 32 and not llm.engine.scheduler.kv.pool.enable_caching
    prompts = random_prompts(258, LENGTHS, seed=3)
    outs = llm.embed(prompts, use_tqdm=False)  # MEAN pooling: every position's hidden state counts
    for prompt, out in zip(prompts, outs):
        want = _pooled(_hf(hf, prompt, True), "MEAN")
        np.testing.assert_allclose(np.asarray(out.outputs.embedding), want, atol=1e-5)
        assert np.abs(_pooled(_hf(hf, prompt, False), "MEAN") - want).max() > 1e-3  # causally it would differ
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed([list(range(40))], use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_compiles_after_warmup"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_what_is_refused(qwen2, tmp_path):
    _, folder = qwen2
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(str(folder), runner="generate", hf_overrides=BIDIRECTIONAL, log_level="WARNING")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(str(folder), runner="pooling", hf_overrides=BIDIRECTIONAL, max_model_len=64, max_num_batched_tokens=32,
            log_level="WARNING")  # fmt: skip
    with pytest.raises(ValueError, match="hf_overrides must be a dict"):
        LLM(str(folder), hf_overrides="[1]", log_level="WARNING")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(json.loads((folder / "config.json").read_text())))
    with pytest.raises(ValueError, match="hf_overrides applies to HF folders"):
        LLM(str(config), hf_overrides=BIDIRECTIONAL, log_level="WARNING")

"""The token tasks of a pooling engine (vLLM's token_embed and token_classify: ALL pooling, one output row per prompt
position; STEP: the rows at step_tag_id) against transformers in float32, through chunked prefill, preemption and
sequence-level requests in the same steps; LLM.reward on *ForTokenClassification checkpoints; no compiles after
warm-up, every KV block back."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM
from jaxpaged.outputs import PoolingRequestOutput
from jaxpaged.pooling_params import PoolingParams

from tests.engine.test_pooling import _with_tokenizer, engine, hidden_states, reference
from tests.hf_reference import random_prompts, save_hf_model, tiny_llama_config, torch


def _randomized(model, seed: int):
    """Every parameter random (the classifier's bias too), as tests.hf_reference.random_hf_model does."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    return model.eval()


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _check(outs, prompts, width: int) -> list[np.ndarray]:
    assert all(isinstance(o, PoolingRequestOutput) and o.finished for o in outs)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.outputs.data.shape for o in outs] == [(len(p), width) for p in prompts]
    return [o.outputs.data for o in outs]


def test_token_embed_through_chunks_preemption_and_beside_sequence_requests(tmp_path_factory):
    from tests.hf_reference import random_hf_model

    hf = random_hf_model(tiny_llama_config(num_key_value_heads=2, vocab_size=258))
    folder = _with_tokenizer(save_hf_model(hf, tmp_path_factory.mktemp("llama")))
    # 8 blocks of 16 tokens for prompts of up to 77 in 32-token steps: some are preempted and recomputed from 0
    llm = engine(folder, num_kv_blocks=8)
    prompts = random_prompts(258, [77, 70, 66, 5, 1], seed=12)
    prompts.append(prompts[0])  # ALL skips the prefix cache: every position computed again
    params = [PoolingParams(task="token_embed")] * 4 + [PoolingParams(task="token_embed", normalize=False)] * 2
    outs = llm.encode(prompts + prompts[:2], params + [PoolingParams(task="embed")] * 2, use_tqdm=False)
    for i, (prompt, got) in enumerate(zip(prompts, _check(outs[:6], prompts, 64))):
        h = hidden_states(hf, prompt)
        want = h if params[i].normalize is False else h / np.linalg.norm(h, axis=-1, keepdims=True)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for prompt, out in zip(prompts[:2], outs[6:]):  # LAST embeddings in the same steps
        np.testing.assert_allclose(out.outputs.data, reference(hf, prompt, "LAST"), atol=1e-5, rtol=0)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["kv_blocks_used"] == 0
    with pytest.raises(ValueError, match="token_classify"):
        llm.reward(prompts[:1])  # an embedding model serves embed and token_embed
    with pytest.raises(ValueError, match="step_tag_id"):
        llm.encode(prompts[:1], PoolingParams(step_tag_id=3), pooling_task="token_embed")
    for task in ("embed", "token_embed"):  # its config is not matryoshka: dimensions refused, as vLLM does
        with pytest.raises(ValueError, match="dimensions: this model does not support Matryoshka"):
            llm.encode(prompts[:1], PoolingParams(dimensions=16), pooling_task=task)
    assert llm.get_stats()["num_waiting"] == 0 and llm.get_stats()["num_running"] == 0


def test_matryoshka_dimensions_lists_the_dimensions_served():
    from types import SimpleNamespace

    from jaxpaged.engine.pooling import Pooler

    pooler = Pooler(None, None, 64, SimpleNamespace(matryoshka_dimensions=[16, 32]))
    assert pooler.check(PoolingParams(dimensions=16, task="token_embed")).dimensions == 16
    with pytest.raises(ValueError, match=r"dimensions must be one of .*\[16, 32\] \(got 24\)"):
        pooler.check(PoolingParams(dimensions=24))
    rows = np.arange(12, dtype=np.float32).reshape(3, 4) + 1
    cut = pooler.finish_tokens(np.pad(rows, ((0, 0), (0, 60))), [5, 6, 7], PoolingParams(dimensions=2, task="token_embed"))
    np.testing.assert_allclose(cut, rows[:, :2] / np.linalg.norm(rows[:, :2], axis=1, keepdims=True), rtol=1e-6)
    assert Pooler(None, None, 64, SimpleNamespace(is_matryoshka=True)).check(PoolingParams(dimensions=24)).dimensions == 24


@pytest.fixture(scope="module", params=["LlamaForTokenClassification", "Qwen3ForTokenClassification"])
def token_classifier(request, tmp_path_factory):
    import transformers

    if request.param.startswith("Qwen3"):
        config = transformers.Qwen3Config(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=512, num_labels=2, tie_word_embeddings=False)  # fmt: skip
    else:
        config = tiny_llama_config(num_key_value_heads=2, vocab_size=258, num_labels=3)
    hf = _randomized(getattr(transformers, request.param)(config), seed=5)
    return hf, _with_tokenizer(save_hf_model(hf, tmp_path_factory.mktemp(request.param)))


def test_reward_is_the_token_classifiers_per_token_softmax(token_classifier):
    hf, folder = token_classifier
    llm = engine(folder, runner="auto", num_kv_blocks=8)  # auto: a token classifier pools
    labels = hf.config.num_labels
    prompts = random_prompts(258, [77, 66, 60, 5, 1], seed=6)
    outs = llm.reward(prompts, use_tqdm=False)
    raw = llm.encode(prompts[3:4], PoolingParams(use_activation=False), use_tqdm=False)[0].outputs.data
    for i, (prompt, got) in enumerate(zip(prompts, _check(outs, prompts, labels))):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(got, softmax(logits), atol=1e-5, rtol=0)
        if i == 3:
            np.testing.assert_allclose(raw, logits, atol=1e-5, rtol=0)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["num_compiles_after_warmup"] == 0 and stats["kv_blocks_used"] == 0
    for call, task in ((llm.classify, "classify"), (llm.embed, "embed")):
        with pytest.raises(ValueError, match=f"task '{task}' is not supported"):
            call(prompts[:1])
    assert llm.reward(prompts[:1], use_tqdm=False)[0].outputs.data.shape == (77, labels)  # and it keeps serving


@pytest.mark.parametrize("token_classifier", ["LlamaForTokenClassification"], indirect=True)  # (3 labels)
def test_step_pooling_keeps_the_step_tag_rows_and_the_returned_columns(token_classifier):
    hf, folder = token_classifier
    tag = 7
    llm = engine(folder, runner="auto", pooler_config={"pooling_type": "STEP", "step_tag_id": tag})
    prompts = random_prompts(258, [40, 9], seed=9)
    prompts[0][5] = prompts[0][20] = prompts[0][39] = tag
    prompts[1] = [p for p in prompts[1] if p != tag]  # no step at all: no rows
    outs = llm.reward(prompts + prompts[:1], pooling_params=[PoolingParams()] * 2 + [PoolingParams(returned_token_ids=[2, 0])],
                      use_tqdm=False)  # fmt: skip
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[0]])).logits[0].numpy()
    steps = np.asarray(prompts[0]) == tag
    np.testing.assert_allclose(outs[0].outputs.data, softmax(logits[steps]), atol=1e-5, rtol=0)
    assert outs[1].outputs.data.shape == (0, 3)
    np.testing.assert_allclose(outs[2].outputs.data, softmax(logits[steps][:, [2, 0]]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="returned_token_ids"):
        llm.reward(prompts[:1], pooling_params=PoolingParams(returned_token_ids=[3]))


def test_a_sequence_classifier_also_classifies_each_token(tmp_path):
    import transformers

    hf = _randomized(transformers.LlamaForSequenceClassification(
        tiny_llama_config(num_key_value_heads=2, vocab_size=258, num_labels=2, pad_token_id=0)), seed=3)  # fmt: skip
    llm = engine(_with_tokenizer(save_hf_model(hf, tmp_path)), runner="auto")
    prompt = random_prompts(258, [33], seed=1)[0]
    got = _check(llm.encode([prompt], pooling_task="token_classify", use_tqdm=False), [prompt], 2)[0]
    with torch.no_grad():
        logits = hf.score(hf.model(torch.tensor([prompt])).last_hidden_state)[0].numpy()
    np.testing.assert_allclose(got, softmax(logits), atol=1e-5, rtol=0)
    assert llm.classify([prompt], use_tqdm=False)[0].outputs.num_classes == 2  # its own task still first

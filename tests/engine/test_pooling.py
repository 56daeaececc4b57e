"""A pooling engine (runner="pooling") against transformers in float32: embeddings (LAST, MEAN, CLS pooling of the
final hidden states, normalized or not, cut to `dimensions`) through chunked prefill, preemption and the prefix cache;
scores; the errors a caller can meet; and no compiles after warm-up."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM
from jaxpaged.outputs import EmbeddingRequestOutput
from jaxpaged.pooling_params import PoolerConfig, PoolingParams

from tests.hf_reference import random_hf_model, random_prompts, save_hf_model, tiny_llama_config, torch
from tests.vlm_models import byte_tokenizer

LENGTHS = [1, 5, 40, 77]  # 77: three chunks of a 32-token step


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # is_matryoshka: its config allows `dimensions` (vLLM's check)
    hf = random_hf_model(tiny_llama_config(num_key_value_heads=2, vocab_size=258, is_matryoshka=True))
    folder = save_hf_model(hf, tmp_path_factory.mktemp("llama"))
    byte_tokenizer(["<s>", "</s>"], "", bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    return hf, str(folder)


def hidden_states(hf, prompt: list[int]) -> np.ndarray:
    """transformers' last_hidden_state: the base model's output, after the final norm."""
    with torch.no_grad():
        return hf.model(torch.tensor([prompt])).last_hidden_state[0].numpy()


def reference(hf, prompt, pooling: str, normalize: bool = True, dimensions: int | None = None) -> np.ndarray:
    h = hidden_states(hf, prompt)
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling][:dimensions]
    return v / np.linalg.norm(v) if normalize else v


def engine(folder: str, **kwargs) -> LLM:
    kwargs = {"runner": "pooling", "max_num_batched_tokens": 32, "max_num_seqs": 4, "log_level": "WARNING", **kwargs}
    return LLM(folder, **kwargs)


def embeddings(outs) -> list[np.ndarray]:
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outs)
    return [np.asarray(o.outputs.embedding, np.float32) for o in outs]


@pytest.fixture(scope="module")
def last(model):
    return engine(model[1])


def test_last_token_embeddings_match_transformers(model, last):
    hf, _ = model
    prompts = random_prompts(hf.config.vocab_size, LENGTHS)
    outs = last.embed(prompts, use_tqdm=False)
    for prompt, out, got in zip(prompts, outs, embeddings(outs)):
        assert out.prompt_token_ids == prompt
        np.testing.assert_allclose(got, reference(hf, prompt, "LAST"), atol=1e-5, rtol=0)
    # the prefix cache serves a repeated prompt's blocks (LAST computes its last position anyway): the same vector
    again = last.encode(prompts[3:], use_tqdm=False)[0]
    np.testing.assert_allclose(again.outputs.data, reference(hf, prompts[3], "LAST"), atol=1e-5, rtol=0)
    assert last.get_stats()["prefix_cache_hits"] > 0
    assert last.get_stats()["num_compiles_after_warmup"] == 0


def test_async_encode_takes_a_priority(model, last):
    """AsyncLLMEngine.encode passes priority on, as generate does: refused under fcfs (naming it), 0 served."""
    import asyncio

    from jaxpaged.engine.async_engine import AsyncLLMEngine

    hf, _ = model
    prompt = random_prompts(hf.config.vocab_size, [6], seed=2)[0]
    engine = AsyncLLMEngine(last.engine)

    async def run(priority):
        return [out async for out in engine.encode({"prompt_token_ids": prompt}, PoolingParams(), f"p{priority}",
                                                   priority=priority)][-1]  # fmt: skip

    try:
        with pytest.raises(ValueError, match="priority 2 needs scheduling_policy"):
            asyncio.run(run(2))
        out = asyncio.run(run(0))
    finally:
        engine.shutdown()
    np.testing.assert_allclose(out.outputs.data, reference(hf, prompt, "LAST"), atol=1e-5, rtol=0)
    assert not last.engine.has_unfinished_requests()


def test_dimensions_and_normalize_per_request(model, last):
    hf, _ = model
    prompt = random_prompts(hf.config.vocab_size, [23], seed=3)[0]
    raw, cut = last.embed([prompt, prompt], use_tqdm=False, pooling_params=[
        PoolingParams(normalize=False), PoolingParams(dimensions=16)])  # fmt: skip
    np.testing.assert_allclose(raw.outputs.embedding, reference(hf, prompt, "LAST", normalize=False), atol=1e-5, rtol=0)
    assert cut.outputs.hidden_size == 16  # Matryoshka: cut, then normalized
    np.testing.assert_allclose(cut.outputs.embedding, reference(hf, prompt, "LAST", dimensions=16), atol=1e-5, rtol=0)


def test_score_is_the_cosine_of_the_embeddings(model, last):
    hf, _ = model
    tok = last.get_tokenizer()
    texts = ["The cat sat on the mat.", "A dog ran.", "Paris is the capital of France, and Rome of Italy."]
    scores = last.score(texts[0], texts[1:], use_tqdm=False)
    for text, out in zip(texts[1:], scores):
        u, v = (reference(hf, tok.encode(t), "LAST") for t in (texts[0], text))
        assert out.outputs.score == pytest.approx(float(u @ v), abs=1e-5)
    assert len(last.score(texts[:2], texts[1:], use_tqdm=False)) == 2  # N -> N
    with pytest.raises(ValueError, match="data_1"):
        last.score(texts, texts[:2])


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_mean_and_cls_through_chunks_preemption_and_a_repeated_prompt(model, pooling):
    hf, folder = model
    # 8 blocks of 16 tokens for four prompts of up to 77: chunks of several rows outgrow the pool, so some are
    # preempted and recomputed (a MEAN sum must start again, not add the recomputed chunks twice)
    llm = engine(folder, pooler_config={"pooling_type": pooling, "normalize": False}, num_kv_blocks=8)
    prompts = random_prompts(hf.config.vocab_size, [77, 70, 66, 60, 5], seed=11)
    prompts.append(prompts[0])  # MEAN and CLS skip the prefix cache: every position computed again
    for prompt, got in zip(prompts, embeddings(llm.embed(prompts, use_tqdm=False))):
        np.testing.assert_allclose(got, reference(hf, prompt, pooling, normalize=False), atol=1e-5, rtol=0)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["kv_blocks_used"] == 0  # every block back


def test_requests_a_pooling_engine_refuses(model, last):
    hf, _ = model
    with pytest.raises(ValueError, match="does not generate"):
        last.generate(["hello"])
    with pytest.raises(ValueError, match="dimensions"):
        last.embed(["hello"], pooling_params=PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match="activation"):
        last.embed(["hello"], pooling_params=PoolingParams(activation=True))
    with pytest.raises(ValueError, match="classify"):
        last.classify(["hello"])
    with pytest.raises(ValueError, match="max_model_len"):
        last.embed([[5] * 513])
    kept = last.embed([[5] * 600], truncate_prompt_tokens=-1, use_tqdm=False)[0]  # the last max_model_len (512)
    assert len(kept.prompt_token_ids) == 512
    with pytest.raises(ValueError, match="pooling_params"):
        last.encode(["hello"], pooling_params={"normalize": False})
    assert last.get_stats()["num_waiting"] == 0 and last.get_stats()["num_running"] == 0


def test_params_and_config_are_checked():
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="normalize"):
        PoolingParams(normalize="yes")
    with pytest.raises(ValueError, match="task"):
        PoolingParams(task="generate")
    assert PoolingParams(use_activation=False).activation is False
    with pytest.raises(ValueError, match="pooling_type"):
        PoolerConfig.parse('{"pooling_type": "max"}')
    with pytest.raises(ValueError, match="unknown"):
        PoolerConfig.parse({"pooling": "MEAN"})
    assert PoolerConfig.parse('{"pooling_type": "mean"}').pooling_type == "MEAN"


def test_a_generating_engine_refuses_pooling_params(model):
    _, folder = model
    with pytest.raises(ValueError, match="pooler_config"):
        LLM(folder, runner="generate", pooler_config={"pooling_type": "MEAN"})
    llm = LLM(folder, max_num_batched_tokens=32, max_num_seqs=4, log_level="WARNING")
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.embed(["hello"])
    assert llm.generate(["hello"], use_tqdm=False)[0].outputs[0].token_ids  # and it still generates


def test_the_generate_cli_refuses_a_pooling_runner_before_loading(capsys):
    from jaxpaged.entrypoints.generate import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--runner", "pooling", "hello"])
    assert exit_info.value.code == 2 and "LLM.embed" in capsys.readouterr().err


# -- checkpoints that are pooling models: runner "auto" picks pooling -------------------------------------------------


def _with_tokenizer(folder) -> str:
    byte_tokenizer(["<s>", "</s>"], "", bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    return str(folder)


def test_a_classifier_checkpoint_classifies_as_transformers(tmp_path):
    import transformers

    config = tiny_llama_config(num_key_value_heads=2, vocab_size=258, num_labels=3, pad_token_id=0,
                               id2label={0: "neg", 1: "neu", 2: "pos"}, label2id={"neg": 0, "neu": 1, "pos": 2})  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForSequenceClassification(config).eval()
    folder = _with_tokenizer(save_hf_model(hf, tmp_path))
    llm = engine(folder, runner="auto")
    prompts = random_prompts(258, LENGTHS, seed=2)
    outs = llm.classify(prompts, use_tqdm=False)
    raw = llm.encode(prompts[:1], PoolingParams(activation=False), use_tqdm=False)[0].outputs.data
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0].numpy()
        assert out.outputs.num_classes == 3
        np.testing.assert_allclose(out.outputs.probs, np.exp(logits) / np.exp(logits).sum(), atol=1e-5, rtol=0)
        if i == 0:
            np.testing.assert_allclose(raw, logits, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="embed"):
        llm.embed(prompts[:1])
    with pytest.raises(ValueError, match="one-label"):
        llm.score("a", ["b"])


def test_a_cross_encoder_scores_the_pair_with_its_sigmoid(tmp_path):
    import transformers

    torch.manual_seed(1)
    hf = transformers.LlamaForSequenceClassification(
        tiny_llama_config(num_key_value_heads=2, vocab_size=258, num_labels=1, pad_token_id=0)).eval()  # fmt: skip
    folder = _with_tokenizer(save_hf_model(hf, tmp_path))
    llm = engine(folder, runner="auto")
    tok = llm.get_tokenizer()
    query, docs = "capital of France", ["Paris is the capital.", "Bananas are yellow."]
    for doc, out in zip(docs, llm.score(query, docs, use_tqdm=False)):
        with torch.no_grad():
            logit = hf(torch.tensor([tok(query, doc)["input_ids"]])).logits[0, 0].item()
        assert out.outputs.score == pytest.approx(1 / (1 + np.exp(-logit)), abs=1e-5)


def test_a_sentence_transformers_embedding_model_pools_as_its_config_says(model, tmp_path):
    """A base model (LlamaModel: no `model.` prefix, no head) with modules.json asking for MEAN and no Normalize."""
    import json

    hf, _ = model
    hf.model.save_pretrained(tmp_path)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))  # fmt: skip
    llm = engine(_with_tokenizer(tmp_path), runner="auto")
    assert (llm.engine.pooler.pooling_type, llm.engine.pooler.normalize) == ("MEAN", False)
    prompts = random_prompts(258, [3, 50], seed=4)
    for prompt, got in zip(prompts, embeddings(llm.embed(prompts, use_tqdm=False))):
        np.testing.assert_allclose(got, reference(hf, prompt, "MEAN", normalize=False), atol=1e-5, rtol=0)


def test_lora_adapters_embed_as_peft_merged_models(model, tmp_path):
    """An embedding engine with enable_lora: each request's adapter, the base for the others, in one batch."""
    from jaxpaged import LoRARequest

    from tests.models.test_lora import write_peft_adapter

    hf, folder = model
    peft_model = write_peft_adapter(hf, tmp_path / "a", 4, 8, ["q_proj", "v_proj", "down_proj"], False, seed=3)
    llm = engine(folder, enable_lora=True, max_loras=1, max_lora_rank=8)
    prompts = random_prompts(hf.config.vocab_size, [9, 33], seed=8)
    adapter = LoRARequest("a", 1, str(tmp_path / "a"))
    outs = llm.embed(prompts * 2, lora_request=[adapter, adapter, None, None], use_tqdm=False)
    merged = peft_model.merge_and_unload()
    for i, (prompt, got) in enumerate(zip(prompts * 2, embeddings(outs))):
        np.testing.assert_allclose(got, reference(merged if i < 2 else hf, prompt, "LAST"), atol=1e-5, rtol=0)

"""DeepSeek-V3.2 (transformers' DeepseekV32ForCausalLM) through the V3 port's dense MLA: a tiny random model written by
save_pretrained, index_topk 32. While a sequence fits index_topk the indexer picks every token, so in float32 our
logits (within 1e-4 at every position) and greedy tokens equal transformers', which runs its indexer; past index_topk
transformers' sparse attention differs from dense, which is why the context is capped there. The indexer's tensors are
skipped, named in the ledger; the engine's max_model_len defaults to index_topk (an INFO record says why) and a larger
one is a ValueError naming max_model_len and index_topk."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from jaxpaged.models.loader import load_model

from tests.hf_reference import hf_greedy, hf_logits, random_hf_model, random_prompts, save_hf_model
from tests.models.test_deepseek import BASE, VOCAB, YARN
from tests.static_batch import StaticBatchRunner

torch = pytest.importorskip("torch")

TOPK = 32
INDEXER_PARTS = {"wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"}


def v32_config():
    """V3's tiny shape (q low-rank, YaRN, 4 groups of 2 experts, one shared expert) plus a small indexer."""
    return transformers.DeepseekV32Config(**BASE, q_lora_rank=48, n_shared_experts=1, routed_scaling_factor=2.5,
                                          n_group=4, topk_group=2, rope_parameters=YARN, index_topk=TOPK,
                                          index_head_dim=32, index_n_heads=4)  # fmt: skip


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    hf = random_hf_model(v32_config())
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("v32"))


def test_logits_and_greedy_match_transformers_within_index_topk(v32):
    hf, folder = v32
    assert type(hf).__name__ == "DeepseekV32ForCausalLM"
    loaded = load_model(str(folder), dtype="float32")
    cfg = loaded.config
    assert cfg.architecture == "DeepseekV32ForCausalLM" and cfg.rope_interleaved
    assert cfg.max_position_embeddings == TOPK  # the checkpoint's 512 capped at index_topk
    prompts = random_prompts(VOCAB, [1, 9, 20], seed=7)
    new = 12  # the longest sequence: 20 + 12 = index_topk
    greedy, logits = StaticBatchRunner(loaded, block_size=8).generate(prompts, new, return_prompt_logits=True)
    for prompt, got_logits, got_tokens in zip(prompts, logits, greedy):
        np.testing.assert_allclose(got_logits, hf_logits(hf, prompt), atol=1e-4, rtol=0)
        assert got_tokens == hf_greedy(hf, prompt, new)
    # the indexer, every layer's, skipped unread and named; nothing else is
    ((why, names),) = loaded.skipped_tensors.items()
    assert "indexer" in why and "index_topk" in why
    layers = range(cfg.num_layers)
    assert sorted(names) == sorted(f"model.layers.{i}.self_attn.indexer.{p}" for i in layers for p in INDEXER_PARTS)


def test_past_index_topk_the_sparse_model_is_not_dense(v32):
    """transformers' own model with its indexer picking every token (index_topk raised) is the dense path: equal within
    index_topk, different past it. So the cap is what makes dense MLA the model's attention."""
    hf, _ = v32
    prompt = random_prompts(VOCAB, [3 * TOPK], seed=5)[0]
    sparse = hf_logits(hf, prompt)
    indexers = [m for m in hf.modules() if type(m).__name__ == "DeepseekV32Indexer"]
    assert indexers
    try:
        for m in indexers:
            m.index_topk = 10**6
        dense = hf_logits(hf, prompt)
    finally:
        for m in indexers:
            m.index_topk = TOPK
    np.testing.assert_allclose(sparse[:TOPK], dense[:TOPK], atol=1e-5, rtol=0)
    assert np.abs(sparse[TOPK:] - dense[TOPK:]).max() > 1e-3


def test_engine_max_model_len_defaults_to_index_topk(v32, capfd):
    from jaxpaged import LLM, SamplingParams

    hf, folder = v32
    with pytest.raises(ValueError, match=r"max_model_len \(64\).*index_topk"):
        LLM(str(folder), dtype="float32", max_model_len=64, log_level="WARNING")
    capfd.readouterr()
    llm = LLM(str(folder), dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, block_size=4, num_kv_blocks=24,
              log_level="INFO")  # fmt: skip
    assert llm.engine.max_model_len == TOPK
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "INFO jaxpaged.engine: max_model_len is 32:" in line]
    assert len(said) == 1 and "index_topk=32" in said[0]  # the engine's log handler writes to stderr
    prompts = random_prompts(VOCAB, [14, 5], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in prompts]

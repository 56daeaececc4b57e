"""Speculative method "mtp" on a tiny DeepSeek-V3 with one MTP layer saved as DeepSeek names it: the layer's logits
against transformers' DeepseekV3DecoderLayer/RMSNorm and torch ops; greedy output unchanged (batches, n = 2, chunked
prefill, preemption); layers built to predict the token after next accept every guess (the token path: k = 3; the
hidden-state path with the layer's own head: k = 1); blocks all back, nothing compiled after warm-up; bad configs."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import transformers

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.loader import load_model
from jaxpaged.spec_decode.mtp import load_mtp_layer

from tests.hf_reference import hf_greedy, random_hf_model, random_prompts
from tests.spec_decode.mtp_checkpoints import (
    D, VOCAB, assert_clean, assert_walks_the_cycle_and_accepts_all, generate_tokens, hf_mtp_reference, hf_norm, mtp_spec,
    nextn_checkpoint, our_mtp, random_pairs,
)  # fmt: skip

torch = pytest.importorskip("torch")

N = 2  # target layers; the MTP layer is model.layers.2
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=D, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
    kv_lora_rank=32, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=32, num_experts_per_tok=2, n_routed_experts=8,
    first_k_dense_replace=1, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=0,
    q_lora_rank=48, n_shared_experts=1, routed_scaling_factor=2.5, n_group=4, topk_group=2,
)  # fmt: skip
# 16-token steps: buckets 4-16 (the cycle prompts are 3-12 tokens)
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, block_size=8, log_level="WARNING")
_mtp_model = functools.partial(nextn_checkpoint, config_cls=transformers.DeepseekV3Config, config=CONFIG, n=N)


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtp")
    return folder, *_mtp_model(folder)


def test_the_layer_matches_transformers_modules(tmp_path):
    """Logits of the layer for (hidden state, next token) pairs at positions 0..T-1 against DeepseekV3DecoderLayer
    and DeepseekV3RMSNorm loaded with its weights, enorm/hnorm/eh_proj/concat in torch, float32 (own head too)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    hf, mtp = _mtp_model(tmp_path, own_head=True)
    loaded = load_model(str(tmp_path), dtype="float32")
    layer = load_mtp_layer(loaded, loaded.model.layers[0].self_attn.backend)
    assert layer.head is not None
    pre = f"model.layers.{N}."
    norm = lambda name: hf_norm(DeepseekV3RMSNorm, mtp[pre + name + ".weight"], hf.config.rms_norm_eps)  # noqa: E731
    hidden, ids = random_pairs()
    head = lambda h: h @ mtp[pre + "shared_head.head.weight"].T  # noqa: E731
    # transformers' DeepseekV3DecoderLayer(config, layer_idx=2) is the MTP block
    _, want = hf_mtp_reference(hf, hf.model.layers[N], norm("enorm"), norm("hnorm"), mtp[pre + "eh_proj.weight"],
                               norm("shared_head.norm"), head, ids, hidden, mask_first=True)  # fmt: skip
    np.testing.assert_allclose(our_mtp(loaded, layer, ids, hidden)[1], want, atol=1e-4, rtol=1e-4)


def _workload(count: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = random_prompts(VOCAB, rng.integers(3, 40, size=count).tolist(), seed=seed)
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True, n=2 if i % 4 == 3 else 1)
              for i, m in enumerate(rng.integers(5, 25, size=count).tolist())]  # fmt: skip
    return prompts, params


def test_greedy_unchanged_through_batches_chunks_and_preemption(random_mtp):
    """Transformers' greedy tokens for the target (its N layers: the MTP layer's tensors are not in model.safetensors),
    which the engine without speculation gives (tests/models/test_deepseek.py)."""
    folder = str(random_mtp[0])
    prompts, params = _workload(6, seed=2)
    target = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert target.config.num_hidden_layers == N
    target.generation_config.eos_token_id = None  # as random_hf_model's: EOS is an ordinary token here (ignore_eos)
    expected = [[hf_greedy(target, p, s.max_tokens)] * s.n for p, s in zip(prompts, params)]
    llm = LLM(folder, speculative_config=mtp_spec(2), **{**ENGINE, "num_kv_blocks": 11})
    assert generate_tokens(llm, prompts, params) == expected
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_draft_tokens"] > 0, stats
    assert_clean(llm)


@pytest.mark.parametrize("construct, k", [("tokens", 3), ("hidden", 1)])
def test_a_layer_that_knows_the_token_after_next_is_always_accepted(construct, k, tmp_path):
    """Any misalignment (the token t instead of t + 1, the wrong row's hidden state or position, a chain step fed the
    wrong guess) proposes something else, and these tokens are then rejected."""
    _mtp_model(tmp_path, construct=construct)
    assert_walks_the_cycle_and_accepts_all(LLM(str(tmp_path), speculative_config=mtp_spec(k), **ENGINE))


@pytest.mark.parametrize("change, words", [
    ({"num_speculative_tokens": 8}, "below max_num_seqs"),
    ({"model": "x"}, "needs no model"),
])  # fmt: skip
def test_bad_mtp_configs_are_refused(random_mtp, change, words):
    with pytest.raises(ValueError, match=f"speculative_config.*{words}"):
        LLM(str(random_mtp[0]), speculative_config={**mtp_spec(2), **change}, **ENGINE)


def test_a_model_without_mtp_layers_is_refused(tmp_path):
    cfg = transformers.DeepseekV3Config(**CONFIG, num_hidden_layers=N, num_nextn_predict_layers=0)
    random_hf_model(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="speculative_config.method 'mtp'.*no multi-token-prediction"):
        LLM(str(tmp_path), speculative_config=mtp_spec(2), **ENGINE)
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(str(tmp_path), speculative_config=mtp_spec(2), pipeline_parallel_size=2, **ENGINE)

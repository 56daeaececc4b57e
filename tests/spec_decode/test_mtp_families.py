"""Speculative method "mtp" beyond DeepSeek-V3 (test_mtp.py): GLM-4.5's MTP layer (`model.layers.{N}.*`, GLM's
decoder layer: partial RoPE, q/k norm, biases, GLM's MoE) and Qwen3-Next's (`mtp.*`: a full-attention layer with
the model's MoE, (1 + w) norms, the target's lm_head) beside a hybrid target whose linear layers roll back.

Per family: the layer's logits against transformers' own modules loaded with its weights (1e-4, float32); then one
engine on a constructed checkpoint (mtp_checkpoints.py): a target that mostly walks a cycle of the vocabulary and an
MTP layer that knows the cycle, so guesses are both kept and rejected, greedy tokens and logprobs equal to
transformers'; then, its embedding scaled by update_weights, a target that walks the cycle exactly, every guess
accepted; every block back and nothing compiled after warm-up. The smallest configs."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.loader import load_model
from jaxpaged.spec_decode.mtp import attention_backend, load_mtp_layer

from tests.spec_decode.mtp_checkpoints import (
    D, VOCAB, assert_clean, assert_matches_transformers_path, assert_walks_the_cycle_and_accepts_all, cycle_prompts,
    hf_mtp_reference, hf_norm, mtp_spec, nextn_checkpoint, our_mtp, qwen_mtp_checkpoint, random_pairs,
    walk_the_cycle_exactly,
)  # fmt: skip

torch = pytest.importorskip("torch")

ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=8, log_level="WARNING")
BASE = dict(vocab_size=VOCAB, hidden_size=D, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=0)
# GLM-4.5's layout (tests/models/test_model_families_2026.py) with one target layer (dense); the MTP block is MoE
GLM = dict(BASE, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
           head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
           first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
           attention_bias=True, tie_word_embeddings=False)  # fmt: skip
GLM_LAYERS = 1


def _mixed_then_all_accepted(llm, hf, max_tokens=(16, 16, 16)) -> dict:
    """A target built with `residual` mostly walks the cycle; the MTP layer that knows the cycle has guesses kept and
    rejected: greedy tokens and logprobs are transformers' along the whole path (16-token chunks, a batch of 3). Then
    the target made to walk the cycle exactly (same engine): every guess accepted. Blocks back, nothing compiled.
    -> the first part's stats."""
    prompts = cycle_prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=0) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_matches_transformers_path(hf, prompts, [o.outputs[0] for o in outs])
    stats = llm.get_stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
    assert_clean(llm)
    walk_the_cycle_exactly(llm, hf)
    assert_walks_the_cycle_and_accepts_all(llm, max_tokens)
    return stats


# -- GLM-4.5 ------------------------------------------------------------------------------------------------------


def test_glm_layer_matches_transformers_modules(tmp_path):
    """GLM-4.5's layer against Glm4MoeDecoderLayer (layer_idx 1: MoE) and Glm4MoeRMSNorm with its weights."""
    hf, mtp = nextn_checkpoint(tmp_path, transformers.Glm4MoeConfig, GLM, GLM_LAYERS)
    loaded = load_model(str(tmp_path), dtype="float32")
    layer = load_mtp_layer(loaded, attention_backend(loaded.model))
    assert layer.head is None and layer.num_experts == 8
    pre = f"model.layers.{GLM_LAYERS}."
    norm = lambda name: hf_norm(Glm4MoeRMSNorm, mtp[pre + name + ".weight"], hf.config.rms_norm_eps)  # noqa: E731
    hidden, ids = random_pairs()
    _, want = hf_mtp_reference(hf, hf.model.layers[GLM_LAYERS], norm("enorm"), norm("hnorm"), mtp[pre + "eh_proj.weight"],
                               norm("shared_head.norm"), hf.lm_head, ids, hidden, mask_first=True)  # fmt: skip
    np.testing.assert_allclose(our_mtp(loaded, layer, ids, hidden)[1], want, atol=1e-4, rtol=1e-4)


def test_glm_greedy_unchanged_and_a_layer_that_knows_the_cycle_always_accepted(tmp_path, monkeypatch):
    """Also: the pool is sized with the MTP layer's cache counted (one more layer a block, its scratch blocks); while
    3 sequences run (disable_by_batch_size 3) the shadow step writes K/V only, the same K/V the full one writes."""
    from jaxpaged.platforms.cpu.platform import CpuPlatform

    sized, size = {}, CpuPlatform.num_kv_blocks
    spy = lambda self, config, **kw: sized.update(kw) or size(self, config, **kw)  # noqa: E731
    monkeypatch.setattr(CpuPlatform, "num_kv_blocks", spy)
    nextn_checkpoint(tmp_path, transformers.Glm4MoeConfig, GLM, GLM_LAYERS, construct="tokens", residual=3.0)
    # transformers reads the target's layers (model.safetensors), not mtp.safetensors
    target = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    llm = LLM(str(tmp_path), speculative_config=mtp_spec(3, disable_by_batch_size=3), **ENGINE)
    runner, proposer = llm.engine.runner, llm.engine.spec.proposer
    layer_bytes = runner.block_bytes // GLM_LAYERS
    assert sized["block_bytes"] == runner.block_bytes + layer_bytes
    scratch = proposer.rows * proposer.scratch_per_row
    assert sized["reserved_bytes"] >= scratch * layer_bytes and "the MTP layer's cache" in runner.memory_plan()
    _assert_kv_only_shadow_writes_the_full_ones_kv(proposer)
    stats = _mixed_then_all_accepted(llm, target, max_tokens=(6, 16, 24))
    assert stats["spec_decode_mtp_kv_only_steps"] > 0


def _assert_kv_only_shadow_writes_the_full_ones_kv(proposer) -> None:
    """The K/V-only shadow step against the full one on a 16-token step of random hidden states and tokens (the
    executables warm-up compiled)."""
    runner, t = proposer.runner, 16
    rng = np.random.default_rng(1)
    step = runner.input_batch.blank(t)
    hidden = rng.standard_normal((t, D)).astype(np.float32)
    inputs = proposer._put((hidden, runner._no_sampled, rng.integers(0, VOCAB, t).astype(np.int32),
                            np.full(t, -1, np.int32), np.arange(t, dtype=np.int32), step.attention))  # fmt: skip
    *_, full = proposer._shadow(runner.state, proposer.state, proposer.cache, *inputs, proposer._put(step.logit_rows))
    np.testing.assert_array_equal(np.asarray(proposer._shadow_kv(runner.state, proposer.state, proposer.cache, *inputs)),
                                  np.asarray(full))  # fmt: skip


# -- Qwen3-Next ---------------------------------------------------------------------------------------------------

# one Gated DeltaNet layer and one gated attention layer, both MoE with the shared expert; the MTP block is a
# full-attention MoE layer (transformers' layer 1 of the same config)
QWEN = dict(BASE, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, intermediate_size=96, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48)  # fmt: skip
# Qwen3.5 dense: tied embeddings, biased attention, partial RoPE 0.5 (as test_hybrid_models.py's qwen3.5-dense-tied)
QWEN35 = dict({k: v for k, v in QWEN.items() if "expert" not in k and "moe" not in k}, tie_word_embeddings=True,
              attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})  # fmt: skip


@pytest.mark.parametrize("config_cls, config, norm_cls, experts", [
    (transformers.Qwen3NextConfig, QWEN, Qwen3NextRMSNorm, 4),
    (transformers.Qwen3_5TextConfig, QWEN35, Qwen3_5RMSNorm, 0),
], ids=["qwen3-next-moe", "qwen3.5-dense-tied"])  # fmt: skip
def test_qwen_layer_matches_transformers_modules(config_cls, config, norm_cls, experts, tmp_path):
    """Qwen3-Next's and Qwen3.5's layer against their transformers decoder layer (full attention; MoE or MLP) and
    RMSNorm ((1 + w)) with its weights and the target's lm_head; the chained state is the output after mtp.norm."""
    config = config_cls(**config)
    hf, block, mtp = qwen_mtp_checkpoint(tmp_path, config, 1)
    loaded = load_model(str(tmp_path), dtype="float32")
    layer = load_mtp_layer(loaded, attention_backend(loaded.model))
    assert layer.head is None and layer.num_experts == experts
    norm = lambda name: hf_norm(norm_cls, mtp[f"mtp.{name}.weight"], config.rms_norm_eps)  # noqa: E731
    hidden, ids = random_pairs()
    want_out, want = hf_mtp_reference(hf, block, norm("pre_fc_norm_embedding"), norm("pre_fc_norm_hidden"),
                                      mtp["mtp.fc.weight"], norm("norm"), hf.lm_head, ids, hidden, mask_first=False)  # fmt: skip
    got_out, got = our_mtp(loaded, layer, ids, hidden)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(got_out, want_out, atol=1e-4, rtol=1e-4)


def test_qwen3_next_rejected_guesses_restore_the_linear_state_and_known_ones_are_accepted(tmp_path):
    """Each rejected row restores the Gated DeltaNet state saved before it and computes its kept tokens again (the
    logprobs would move otherwise: checked to fail without the restore)."""
    hf, _, _ = qwen_mtp_checkpoint(tmp_path, transformers.Qwen3NextConfig(**QWEN), 1, construct="tokens", residual=5.0)
    stats = _mixed_then_all_accepted(LLM(str(tmp_path), speculative_config=mtp_spec(3), **ENGINE), hf)
    assert stats["spec_decode_num_restored"] > 0

"""fuse_projections under tensor parallelism on 4 CPU devices: the fused q/k/v and gate/up weights split N ways give
each device its own heads and columns, so TP=2 and TP=4 (2 KV heads widened to 4, and a single KV head) decode as
transformers does, int8 weights with their scales too, pipeline stages of TP=2 too, and a weight update writes the
fused shards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.multi_device import needs_devices, reference_family, rerun_with_devices

VOCAB = 256
PROMPT_LENGTHS = [3, 11, 29]
MAX_TOKENS = 12


def test_with_devices():
    rerun_with_devices(__file__)


def _families():
    import transformers

    from tests.hf_reference import tiny_llama_config

    qwen = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}
    qwen |= {"num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": 0, "eos_token_id": 1}
    return {
        "llama-gqa2-bias": tiny_llama_config(
            num_attention_heads=8, num_key_value_heads=2, attention_bias=True, mlp_bias=True, max_position_embeddings=256
        ),
        "qwen3-qknorm": transformers.Qwen3Config(**qwen, head_dim=32),
        # one KV head, repeated on every device inside the fused weight; an ungated MLP (q/k/v only fuse)
        "falcon-mqa": transformers.FalconConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
            new_decoder_architecture=False, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
        ),
    }  # fmt: skip


_PREPARED: dict = {}


def _llm(folder, n, **kw):
    from jaxpaged import LLM

    return LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, block_size=8, tensor_parallel_size=n,
               attention_backend="reference", fuse_projections=True, log_level="WARNING", **kw)  # fmt: skip


def _greedy(llm, prompts):
    from jaxpaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# one size per family: llama-gqa2-bias at 4 (2 KV heads widened to 4 inside the fused weight; its TP=2 split in the
# pipeline test below), qwen3-qknorm at 2 (one KV head a device), falcon-mqa at 4 (its one KV head on every device)
FAMILY_SIZES = [("llama-gqa2-bias", 4), ("qwen3-qknorm", 2), ("falcon-mqa", 4)]


@needs_devices
@pytest.mark.parametrize("name,n", FAMILY_SIZES)
def test_tp2_and_tp4_fused_decode_as_transformers(name, n, tmp_path_factory):
    from tests.models.test_tensor_parallel import _assert_split_1_over_n

    folder, prompts, expected = reference_family(_PREPARED, name, _families()[name], tmp_path_factory, PROMPT_LENGTHS,
                                                 MAX_TOKENS, VOCAB)  # fmt: skip
    llm = _llm(folder, n)
    attn = llm.engine.runner.state["layers"][0]["self_attn"]
    assert "qkv_proj" in attn and "q_proj" not in attn
    assert _greedy(llm, prompts) == expected, f"tensor_parallel_size={n} differs"
    _assert_split_1_over_n(llm.engine.runner, n)
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


@needs_devices
def test_int8_fused_scales_split_with_their_columns(tmp_path_factory):
    folder, prompts, _ = reference_family(_PREPARED, "llama-gqa2-bias", _families()["llama-gqa2-bias"], tmp_path_factory,
                                          PROMPT_LENGTHS, MAX_TOKENS, VOCAB)  # fmt: skip
    want = _greedy(_plain(folder, quantization="int8"), prompts)  # unfused, one device
    assert _greedy(_llm(folder, 4, quantization="int8"), prompts) == want


def _plain(folder, **kw):
    from jaxpaged import LLM

    return LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, block_size=8,
               attention_backend="reference", log_level="WARNING", **kw)  # fmt: skip


@needs_devices
def test_weight_update_writes_the_fused_shards(tmp_path_factory):
    from tests.hf_reference import hf_greedy, random_hf_model

    folder, prompts, expected = reference_family(_PREPARED, "llama-gqa2-bias", _families()["llama-gqa2-bias"],
                                                 tmp_path_factory, PROMPT_LENGTHS, MAX_TOKENS, VOCAB)  # fmt: skip
    llm = _llm(folder, 4)
    assert _greedy(llm, prompts) == expected
    other = random_hf_model(_families()["llama-gqa2-bias"], seed=12)
    one = jax.devices()[0]
    shardings = [x.sharding for x in jax.tree_util.tree_leaves(llm.engine.runner.state)]
    llm.update_weights({name: jax.device_put(jnp.asarray(t.detach().numpy()), one) for name, t in other.state_dict().items()})
    assert [x.sharding for x in jax.tree_util.tree_leaves(llm.engine.runner.state)] == shardings
    assert _greedy(llm, prompts) == [hf_greedy(other, p, MAX_TOKENS) for p in prompts]
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


@needs_devices
def test_pipeline_stages_with_tensor_parallel_fused(tmp_path_factory):
    """P=2 x T=2: each stage's layers fused before the stages are cut, their columns split over the stage's devices."""
    folder, prompts, expected = reference_family(_PREPARED, "llama-gqa2-bias", _families()["llama-gqa2-bias"],
                                                 tmp_path_factory, PROMPT_LENGTHS, MAX_TOKENS, VOCAB)  # fmt: skip
    llm = _llm(folder, 2, pipeline_parallel_size=2)
    assert _greedy(llm, prompts) == expected
    assert llm.get_stats()["num_compiles_after_warmup"] == 0

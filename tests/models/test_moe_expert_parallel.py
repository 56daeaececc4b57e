"""MoE on 4 CPU devices: experts split over the "model" axis (expert parallelism) when it divides their count, else
each expert's intermediate features split; either way greedy tokens equal one device's and transformers' (GPT-OSS:
expert biases, attention sinks split by head; its MXFP4 experts kept 4-bit for the grouped GEMM, split either way).

As in test_tensor_parallel.py, the first test re-runs this file in a subprocess with 4 simulated devices.
"""

from __future__ import annotations

import pytest

from tests.multi_device import needs_devices, reference_family, rerun_with_devices


def test_expert_parallel_suite_on_four_cpu_devices():
    rerun_with_devices(__file__)


VOCAB = 256
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-5,
    bos_token_id=0, eos_token_id=1, pad_token_id=0,
)  # fmt: skip
_CACHE: dict = {}


def _configs():
    import transformers

    return {
        # 8 experts: 2 per device
        "mixtral-8x": transformers.MixtralConfig(
            **BASE, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
            num_experts_per_tok=2,
        ),
        # 6 experts: split by intermediate feature; a shared expert and a dense layer
        "qwen2moe-6x": transformers.Qwen2MoeConfig(
            **BASE, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4, mlp_only_layers=[0],
        ),
        # GPT-OSS, 6 experts: split by intermediate feature (its expert biases: gate/up split, down added once), its
        # sinks split with the heads, KV heads repeated to 4, a sliding layer beside a full one
        "gpt-oss-6x": transformers.GptOssConfig(
            **BASE, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=6,
            num_experts_per_tok=2, sliding_window=8,
        ),
    }  # fmt: skip


def _greedy(llm, prompts, max_tokens):
    from jaxpaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@needs_devices
@pytest.mark.parametrize("name", ["mixtral-8x", "qwen2moe-6x", "gpt-oss-6x"])
def test_four_devices_equal_one(name, tmp_path_factory):
    """transformers' tokens are one device's (test_moe.py checks that); 4 devices must give them too."""
    from jaxpaged import LLM
    from jaxpaged.models.moe import expert_parallel

    folder, prompts, expected = reference_family(_CACHE, name, _configs()[name], tmp_path_factory, [3, 17, 30], 16)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, block_size=8,
              tensor_parallel_size=4, attention_backend="reference", log_level="WARNING")  # fmt: skip
    assert _greedy(llm, prompts, 16) == expected
    # mixtral: 2 experts per device; qwen2moe (6 experts): a quarter of each expert's intermediate features
    kernel = llm.engine.runner.state["layers"][1]["mlp"]["experts"]["down_proj"]["kernel"][...]
    split_axis = 0 if expert_parallel(kernel.shape[0], 4) else 1
    assert split_axis == (0 if name == "mixtral-8x" else 1)
    if name == "gpt-oss-6x":  # each device holds its query head's sink
        sinks = llm.engine.runner.state["layers"][0]["self_attn"]["sinks"][...]
        assert all(s.data.shape == (1,) for s in sinks.addressable_shards)
    assert all(s.data.shape[split_axis] == kernel.shape[split_axis] // 4 for s in kernel.addressable_shards)
    assert all(s.data.size == kernel.size // 4 for s in kernel.addressable_shards)


@needs_devices
@pytest.mark.parametrize("name", ["mixtral-8x"])
def test_four_devices_with_the_grouped_gemm_kernel(name, tmp_path_factory):
    """moe_kernel="triton" (the GPU's kernel, interpreted here) inside each device's shard, on float experts split
    two a device (Mixtral): transformers' tokens. Each expert's features split, with GPT-OSS's gate/up biases in the
    kernel, runs the same kernel under the same shard_map in test_four_devices_with_mxfp4_experts_kept_4bit
    (feature-split; its experts 4-bit, which only the kernel's inner loop decodes), so GPT-OSS's float case is not
    run here again."""
    from jaxpaged import LLM

    folder, prompts, expected = reference_family(_CACHE, name, _configs()[name], tmp_path_factory, [3, 17, 30], 16)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, block_size=8,
              tensor_parallel_size=4, attention_backend="reference", moe_kernel="triton", log_level="WARNING")  # fmt: skip
    assert _greedy(llm, prompts, 16) == expected


@needs_devices
def test_experts_that_split_neither_way_are_a_clear_error(tmp_path):
    import transformers

    from jaxpaged import LLM
    from tests.hf_reference import random_hf_model, save_hf_model

    config = transformers.MixtralConfig(**BASE, intermediate_size=30, num_attention_heads=4, num_key_value_heads=4,
                                        num_local_experts=6, num_experts_per_tok=2)  # fmt: skip
    folder = save_hf_model(random_hf_model(config), tmp_path / "m")
    with pytest.raises(ValueError, match="num_experts=6"):
        LLM(str(folder), dtype="float32", tensor_parallel_size=4, log_level="WARNING")



@needs_devices
@pytest.mark.parametrize("experts,intermediate", [(8, 32), (6, 256)], ids=["expert-parallel", "feature-split"])
def test_four_devices_with_mxfp4_experts_kept_4bit(experts, intermediate, tmp_path_factory):
    """An MXFP4 GPT-OSS checkpoint with moe_kernel="triton" on 4 devices: its experts kept 4-bit (uint8 codes and
    scales) and split over the devices (8 experts: 2 each; 6 experts of 256 features: 64 features, one whole packed
    block, each); greedy tokens equal transformers' with the experts transformers' dequantization gives
    (write_mxfp4_checkpoint's model), which one device gives too (test_gpt_oss.py). Features that do not split into
    whole 64-row blocks (6 experts of 32) are a ValueError naming the fix."""
    import transformers

    from jaxpaged import LLM
    from tests.hf_reference import hf_greedy, random_hf_model, random_prompts, save_hf_model
    from tests.models.test_gpt_oss import write_mxfp4_checkpoint

    config = transformers.GptOssConfig(**BASE, intermediate_size=intermediate, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, num_local_experts=experts, num_experts_per_tok=2, sliding_window=8)  # fmt: skip
    hf = random_hf_model(config)
    root = tmp_path_factory.mktemp(f"gpt-oss-mxfp4-{experts}")
    folder = root / "mxfp4"
    dequantized = write_mxfp4_checkpoint(hf, save_hf_model(hf, root / "float"), folder)
    prompts = random_prompts(VOCAB, [3, 17, 30], seed=5)
    expected = [hf_greedy(dequantized, p, 12) for p in prompts]
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, block_size=8,
              attention_backend="reference", tensor_parallel_size=4, moe_kernel="triton", log_level="WARNING")  # fmt: skip
    experts_state = llm.engine.runner.state["layers"][0]["mlp"]["experts"]
    codes, scales = experts_state["down_proj"]["kernel"][...], experts_state["down_proj"]["mx_scale"][...]
    assert codes.dtype == scales.dtype == "uint8"
    split = 0 if experts == 8 else 1
    assert all(s.data.shape[split] == codes.shape[split] // 4 for s in codes.addressable_shards)
    assert all(s.data.shape[split] == scales.shape[split] // 4 for s in scales.addressable_shards)
    assert _greedy(llm, prompts, 12) == expected


@needs_devices
def test_mxfp4_features_that_do_not_split_into_blocks_are_a_clear_error(tmp_path):
    import transformers

    from jaxpaged import LLM
    from tests.hf_reference import random_hf_model, save_hf_model
    from tests.models.test_gpt_oss import write_mxfp4_checkpoint

    config = transformers.GptOssConfig(**BASE, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, num_local_experts=6, num_experts_per_tok=2, sliding_window=8)  # fmt: skip
    hf = random_hf_model(config)
    write_mxfp4_checkpoint(hf, save_hf_model(hf, tmp_path / "float"), tmp_path / "mxfp4")
    with pytest.raises(ValueError, match="MXFP4 experts split by feature"):
        LLM(str(tmp_path / "mxfp4"), dtype="float32", tensor_parallel_size=4, moe_kernel="triton", max_num_batched_tokens=8,
            max_num_seqs=4, log_level="WARNING")  # fmt: skip

"""DeepSeek-V3 (MLA) on 4 CPU devices: heads split (q_b_proj, kv_b_proj column-parallel, o_proj row-parallel), the
latent's projections and its cache whole on every device (one copy of each token's latent per device), experts split
two per device; greedy tokens equal transformers'. As in test_moe_expert_parallel.py, the first test re-runs this
file in a subprocess with 4 simulated devices."""

from __future__ import annotations

from tests.multi_device import needs_devices, reference_family, rerun_with_devices


def test_deepseek_tensor_parallel_suite_on_four_cpu_devices():
    rerun_with_devices(__file__)


@needs_devices
def test_four_devices_split_heads_and_replicate_the_latent(tmp_path_factory):
    from jaxpaged import LLM, SamplingParams
    from tests.models.test_deepseek import _configs

    folder, prompts, expected = reference_family({}, "deepseek-v3", _configs()["v3"], tmp_path_factory, [3, 17, 30], 12)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
              tensor_parallel_size=4, log_level="WARNING")  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    runner = llm.engine.runner
    attn = runner.state["layers"][1]["self_attn"]
    for name, split in (("q_b_proj", True), ("kv_b_proj", True), ("o_proj", True), ("q_a_proj", False),
                        ("kv_a_proj_with_mqa", False)):  # fmt: skip
        kernel = attn[name]["kernel"][...]
        assert all(s.data.size == kernel.size // (4 if split else 1) for s in kernel.addressable_shards), name
    # the cache: one latent row per token on each device (its KV-head axis holds a copy per device)
    cache = runner.kv_cache
    assert cache.shape[3] == 4 and all(s.data.shape[3] == 1 for s in cache.addressable_shards)
    assert all(s.data.shape[-1] * 2 == 32 + 16 for s in cache.addressable_shards)
    experts = runner.state["layers"][1]["mlp"]["experts"]["down_proj"]["kernel"][...]
    assert all(s.data.shape[0] == 2 for s in experts.addressable_shards)  # 8 experts, 2 per device

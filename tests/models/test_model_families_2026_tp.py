"""The 2026 MoE families (tests/models/test_model_families_2026.py) on 4 CPU devices: heads split, KV heads repeated
to one a device, 8 experts two a device (expert parallelism); MiniMax-M2, whose k norm spans every KV head, on 2
(one KV head a device) and refused on 4; greedy tokens equal transformers'. As in
test_deepseek_tp.py, the first test re-runs this file in a subprocess with 4 simulated devices."""

from __future__ import annotations

import pytest

from tests.multi_device import needs_devices, reference_family, rerun_with_devices

# (case, devices): a q/k norm over the whole projection (MiniMax-M2) allows at most one device per KV head
TP_CASES = [("glm4moe-groups-qknorm-bias", 4), ("minimax-m2-qknorm-rotary16", 2)]


def test_2026_families_tensor_parallel_suite_on_four_cpu_devices():
    rerun_with_devices(__file__)


@needs_devices
@pytest.mark.parametrize("case,n", TP_CASES)
def test_devices_split_heads_and_experts(case, n, tmp_path_factory):
    from jaxpaged import LLM, SamplingParams

    from tests.models.test_model_families_2026 import CASES

    config_cls, kwargs, _ = CASES[case]
    folder, prompts, expected = reference_family({}, case, config_cls(**kwargs), tmp_path_factory, [3, 17, 30], 12)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
              tensor_parallel_size=n, log_level="WARNING")  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    runner = llm.engine.runner
    q = runner.state["layers"][1]["self_attn"]["q_proj"]["kernel"][...]
    assert all(s.data.size == q.size // n for s in q.addressable_shards)
    experts = runner.state["layers"][1]["mlp"]["experts"]["down_proj"]["kernel"][...]
    assert all(s.data.shape[0] == 8 // n for s in experts.addressable_shards)  # 8 experts split over the devices


@needs_devices
@pytest.mark.parametrize("case", ["minimax-m2-qknorm-rotary16"])
def test_more_devices_than_kv_heads_is_refused_for_a_whole_width_k_norm(case, tmp_path):
    from jaxpaged import LLM

    from tests.models.test_model_families_2026 import CASES

    config_cls, kwargs, _ = CASES[case]
    config_cls(**kwargs).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 is more than this \w+'s 2 KV heads"):
        LLM(str(tmp_path / "config.json"), dtype="float32", tensor_parallel_size=4, log_level="WARNING")

"""LoRA under tensor parallelism on 4 simulated CPU devices: A/B split as their base weights (k/v widened with the
KV heads), three adapters and the base in one batch give the tokens one device gives."""

from __future__ import annotations

import pytest

from tests.multi_device import needs_devices, rerun_with_devices

pytest.importorskip("peft")


def test_lora_tp_suite_on_four_cpu_devices():
    rerun_with_devices(__file__)


@needs_devices
def test_tp_equals_one_device_with_mixed_adapters(model_dir, hf_model, tmp_path_factory):
    """TP 2 and TP 4 (KV heads widened) against one run on one device."""
    from jaxpaged import LLM, LoRARequest, SamplingParams

    from tests.hf_reference import random_prompts
    from tests.models.test_lora import write_peft_adapter

    root = tmp_path_factory.mktemp("tp-adapters")
    targets = [["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj", "v_proj"], ["k_proj"]]
    loras = []
    for i, t in enumerate(targets):
        write_peft_adapter(hf_model, root / f"a{i}", 4, 8, t, i == 2, seed=40 + i)
        loras.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(256, [5, 9, 13, 7], seed=11)]
    which = [loras[0], loras[1], None, loras[2]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kwargs = dict(dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, max_num_seqs=4,
                  max_num_batched_tokens=32, block_size=8, precompile=False, log_level="WARNING")  # fmt: skip
    one = LLM(model_dir, **kwargs).generate(prompts, params, use_tqdm=False, lora_request=which)
    for tp in (2, 4):
        split = LLM(model_dir, tensor_parallel_size=tp, **kwargs).generate(prompts, params, use_tqdm=False, lora_request=which)
        assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in one], tp

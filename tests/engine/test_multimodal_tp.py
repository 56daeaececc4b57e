"""Images under tensor parallelism (4 CPU devices, in a subprocess): the vision tower and its encoder cache are
replicated on every device (each device holds the whole tower, which runs once per image), the language model split
as always; greedy tokens at TP 2 equal transformers' (Qwen2.5-VL, and Gemma 3 with its image spans)."""

from __future__ import annotations

from tests.multi_device import needs_devices, rerun_with_devices


def test_multimodal_tp_on_four_cpu_devices():
    rerun_with_devices(__file__)


@needs_devices
def test_tp2_with_images_equals_transformers(tmp_path):
    import numpy as np
    from jaxpaged import LLM, SamplingParams

    from tests.vlm_models import hf_inputs, hf_vlm_greedy, images, qwen2_5_vl_checkpoint

    hf, processor, folder = qwen2_5_vl_checkpoint(tmp_path / "qwen", seed=1)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    text = f"<|im_start|>user\nLook {image} and {image}.<|im_end|>\n<|im_start|>assistant\n"
    pictures = [images((57, 77), (112, 64), seed=i) for i in range(2)]
    llm = LLM(str(folder), tensor_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64, log_level="WARNING")
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": p}} for p in pictures],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_vlm_greedy(hf, hf_inputs(processor, text, p), 8) for p in pictures]
    runner = llm.engine.runner
    visual = runner.state["visual"]["blocks"][0]["attn"]["qkv"]["kernel"]
    q = runner.state["layers"][0]["self_attn"]["q_proj"]["kernel"]
    assert all(s.data.shape == visual.shape for s in visual.value.addressable_shards)  # whole on each device
    assert all(s.data.shape[1] == q.shape[1] // 2 for s in q.value.addressable_shards)  # split in two
    assert len(runner.mm.array.sharding.device_set) == 2 and runner.mm.array.sharding.is_fully_replicated
    assert np.isfinite(np.asarray(runner.mm.array)).all()
    assert llm.get_stats()["num_compiles_after_warmup"] == 0



@needs_devices
def test_tp2_gemma3_image_spans_equal_transformers(tmp_path):
    """Gemma 3's image tokens attend both ways under shard_map too (the spans travel with the replicated metadata)."""
    from jaxpaged import LLM, SamplingParams

    from tests.vlm_models import gemma3_checkpoint, hf_inputs, hf_vlm_greedy, images

    hf, processor, folder = gemma3_checkpoint(tmp_path / "gemma3", seed=1)
    text = "<bos>A <start_of_image> and <start_of_image> here."
    pictures = images((40, 30), (80, 64), seed=12)
    llm = LLM(str(folder), tensor_parallel_size=2, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=32, log_level="WARNING")
    (out,) = llm.generate({"prompt": text, "multi_modal_data": {"image": pictures}},
                          SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert list(out.outputs[0].token_ids) == hf_vlm_greedy(hf, hf_inputs(processor, text, pictures), 8)

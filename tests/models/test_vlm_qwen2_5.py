"""Qwen2.5-VL reading images (its window-attention ViT, 2x2 patch merging, any image size, M-RoPE's 3-D positions
and the rope_deltas that continue them in decode), against transformers in float32 on a tiny random checkpoint:
logits within 1e-4 at every prompt position and greedy tokens identical, for one image, several images of different
sizes, an image in the middle of a chat and a batch mixing image and text-only prompts; the published checkpoints'
flat config (rope_scaling {"type": "mrope"}) reads as transformers 5's nested one."""

from __future__ import annotations

import json

import numpy as np
import pytest
from jaxpaged import LLM, SamplingParams
from jaxpaged.models.vision.qwen_vl import image_slots, window_layout
from jaxpaged.utils.text import ChatPrompt

from tests.vlm_harness import VLMRunner
from tests.vlm_models import QWEN_TWO, hf_vlm_greedy, hf_vlm_logits, images, qwen_vl_cases, qwen2_5_vl_checkpoint, qwen2_5_vl_config, random_vlm

SEED = 1
# architecture -> (a tiny config, a random model of it): tests/models/test_checkpoint_accounting.py loads it too
CASES = {"Qwen2_5_VLForConditionalGeneration": (qwen2_5_vl_config, random_vlm)}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"), seed=SEED)


@pytest.fixture(scope="module")
def runner(qwen):
    return VLMRunner(qwen[2])


def _cases(processor):
    """Images resized to grids of 4 x 4 to 8 x 8 patches: windows of 2 x 2 merge units, some padded."""
    return qwen_vl_cases(processor, second=(84, 100))


def test_window_layout_pads_windows_and_inverts():
    """A 6 x 10 patch image: 3 x 5 merge units in windows of 2 x 2 (4 windows padded), every unit once."""
    unit_of_slot, slot_of_unit = window_layout(6, 10, 2, 2)
    assert len(unit_of_slot) == 6 * 4 and sorted(unit_of_slot[unit_of_slot >= 0]) == list(range(15))
    assert np.array_equal(unit_of_slot[slot_of_unit], np.arange(15))
    assert image_slots(6, 10, 2, 2) == 24 * 4


def test_vision_features_equal_transformers_alone_and_batched(qwen, runner):
    import torch

    hf, processor, _ = qwen
    pictures = images((40, 30), (120, 64), (200, 90), seed=5)
    pv = processor.image_processor(images=pictures, return_tensors="pt")
    with torch.no_grad():
        want = hf.model.get_image_features(pv["pixel_values"], pv["image_grid_thw"]).pooler_output
    want = torch.cat(list(want)).numpy() if isinstance(want, (list, tuple)) else want.numpy()
    items = runner.adapter.items({k: v.numpy() for k, v in pv.items()}, [])
    bucket = runner.adapter.buckets(sum(item.num_patches for item in items))[-1]
    got = np.asarray(runner._encode(runner.state, runner.adapter.batch(items, bucket)))[: len(want), 0]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_logits_equal_transformers_batch_mixing_image_and_text(qwen, runner):
    import torch

    hf, processor, _ = qwen
    cases = _cases(processor)
    requests = [runner.inputs(spec.get("text"), spec.get("images", ()), spec.get("messages")) for spec, _ in cases.values()]
    for (name, (_, hf_in)), (ids, mm), got in zip(cases.items(), requests, runner.logits(requests)):
        assert ids == hf_in["input_ids"][0].tolist(), name
        if mm is not None:  # the 3-D positions and the decode offset transformers computes
            with torch.no_grad():
                pos, delta = hf.model.get_rope_index(hf_in["input_ids"], hf_in["mm_token_type_ids"], hf_in["image_grid_thw"])
            assert np.array_equal(pos[:, 0].numpy(), mm.mrope_positions) and int(delta) == mm.mrope_delta < 0, name
        np.testing.assert_allclose(got, hf_vlm_logits(hf, hf_in), atol=1e-4, err_msg=name)


def test_greedy_equals_transformers_through_the_engine(qwen):
    """Decode continues at p + rope_delta; prompts in 16-token chunks split images' spans across steps."""
    hf, processor, folder = qwen
    cases = _cases(processor)
    prompts = []
    for spec, _ in cases.values():
        if "messages" in spec:
            prompts.append(ChatPrompt(spec["messages"]))
        elif spec.get("images"):
            prompts.append({"prompt": spec["text"], "multi_modal_data": {"image": spec["images"]}})
        else:
            prompts.append(spec["text"])
    want = [hf_vlm_greedy(hf, hf_in, 10) for _, hf_in in cases.values()]
    for chunk in (64, 16):
        llm = LLM(str(folder), max_num_seqs=4, max_num_batched_tokens=chunk, num_kv_blocks=64, log_level="WARNING")
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want, chunk
        assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_published_flat_config_reads_as_the_nested_one(qwen, runner, tmp_path):
    """Qwen/Qwen2.5-VL-*'s config.json: the text fields at the top level, rope_scaling {"type": "mrope"}."""
    _, processor, folder = qwen
    raw = json.loads((folder / "config.json").read_text())
    text = raw.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**text, **raw, "model_type": "qwen2_5_vl", "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}  # fmt: skip
    for name in folder.iterdir():
        (tmp_path / name.name).write_bytes(name.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(flat))
    flat_runner = VLMRunner(tmp_path)
    assert flat_runner.loaded.config == runner.loaded.config
    request = runner.inputs(QWEN_TWO, images((120, 64), (84, 100), seed=3))
    np.testing.assert_array_equal(flat_runner.logits([request])[0], runner.logits([request])[0])

"""Qwen3-VL reading images (its ViT with a learned position grid resampled to each image, DeepStack features added
to the first decoder layers, interleaved M-RoPE), against transformers in float32 on a tiny random checkpoint:
vision features of every level, logits within 1e-4 at every prompt position for one image, several images of
different sizes, an image in the middle of a chat and a text-only prompt in one batch, and greedy tokens through the
engine with steps that cut images' spans."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from jaxpaged import LLM, SamplingParams
from jaxpaged.models.vision.qwen_vl import mrope_axes
from jaxpaged.utils.text import ChatPrompt

from tests.vlm_harness import VLMRunner, check_logits
from tests.vlm_models import QWEN_ONE, hf_vlm_greedy, images, qwen_vl_cases, qwen3_vl_checkpoint, qwen3_vl_config, random_vlm

SEED = 1
# architecture -> (a tiny config, a random model of it): tests/models/test_checkpoint_accounting.py loads it too
CASES = {"Qwen3VLForConditionalGeneration": (qwen3_vl_config, random_vlm)}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3_vl"), seed=SEED)


@pytest.fixture(scope="module")
def runner(qwen3):
    return VLMRunner(qwen3[2])


def _cases(processor):
    return qwen_vl_cases(processor, second=(84, 130))


def test_interleaved_sections_are_transformers():
    """Which position axis each frequency takes, for the released sections (24, 20, 20), as transformers composes it."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    tagged = torch.arange(3, dtype=torch.float32)[:, None, None, None].expand(3, 1, 1, 64).clone()  # axis a holds a
    rope = Qwen3VLTextRotaryEmbedding.__new__(Qwen3VLTextRotaryEmbedding)
    rope.mrope_section = [24, 20, 20]
    composed = rope.recomposition_frequencies(tagged)[0, 0, :64]
    assert composed.tolist() == mrope_axes((24, 20, 20), interleaved=True).tolist()


def test_vision_features_of_every_level_equal_transformers(qwen3, runner):
    hf, processor, _ = qwen3
    pictures = images((40, 30), (120, 64), (200, 90), seed=5)
    pv = processor.image_processor(images=pictures, return_tensors="pt")
    with torch.no_grad():
        out = hf.model.get_image_features(pv["pixel_values"], pv["image_grid_thw"])
    want = [torch.cat(list(out.pooler_output)).numpy()] + [torch.cat(list(f)).numpy() for f in out.deepstack_features]
    items = runner.adapter.items({k: v.numpy() for k, v in pv.items()}, [])
    bucket = runner.adapter.buckets(sum(item.num_patches for item in items))[-1]
    got = np.asarray(runner._encode(runner.state, runner.adapter.batch(items, bucket)))[: len(want[0])]
    assert got.shape[1] == len(want) == 2
    for level, features in enumerate(want):
        np.testing.assert_allclose(got[:, level], features, atol=1e-5)


def test_logits_equal_transformers_batch_mixing_image_and_text(qwen3, runner):
    hf, processor, _ = qwen3
    check_logits(hf, runner, _cases(processor))


def test_deepstack_features_matter(qwen3, runner):
    """Without the DeepStack level the logits would differ: the check above could not pass without it."""
    ids, mm = runner.inputs(QWEN_ONE, images((40, 30), seed=2))
    full = runner.logits([(ids, mm)])[0]
    encode = runner._encode
    runner._encode = lambda state, batch: encode(state, batch).at[:, 1:].set(0.0)
    try:
        without = runner.logits([(ids, mm)])[0]
    finally:
        runner._encode = encode
    assert np.abs(full - without).max() > 1e-3


def test_greedy_equals_transformers_through_the_engine(qwen3):
    hf, processor, folder = qwen3
    cases = _cases(processor)
    prompts = []
    for spec, _ in cases.values():
        if "messages" in spec:
            prompts.append(ChatPrompt(spec["messages"]))
        elif spec.get("images"):
            prompts.append({"prompt": spec["text"], "multi_modal_data": {"image": spec["images"]}})
        else:
            prompts.append(spec["text"])
    llm = LLM(str(folder), max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64, log_level="WARNING")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_vlm_greedy(hf, hf_in, 10) for _, hf_in in cases.values()]
    assert llm.get_stats()["num_compiles_after_warmup"] == 0

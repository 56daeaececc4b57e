"""The LLaVA family reading images against transformers in float32, on tiny random checkpoints: LLaVA-1.5 (CLIP read
at its second-to-last layer, the class token dropped), LLaVA-NeXT (any-resolution tiles, unpadded, a newline per
row) and LLaVA-OneVision (SigLIP, tiles resized past anyres_max_N, several images per prompt as whole images): the
image features, logits within 1e-4 at every prompt position for one image, two of different sizes (other grids), an
image in the middle of a chat and a text-only prompt in one batch, and greedy tokens through the engine."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from jaxpaged import LLM, SamplingParams
from jaxpaged.utils.text import ChatPrompt

from tests.vlm_harness import VLMRunner, check_logits
from tests.vlm_models import hf_inputs, hf_vlm_greedy, images, llava_checkpoint, llava_config, random_vlm

SEED = 1
KINDS = ["llava", "next", "onevision"]
ARCH = {"llava": "LlavaForConditionalGeneration", "next": "LlavaNextForConditionalGeneration",
        "onevision": "LlavaOnevisionForConditionalGeneration"}  # fmt: skip
# architecture -> (a tiny config, a random model of it): tests/models/test_checkpoint_accounting.py loads it too
CASES = {ARCH[kind]: (functools.partial(llava_config, kind), random_vlm) for kind in KINDS}
ONE = "USER: <image>\nWhat is it?\nASSISTANT:"
TWO = "USER: <image>\n<image>\nWhich is brighter?\nASSISTANT:"
TEXT = "USER: No picture, just words.\nASSISTANT:"


def _chat(*pictures):
    return [
        {"role": "user", "content": [{"type": "text", "text": "Hello there."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi! Send a picture."}]},
        {"role": "user", "content": [*({"type": "image", "image": p} for p in pictures), {"type": "text", "text": "What is it?"}]},
    ]


@pytest.fixture(scope="module", params=KINDS)
def llava(request, tmp_path_factory):
    kind = request.param
    hf, processor, folder = llava_checkpoint(kind, tmp_path_factory.mktemp(f"llava-{kind}"), seed=SEED)
    return kind, hf, processor, folder, VLMRunner(folder)


def _cases(processor):
    """Images whose best grids differ: 1 x 2, 2 x 1 and 3 x 2 tiles, so unpad cuts rows and columns."""
    one, two, chat = images((40, 30), seed=2), images((30, 80), (100, 70), seed=3), images((64, 48), seed=4)[0]
    return {
        "one-image": ({"text": ONE, "images": one}, hf_inputs(processor, ONE, one)),
        "two-images-of-different-sizes": ({"text": TWO, "images": two}, hf_inputs(processor, TWO, two)),
        "image-mid-chat": ({"messages": _chat(chat)}, hf_inputs(processor, messages=_chat(chat))),
        # one sample of two images (OneVision: both taken whole)
        "two-images-in-a-chat": ({"messages": _chat(*two)}, hf_inputs(processor, messages=_chat(*two))),
        "text-only": ({"text": TEXT}, hf_inputs(processor, TEXT)),
    }


def test_image_features_equal_transformers(llava):
    kind, hf, processor, _, runner = llava
    pictures = images((40, 30), (30, 80), (100, 70), seed=5)
    # OneVision: an image alone in its sample is tiled, several in one sample ([group]) are taken whole
    for group in ([pictures[0]], [pictures[2]], pictures[1:], [pictures[1:]]):
        inputs = processor.image_processor(images=group, return_tensors="pt")
        kwargs = {"image_sizes": inputs["image_sizes"]} if kind != "llava" else {}
        if kind == "onevision":
            kwargs["batch_num_images"] = inputs["batch_num_images"]
        with torch.no_grad():
            want = hf.model.get_image_features(inputs["pixel_values"], **kwargs).pooler_output
        want = torch.cat([w.reshape(-1, w.shape[-1]) for w in want]).numpy()
        items = runner.adapter.items({k: v.numpy() for k, v in inputs.items()}, [])
        bucket = runner.adapter.buckets(sum(item.num_patches for item in items))[-1]
        got = np.asarray(runner._encode(runner.state, runner.adapter.batch(items, bucket)))[: len(want), 0]
        assert sum(item.num_rows for item in items) == len(want)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_logits_equal_transformers_batch_mixing_image_and_text(llava):
    kind, hf, processor, _, runner = llava
    check_logits(hf, runner, _cases(processor), kind)


def test_greedy_equals_transformers_through_the_engine(llava):
    kind, hf, processor, folder, _ = llava
    cases = _cases(processor)
    prompts = []
    for spec, _ in cases.values():
        if "messages" in spec:
            prompts.append(ChatPrompt(spec["messages"]))
        elif spec.get("images"):
            prompts.append({"prompt": spec["text"], "multi_modal_data": {"image": spec["images"]}})
        else:
            prompts.append(spec["text"])
    llm = LLM(str(folder), max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=96, log_level="WARNING")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_vlm_greedy(hf, hf_in, 8) for _, hf_in in cases.values()]
    assert llm.get_stats()["num_compiles_after_warmup"] == 0

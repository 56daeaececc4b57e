"""Gemma 3 reading images (SigLIP, the projector's pooling, bidirectional attention among an image's tokens), against
transformers in float32 on a tiny random checkpoint: logits within 1e-4 at every prompt position and greedy tokens
identical, for one image, several images of different sizes, an image in the middle of a chat, and a batch mixing
image and text-only prompts (each equal to itself alone)."""

from __future__ import annotations

import numpy as np
import pytest
from jaxpaged import LLM, SamplingParams

from tests.vlm_harness import VLMRunner, check_logits
from tests.vlm_models import chat_with_image_parts, gemma3_checkpoint, hf_inputs, hf_vlm_greedy, images

SEED = 1  # a random model whose greedy tokens vary, and change with the image
ONE = "<bos>Describe <start_of_image> briefly."
TWO = "<bos>First <start_of_image> then <start_of_image>: which is brighter?"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return gemma3_checkpoint(tmp_path_factory.mktemp("gemma3-vlm"), seed=SEED)


@pytest.fixture(scope="module")
def runner(gemma3):
    return VLMRunner(gemma3[2])


def _cases(hf_processor):
    """name -> (jaxpaged's request spec for VLMRunner.inputs / LLM, transformers' inputs)."""
    one, two = images((40, 30), seed=2), images((80, 64), (17, 100), seed=3)
    chat = images((64, 48), seed=4)
    return {
        "one-image": ({"text": ONE, "images": one}, hf_inputs(hf_processor, ONE, one)),
        "two-images-of-different-sizes": ({"text": TWO, "images": two}, hf_inputs(hf_processor, TWO, two)),
        "image-mid-chat": ({"messages": chat_with_image_parts(chat[0])},
                           hf_inputs(hf_processor, messages=chat_with_image_parts(chat[0]))),
        "text-only": ({"text": "<bos>No picture here, just words."}, hf_inputs(hf_processor, "<bos>No picture here, just words.")),
    }


def test_vision_features_equal_transformers(gemma3, runner):
    import torch

    hf = gemma3[0]
    pixels = np.random.default_rng(0).standard_normal((3, 3, 56, 56)).astype(np.float32)
    with torch.no_grad():
        want = hf.model.get_image_features(torch.from_numpy(pixels)).pooler_output.numpy()
    got = np.asarray(runner._encode(runner.state, {"pixel_values": pixels}))
    np.testing.assert_allclose(got[:, 0], want.reshape(-1, want.shape[-1]), atol=1e-5)


def test_logits_equal_transformers_batch_mixing_image_and_text(gemma3, runner):
    """All four prompts in one step: each one's logits at every position equal transformers' for it alone."""
    hf, processor, _ = gemma3
    check_logits(hf, runner, _cases(processor))


def test_bidirectional_image_attention_matters(gemma3, runner):
    """The check above could not pass with causal attention among an image's tokens: transformers' logits differ."""
    import torch

    hf, processor, _ = gemma3
    hf_in = hf_inputs(processor, ONE, images((40, 30), seed=2))
    causal = {k: v for k, v in hf_in.items() if k != "token_type_ids"}  # no blocks: causal throughout
    with torch.no_grad():
        assert np.abs(hf(**causal).logits.numpy() - hf(**hf_in).logits.numpy()).max() > 1e-2


def test_greedy_equals_transformers_through_the_engine(gemma3):
    hf, processor, folder = gemma3
    cases = _cases(processor)
    llm = LLM(str(folder), max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, log_level="WARNING")
    prompts = []
    for spec, _ in cases.values():
        if "messages" in spec:
            from jaxpaged.utils.text import ChatPrompt

            prompts.append(ChatPrompt(spec["messages"]))
        elif spec.get("images"):
            prompts.append({"prompt": spec["text"], "multi_modal_data": {"image": spec["images"]}})
        else:
            prompts.append(spec["text"])
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for (name, (_, hf_in)), out in zip(cases.items(), outs):
        assert out.prompt_token_ids == hf_in["input_ids"][0].tolist(), name
        assert list(out.outputs[0].token_ids) == hf_vlm_greedy(hf, hf_in, 8), name
    stats = llm.get_stats()
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["encoder_images_encoded"] == 4

"""Pixtral towers reading images against transformers in float32, on tiny random checkpoints: Mistral 3
(Mistral3ForConditionalGeneration: the patch merger 2 x 2, its projector, a Ministral 3 language model) and Pixtral-12B
(LlavaForConditionalGeneration with a Pixtral tower: every patch, LLaVA's projector). Each image at its own
resolution, [IMG] rows ended by [IMG_BREAK] and the image by [IMG_END], as transformers' PixtralProcessor expands it:
the features of two images of different sizes batched (block-diagonal attention), logits within 1e-4 at every prompt
position for one image, two of different sizes, an image mid-chat and a text-only prompt in one ragged step, and
Mistral 3's greedy tokens through the engine (chunked prefill across image spans, prefix-cache hits only for the same
image, no compiles after warm-up)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from jaxpaged import LLM, SamplingParams
from jaxpaged.utils.text import ChatPrompt

from tests.vlm_harness import VLMRunner, check_logits, greedy_chat_through_server, png_data_url
from tests.vlm_models import (
    chat_with_image_parts, hf_inputs, hf_vlm_greedy, images, mistral3_checkpoint,
)  # fmt: skip

SEED = 1
ONE = "<s>[INST]Describe [IMG] briefly.[/INST]"
TWO = "<s>[INST]First [IMG] then [IMG]: which is brighter?[/INST]"
TEXT = "<s>[INST]No picture, just words.[/INST]"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


_SAVED: dict = {}


def _checkpoint(kind, tmp_path_factory):
    """(transformers model, processor, folder, VLMRunner), made once per kind for the module's tests."""
    if kind not in _SAVED:
        hf, processor, folder = mistral3_checkpoint(tmp_path_factory.mktemp(kind), kind, seed=SEED)
        _SAVED[kind] = hf, processor, folder, VLMRunner(folder)
    return _SAVED[kind]


@pytest.fixture(scope="module", params=["mistral3", "pixtral"])
def model(request, tmp_path_factory):
    return (request.param, *_checkpoint(request.param, tmp_path_factory))


def _cases(processor):
    """Images of different sizes: 40 x 30 is resized to fit the longest edge, 20 x 28 is not; both round up to
    whole tokens."""
    one, two, chat = images((40, 30), seed=2), images((20, 28), (36, 12), seed=3), images((24, 30), seed=4)[0]
    return {
        "one-image": ({"text": ONE, "images": one}, hf_inputs(processor, ONE, one)),
        "two-images-of-different-sizes": ({"text": TWO, "images": two}, hf_inputs(processor, TWO, two)),
        "image-mid-chat": ({"messages": chat_with_image_parts(chat)},
                           hf_inputs(processor, messages=chat_with_image_parts(chat))),
        "text-only": ({"text": TEXT}, hf_inputs(processor, TEXT)),
    }


def test_image_features_equal_transformers(model):
    """Two images of different sizes in one encoder call: each attends only to itself, as in transformers' batch."""
    kind, hf, processor, _, runner = model
    assert runner.loaded.skipped_tensors == {}  # every tensor of the checkpoint read (an unexplained one: an error)
    inputs = processor.image_processor(images=images((40, 30), (20, 28), seed=5), return_tensors="pt",
                                       patch_size=processor.patch_size * processor.spatial_merge_size)  # fmt: skip
    with torch.no_grad():
        want = hf.model.get_image_features(inputs["pixel_values"], image_sizes=inputs["image_sizes"]).pooler_output
    want = torch.cat([w.reshape(-1, w.shape[-1]) for w in want]).numpy()
    items = runner.adapter.items({k: v.numpy() for k, v in inputs.items()}, [])
    bucket = runner.adapter.buckets(sum(item.num_patches for item in items))[-1]
    got = np.asarray(runner._encode(runner.state, runner.adapter.batch(items, bucket)))[:, 0]
    tokens = np.concatenate([item.arrays["token"] for item in items])
    token_rows = [h // (processor.patch_size * processor.spatial_merge_size) for h, _ in inputs["image_sizes"].tolist()]
    assert (tokens == processor.image_break_token_id).sum() == sum(r - 1 for r in token_rows)  # a break between rows
    np.testing.assert_allclose(got[: len(tokens)][tokens < 0], want, atol=1e-5)  # the break rows aside


def test_logits_equal_transformers_batch_mixing_image_and_text(model):
    kind, hf, processor, _, runner = model
    check_logits(hf, runner, _cases(processor), kind)


def _llm(tmp_path_factory):
    """Mistral 3 through jaxpaged.LLM in 16-token steps, made once for the module's engine and server tests."""
    if "llm" not in _SAVED:
        folder = _checkpoint("mistral3", tmp_path_factory)[2]
        _SAVED["llm"] = LLM(str(folder), max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64, block_size=4,
                            log_level="WARNING")  # fmt: skip
    return _SAVED["llm"]


def test_greedy_equals_transformers_through_the_engine(tmp_path_factory):
    """16-token steps cut through the image spans; a second request with the first's image reuses its blocks, one
    with another image of the same size behind the same tokens does not."""
    hf, processor, _, _ = _checkpoint("mistral3", tmp_path_factory)
    cases = _cases(processor)
    prompts = [ChatPrompt(spec["messages"]) if "messages" in spec else
               {"prompt": spec["text"], "multi_modal_data": {"image": spec["images"]}} if spec.get("images") else spec["text"]
               for spec, _ in cases.values()]  # fmt: skip
    llm = _llm(tmp_path_factory)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for (name, (_, hf_in)), out in zip(cases.items(), outs):
        assert out.prompt_token_ids == hf_in["input_ids"][0].tolist(), name
        assert list(out.outputs[0].token_ids) == hf_vlm_greedy(hf, hf_in, 8), name
    first, other = cases["one-image"][0]["images"][0], images((40, 30), seed=9)[0]
    again, swapped = llm.generate([{"prompt": ONE, "multi_modal_data": {"image": [p]}} for p in (first, other)], GREEDY,
                                  use_tqdm=False)  # fmt: skip
    offset = again.prompt_token_ids.index(processor.image_token_id)
    assert again.num_cached_tokens > offset + 8 and swapped.num_cached_tokens <= offset
    assert list(again.outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)
    assert list(swapped.outputs[0].token_ids) == hf_vlm_greedy(hf, hf_inputs(processor, ONE, [other]), 8)
    stats = llm.get_stats()
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["encoder_images_encoded"] == 5  # one, two, the chat's, the other: the first's repeat from the cache


def test_an_image_chat_through_the_server(tmp_path_factory):
    """The server's chat path in-process over the same engine: an `image_url` data URL reaches transformers' prompt
    tokens (its chat template and processor on the same picture) and LLM.chat's answer, which equals transformers'."""
    hf, processor, _, _ = _checkpoint("mistral3", tmp_path_factory)
    llm = _llm(tmp_path_factory)
    picture = images((30, 20), seed=6)[0]
    chat = chat_with_image_parts(picture)
    (want,) = llm.chat(chat, GREEDY, use_tqdm=False)
    hf_in = hf_inputs(processor, messages=chat)
    assert list(want.outputs[0].token_ids) == hf_vlm_greedy(hf, hf_in, 8)
    chat[2]["content"][1] = {"type": "image_url", "image_url": {"url": png_data_url(picture)}}
    reply = greedy_chat_through_server(llm, chat, 8)
    assert reply["usage"]["prompt_tokens"] == hf_in["input_ids"].shape[1] == len(want.prompt_token_ids)
    assert reply["choices"][0]["message"]["content"] == want.outputs[0].text

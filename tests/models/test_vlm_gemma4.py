"""Gemma 4 reading images (its variable-resolution tower: 2-D RoPE, k x k pooling, clipped linears, standardized
soft tokens; the language model's per-layer inputs at an image's tokens), against transformers in float32 on tiny
random checkpoints (tests/vlm_models.py), causal (with an audio tower) and with `use_bidirectional_attention:
vision`: every checkpoint tensor read but the audio tower's; two images of different sizes in one encoder call equal to transformers'
features; logits within 1e-4 at every prompt position for one image, two of different sizes, an image mid-chat and a
text-only prompt in one ragged step; clipping and bidirectional attention each shown to change transformers'
output; the bidirectional model's greedy tokens through the engine (steps shorter than the two-image prompts) with
mm_processor_kwargs (Gemma 4's token budget per image) from the engine and from requests, no compiles after warm-up,
and a chat's image_url through the server's app in-process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from jaxpaged import LLM, SamplingParams
from jaxpaged.utils.text import ChatPrompt

from tests.vlm_harness import VLMRunner, check_logits, greedy_chat_through_server, png_data_url
from tests.vlm_models import (
    GEMMA4_IDS, chat_with_image_parts, gemma4_checkpoint, hf_inputs, hf_vlm_greedy, hf_vlm_logits, images,
)  # fmt: skip

SEED = 1
ONE = "<bos>Describe <|image|> briefly."
TWO = "<bos>First <|image|> then <|image|>: which is brighter?"
TEXT = "<bos>No picture here, just words."
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
_SAVED: dict = {}


def _checkpoint(kind: str, tmp_path_factory):
    """(transformers model, processor, folder, VLMRunner), made once per kind for the module's tests."""
    if kind not in _SAVED:
        hf, processor, folder = gemma4_checkpoint(tmp_path_factory.mktemp(kind), bidirectional=kind == "bidirectional",
                                                  audio=kind == "causal", seed=SEED)  # fmt: skip
        _SAVED[kind] = hf, processor, folder, VLMRunner(folder)
    return _SAVED[kind]


def _cases(processor, settings=None):
    """name -> (jaxpaged's request, transformers' inputs): images resized to 56-64 soft tokens each (the processor's
    70 at most), or to `settings`' budget."""
    one, two, chat = images((40, 30), seed=2), images((80, 64), (17, 100), seed=3), images((64, 48), seed=4)
    settings = settings or {}
    return {
        "one-image": ({"text": ONE, "images": one}, hf_inputs(processor, ONE, one, **settings)),
        "two-images-of-different-sizes": ({"text": TWO, "images": two}, hf_inputs(processor, TWO, two, **settings)),
        "image-mid-chat": ({"messages": chat_with_image_parts(chat[0])},
                           hf_inputs(processor, messages=chat_with_image_parts(chat[0]), **settings)),
        "text-only": ({"text": TEXT}, hf_inputs(processor, TEXT)),
    }


def _features(hf, inputs) -> np.ndarray:
    with torch.no_grad():
        out = hf.model.get_image_features(inputs["pixel_values"], inputs["image_position_ids"]).pooler_output
    return torch.cat(out).numpy()


def test_image_features_equal_transformers(tmp_path_factory):
    """Two images of different sizes in one encoder call: each attends only to itself, as in transformers' batch;
    the clipped linears' bounds are reached (transformers' features move without them)."""
    hf, processor, _, runner = _checkpoint("causal", tmp_path_factory)
    ((why, names),) = runner.loaded.skipped_tensors.items()  # the vision tower read, the audio tower skipped
    assert "audio" in why and names and all(n.startswith(("model.audio_tower.", "model.embed_audio.")) for n in names)
    inputs = processor.image_processor(images=images((40, 30), (20, 70), seed=5), return_tensors="pt")
    want = _features(hf, inputs)
    items = runner.adapter.items({k: v.numpy() for k, v in inputs.items() if hasattr(v, "numpy")}, [])
    assert [item.num_rows for item in items] == inputs["num_soft_tokens_per_image"].tolist()
    bucket = runner.adapter.buckets(sum(item.num_patches for item in items))[-1]
    got = np.asarray(runner._encode(runner.state, runner.adapter.batch(items, bucket)))[:, 0]
    np.testing.assert_allclose(got[: len(want)], want, atol=1e-5)
    clipped = [m for m in hf.modules() if type(m).__name__ == "Gemma4ClippableLinear"]
    for m in clipped:
        m.use_clipped_linears = False
    try:
        assert np.abs(_features(hf, inputs) - want).max() > 1e-2
    finally:
        for m in clipped:
            m.use_clipped_linears = True


@pytest.mark.parametrize("kind", ["causal", "bidirectional"])
def test_logits_equal_transformers_batch_mixing_image_and_text(kind, tmp_path_factory):
    hf, processor, _, runner = _checkpoint(kind, tmp_path_factory)
    check_logits(hf, runner, _cases(processor), kind)


def test_bidirectional_image_attention_matters(tmp_path_factory):
    """The bidirectional check above could not pass with causal attention among an image's tokens: transformers'
    logits without the token types (causal throughout) differ."""
    hf, processor, _, _ = _checkpoint("bidirectional", tmp_path_factory)
    hf_in = hf_inputs(processor, ONE, images((40, 30), seed=2))
    causal = {k: v for k, v in hf_in.items() if k != "mm_token_type_ids"}
    assert np.abs(hf_vlm_logits(hf, causal) - hf_vlm_logits(hf, hf_in)).max() > 1e-2


def test_greedy_equals_transformers_through_the_engine_with_mm_processor_kwargs(tmp_path_factory):
    """The bidirectional model with mm_processor_kwargs {"max_soft_tokens": 140} (twice the processor's 70: the
    encoder sized for it) in 160-token steps (an image's span kept within one): the four prompts' greedy tokens equal
    transformers' with the same setting; a request's own setting (back to 70) and LLM.chat's equal transformers'
    with that one; a setting the tower cannot take, a value the processor refuses and an image past the encoder's
    budget are ValueErrors naming them; no compiles after warm-up. Then a chat whose image comes as an image_url
    data URL through the server's app reaches transformers' prompt tokens and LLM.chat's answer, and a setting it
    cannot take is a 400."""
    hf, processor, folder, _ = _checkpoint("bidirectional", tmp_path_factory)
    budget, small = {"max_soft_tokens": 140}, {"max_soft_tokens": 70}
    cases = _cases(processor, budget)
    prompts = [ChatPrompt(spec["messages"]) if "messages" in spec else
               {"prompt": spec["text"], "multi_modal_data": {"image": spec["images"]}} if spec.get("images") else spec["text"]
               for spec, _ in cases.values()]  # fmt: skip
    llm = LLM(str(folder), max_num_seqs=4, max_num_batched_tokens=160, num_kv_blocks=160, mm_processor_kwargs=budget,
              log_level="WARNING")  # fmt: skip
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for (name, (_, hf_in)), out in zip(cases.items(), outs):
        assert out.prompt_token_ids == hf_in["input_ids"][0].tolist(), name
        assert list(out.outputs[0].token_ids) == hf_vlm_greedy(hf, hf_in, 8), name
    assert max(len(out.prompt_token_ids) for out in outs) > 160  # a prompt took more than one step
    # the random model writes <|video|>, which transformers embeds as the pad token (a placeholder wherever it is)
    assert GEMMA4_IDS["<|video|>"] in outs[1].outputs[0].token_ids
    one = cases["one-image"][0]["images"]
    (mine,) = llm.generate({"prompt": ONE, "multi_modal_data": {"image": one}, "mm_processor_kwargs": small}, GREEDY,
                           use_tqdm=False)  # fmt: skip
    hf_in = hf_inputs(processor, ONE, one, **small)
    assert mine.prompt_token_ids == hf_in["input_ids"][0].tolist() and len(mine.prompt_token_ids) < len(outs[0].prompt_token_ids)
    assert list(mine.outputs[0].token_ids) == hf_vlm_greedy(hf, hf_in, 8)
    for setting, match in [({"patch_size": 8}, "'patch_size' is not a setting"), ({"max_soft_tokens": 99}, "max_soft_tokens"),
                           ({"max_soft_tokens": 280}, "max_num_encoder_input_tokens")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            llm.generate({"prompt": ONE, "multi_modal_data": {"image": one}, "mm_processor_kwargs": setting}, GREEDY)
    picture = images((30, 20), seed=6)[0]
    chat = chat_with_image_parts(picture)
    (want,) = llm.chat(chat, GREEDY, use_tqdm=False, mm_processor_kwargs=small)
    hf_in = hf_inputs(processor, messages=chat, **small)
    assert want.prompt_token_ids == hf_in["input_ids"][0].tolist()
    assert list(want.outputs[0].token_ids) == hf_vlm_greedy(hf, hf_in, 8)
    stats = llm.get_stats()
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["encoder_images_encoded"] == 6
    chat[2]["content"][1] = {"type": "image_url", "image_url": {"url": png_data_url(picture)}}
    (ok, reply), (bad, error) = greedy_chat_through_server(
        llm, chat, 8, extras=[{"mm_processor_kwargs": small}, {"mm_processor_kwargs": {"image_seq_length": 3}}])
    assert ok == 200 and reply["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert reply["choices"][0]["message"]["content"] == want.outputs[0].text
    assert bad == 400 and "'image_seq_length' is not a setting" in error["error"]["message"]

"""Qwen3.5 reading images (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration: Qwen3-VL's tower
without DeepStack under the hybrid Gated DeltaNet language model, interleaved M-RoPE over a partial rotary width),
against transformers in float32 on tiny random checkpoints (tests/vlm_models.py): every checkpoint tensor read; logits
within 1e-4 at every prompt position for one image, two of different sizes, an image mid-chat and a text-only prompt
in one ragged step (dense; MoE less the chat), M-RoPE shown to matter; the dense model's greedy tokens through the
engine in 4-token steps that cut images' spans, with preemption and no compiles after warm-up, and a chat's image_url
through the server's app in-process.

Sized for CI's time (about 40 s of CPU on 2 cores, a cold executable cache): one vision block, two text layers, one
step shape in the engine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from jaxpaged import LLM, SamplingParams
from jaxpaged.utils.text import ChatPrompt

from tests.vlm_harness import VLMRunner, greedy_chat_through_server, png_data_url
from tests.vlm_models import hf_vlm_greedy, hf_vlm_logits, qwen3_5_checkpoint, qwen_vl_cases

SEED = 1
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
_SAVED: dict = {}


def _checkpoint(kind: str, tmp_path_factory):
    """(transformers model, processor, folder, VLMRunner), made once per kind for the module's tests."""
    if kind not in _SAVED:
        hf, processor, folder = qwen3_5_checkpoint(tmp_path_factory.mktemp(kind), moe=kind == "moe", seed=SEED)
        _SAVED[kind] = hf, processor, folder, VLMRunner(folder)
    return _SAVED[kind]


def _cases(processor):
    """The two images of different sizes: 128 x 64 and 64 x 64 pixels once resized (32 and 16 patches; the one
    image 24, the chat's 16), short prompts."""
    return qwen_vl_cases(processor, second=(50, 60))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_logits_equal_transformers_batch_mixing_image_and_text(kind, tmp_path_factory):
    """The four prompts (MoE: less the chat) and, beside them, the one-image prompt with text positions in M-RoPE's
    place: that one must not match (the 3-D positions decide the logits)."""
    hf, processor, _, runner = _checkpoint(kind, tmp_path_factory)
    assert runner.loaded.skipped_tensors == {}  # the tower read too (an unexplained tensor: an error)
    cases = {name: case for name, case in _cases(processor).items() if kind == "dense" or name != "image-mid-chat"}
    requests = [runner.inputs(spec.get("text"), spec.get("images", ()), spec.get("messages"))
                for spec, _ in cases.values()]  # fmt: skip
    ids, mm = requests[0]
    flat = dataclasses.replace(mm, mrope_positions=None, mrope_delta=0)
    *got, got_flat = runner.logits([*requests, (ids, flat)])
    for (name, (_, hf_in)), (ids, mm), logits in zip(cases.items(), requests, got):
        assert ids == hf_in["input_ids"][0].tolist(), name
        assert (mm is None) == ("pixel_values" not in hf_in), name
        want = hf_vlm_logits(hf, hf_in)
        np.testing.assert_allclose(logits, want, atol=1e-4, err_msg=f"{kind} {name}")
        if name == "one-image":
            assert np.abs(got_flat - want).max() > 1e-3


def _llm(tmp_path_factory) -> LLM:
    """The dense model through jaxpaged.LLM in 4-token steps, made once for the module's engine and server tests."""
    if "llm" not in _SAVED:
        folder = _checkpoint("dense", tmp_path_factory)[2]
        _SAVED["llm"] = LLM(str(folder), max_num_seqs=4, max_num_batched_tokens=4, num_kv_blocks=36, block_size=4,
                            log_level="WARNING")  # fmt: skip
    return _SAVED["llm"]


def _prompt(spec):
    if "messages" in spec:
        return ChatPrompt(spec["messages"])
    if spec.get("images"):
        return {"prompt": spec["text"], "multi_modal_data": {"image": spec["images"]}}
    return spec["text"]


def _hf_greedy(hf, hf_in, name: str) -> list[int]:
    """transformers' greedy tokens for a case, once per module (the engine and server tests share them)."""
    if ("greedy", name) not in _SAVED:
        _SAVED["greedy", name] = hf_vlm_greedy(hf, hf_in, GREEDY.max_tokens)
    return _SAVED["greedy", name]


def test_greedy_equals_transformers_through_the_engine(tmp_path_factory):
    """4-token steps (one step shape to compile), which end inside every image's span; a pool of 36 4-token blocks,
    which the chat's 134 tokens and the next prompt's prefill outgrow (preemption recomputes a sequence's linear
    layers' states from its prompt, images included)."""
    hf, processor, _, _ = _checkpoint("dense", tmp_path_factory)
    cases = _cases(processor)
    order = ["two-images-of-different-sizes", "one-image", "image-mid-chat", "text-only"]
    llm = _llm(tmp_path_factory)
    cuts, schedule = [], llm.engine.scheduler.schedule

    def recording(*args, **kwargs):  # image spans a step's rows end inside
        out = schedule(*args, **kwargs)
        for row in out.scheduled:
            mm, end = row.request.parent.mm, row.start + row.num_tokens
            cuts.extend(image for image in (mm.images if mm is not None else ()) if image.offset < end < image.end)
        return out

    llm.engine.scheduler.schedule = recording
    try:
        outs = llm.generate([_prompt(cases[name][0]) for name in order], GREEDY, use_tqdm=False)
    finally:
        llm.engine.scheduler.schedule = schedule
    for name, out in zip(order, outs):
        hf_in = cases[name][1]
        assert out.prompt_token_ids == hf_in["input_ids"][0].tolist(), name
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, hf_in, name), name
    stats = llm.get_stats()
    assert cuts and stats["num_preemptions"] > 0
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_an_image_chat_through_the_server(tmp_path_factory):
    """The server's chat path in-process over the same engine: the chat case's picture as an `image_url` data URL
    reaches transformers' prompt tokens (its chat template and processor) and LLM.chat's answer, which equals
    transformers'."""
    hf, processor, _, _ = _checkpoint("dense", tmp_path_factory)
    llm = _llm(tmp_path_factory)
    spec, hf_in = _cases(processor)["image-mid-chat"]
    chat = spec["messages"]
    (want,) = llm.chat(chat, GREEDY, use_tqdm=False)
    assert list(want.outputs[0].token_ids) == _hf_greedy(hf, hf_in, "image-mid-chat")
    chat[2]["content"][0] = {"type": "image_url", "image_url": {"url": png_data_url(chat[2]["content"][0]["image"])}}
    reply = greedy_chat_through_server(llm, chat, 8)
    assert reply["usage"]["prompt_tokens"] == hf_in["input_ids"].shape[1] == len(want.prompt_token_ids)
    assert reply["choices"][0]["message"]["content"] == want.outputs[0].text

"""Videos in prompts (Qwen3-VL; Qwen3.5 sharing its adapter, its logits beside an image; Gemma 4): transformers' own
Qwen3VLVideoProcessor samples and patches the frames and writes each frame group's timestamp and span; each group is
encoded as an image (transformers' tower attends within a group) and positioned as one by M-RoPE (get_rope_index
splits a video's grid per group).
Against transformers in float32 on a tiny random checkpoint: logits within 1e-4 at every prompt position for a video
with its metadata (frames sampled at the processor's fps) beside an image, a video given as frames alone, and text,
in one ragged step; greedy tokens through the engine for a prompt (sampled at the processor's fps, or at a request's
mm_processor_kwargs fps) and a chat with a video part, no compiles after
warm-up; bad frames are a ValueError naming them; an mp4 sent to the server as a video_url is decoded to what
transformers' own loader reads from the file, and answered as transformers does. Gemma 4's
frames, each between its timestamp text, are read by its tower as images: logits beside an image.

transformers builds video processors only with torchvision, which the suite's environment lacks on purpose (it
changes which image processor AutoProcessor builds): the first test re-runs this file in a subprocess with
torchvision from JAXPAGED_TEST_TORCHVISION (a `pip install --no-deps --target` folder; .ci/run sets it)."""

from __future__ import annotations

import base64
import importlib.util

import numpy as np
import pytest

from tests.vlm_harness import rerun_with_torchvision

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
needs_torchvision = pytest.mark.skipif(not HAS_TORCHVISION, reason="runs in the subprocess the first test starts")
TEXT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>then<|vision_start|><|video_pad|><|vision_end|>"
        "What happens?<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
ONLY_VIDEO = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Describe.<|im_end|>\n<|im_start|>assistant\n"
PLAIN = "<|im_start|>user\nNo video.<|im_end|>\n<|im_start|>assistant\n"
META = {"fps": 4.0, "total_num_frames": 8}


def test_in_a_subprocess_with_torchvision():
    if HAS_TORCHVISION:
        pytest.skip("torchvision is here: the tests below run in this process")
    rerun_with_torchvision(__file__, passed=4, skipped=1)


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    import transformers

    from tests.vlm_harness import VLMRunner
    from tests.vlm_models import qwen3_vl_config, random_vlm, write_vlm

    model = random_vlm(qwen3_vl_config(), seed=1)
    folder = write_vlm(tmp_path_factory.mktemp("qwen3-vl-video"), model, _qwen_video_processor())
    return model, transformers.AutoProcessor.from_pretrained(folder), folder, VLMRunner(folder)


def _qwen_video_processor():
    """Qwen3-VL's processor (Qwen3.5's too) with its video processor: 16-pixel patches merged 2 x 2, 2 frames a group."""
    import transformers

    from tests.vlm_models import QWEN_SPECIALS, QWEN_VL_CHAT_TEMPLATE, byte_tokenizer

    tokenizer = byte_tokenizer(QWEN_SPECIALS, QWEN_VL_CHAT_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    size = {"shortest_edge": 64 * 64, "longest_edge": 128 * 128}
    return transformers.Qwen3VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(size=size, patch_size=16, merge_size=2, temporal_patch_size=2),
        video_processor=transformers.Qwen3VLVideoProcessor(size=size | {"longest_edge": 128 * 128 * 8}, patch_size=16,
                                                           merge_size=2, temporal_patch_size=2),
        tokenizer=tokenizer, chat_template=QWEN_VL_CHAT_TEMPLATE,
    )  # fmt: skip


def _video(seed: int, frames: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, 48, 64, 3), dtype=np.uint8)


def _hf(processor, text, images=None, videos=None, **kwargs) -> dict:
    return dict(processor(text=text, images=images, videos=videos, return_tensors="pt", **kwargs))


@needs_torchvision
def test_logits_equal_transformers_for_videos_beside_images_and_text(qwen3_vl):
    from tests.vlm_models import hf_vlm_logits, images

    hf, processor, _, runner = qwen3_vl
    picture, with_meta, bare = images((40, 30), seed=2), _video(0), _video(1, frames=4)
    cases = [
        (runner.processor.prompt(TEXT, picture, None, [(with_meta, META)]),
         _hf(processor, TEXT, picture, [with_meta], video_metadata=[META])),
        (runner.processor.prompt(ONLY_VIDEO, [], None, [bare]), _hf(processor, ONLY_VIDEO, videos=[bare], do_sample_frames=False)),
        (runner.inputs(PLAIN), _hf(processor, PLAIN)),
    ]  # fmt: skip
    (ids, mm), _ = cases[0]
    assert [im.item.meta["grid"] for im in mm.images] == [(1, 4, 6), (1, 4, 4), (1, 4, 4)]  # the image, 2 frame groups
    requests = [(ids, mm if mm is not None and mm.images else None) for (ids, mm), _ in cases]
    for ((ids, _), hf_in), got in zip(cases, runner.logits(requests)):
        assert ids == hf_in["input_ids"][0].tolist()
        np.testing.assert_allclose(got, hf_vlm_logits(hf, hf_in), atol=1e-4)


@needs_torchvision
def test_qwen3_5_reads_videos_with_qwen3_vl_adapter(tmp_path):
    """Qwen3.5 (a Gated DeltaNet layer under Qwen3-VL's tower less DeepStack) shares Qwen3-VL's adapter and processor:
    a video sampled by its metadata's fps beside an image, logits within 1e-4 at every prompt position."""
    import transformers

    from tests.vlm_harness import VLMRunner
    from tests.vlm_models import hf_vlm_logits, images, qwen3_5_config, random_qwen3_5, write_vlm

    hf = random_qwen3_5(qwen3_5_config(), seed=1)
    folder = write_vlm(tmp_path, hf, _qwen_video_processor())
    processor, runner = transformers.AutoProcessor.from_pretrained(folder), VLMRunner(folder)
    picture, video = images((40, 30), seed=2), _video(5)
    ids, mm = runner.processor.prompt(TEXT, picture, None, [(video, META)])
    hf_in = _hf(processor, TEXT, picture, [video], video_metadata=[META])
    assert ids == hf_in["input_ids"][0].tolist() and len(mm.images) == 3  # the image, 2 frame groups
    (got,) = runner.logits([(ids, mm)])
    np.testing.assert_allclose(got, hf_vlm_logits(hf, hf_in), atol=1e-4)


@needs_torchvision
def test_greedy_equals_transformers_through_the_engine(qwen3_vl, tmp_path):
    from jaxpaged import LLM, SamplingParams

    from tests.vlm_harness import greedy_chat_through_server
    from tests.vlm_models import hf_vlm_greedy

    hf, processor, folder, _ = qwen3_vl
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(folder), max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, log_level="WARNING")
    video = _video(3)
    (out,) = llm.generate({"prompt": ONLY_VIDEO, "multi_modal_data": {"video": (video, META)}}, greedy, use_tqdm=False)
    hf_in = _hf(processor, ONLY_VIDEO, videos=[video], video_metadata=[META])
    assert out.prompt_token_ids == hf_in["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == hf_vlm_greedy(hf, hf_in, 8)
    # a request's mm_processor_kwargs sample its video at another fps (here every frame: twice the frame groups)
    every = {"prompt": ONLY_VIDEO, "multi_modal_data": {"video": (video, META)}, "mm_processor_kwargs": {"fps": 4}}
    (denser,) = llm.generate(every, greedy, use_tqdm=False)
    hf_in = _hf(processor, ONLY_VIDEO, videos=[video], video_metadata=[META], fps=4)
    assert denser.prompt_token_ids == hf_in["input_ids"][0].tolist() and len(denser.prompt_token_ids) > len(out.prompt_token_ids)
    assert list(denser.outputs[0].token_ids) == hf_vlm_greedy(hf, hf_in, 8)
    chat = [{"role": "user", "content": [{"type": "video", "video": video}, {"type": "text", "text": "What happens?"}]}]
    (said,) = llm.chat(chat, greedy, use_tqdm=False)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}],
                                         add_generation_prompt=True, tokenize=False)  # fmt: skip
    hf_in = _hf(processor, text, videos=[video], do_sample_frames=False)
    assert said.prompt_token_ids == hf_in["input_ids"][0].tolist()
    assert list(said.outputs[0].token_ids) == hf_vlm_greedy(hf, hf_in, 8)
    with pytest.raises(ValueError, match=r"video\[0\]: expected frames"):
        llm.generate({"prompt": ONLY_VIDEO, "multi_modal_data": {"video": np.zeros((4, 8, 8), np.uint8)}}, greedy)
    stats = llm.get_stats()
    assert stats["num_compiles_after_warmup"] == 0
    # an mp4 through the server, as a data URL: the frames and metadata transformers' own loader reads from the file,
    # sampled by the processor at its fps
    from transformers.video_utils import load_video

    from tests.vlm_models import write_video

    mp4 = write_video(tmp_path / "a.mp4", _video(4, frames=12), fps=4)
    url = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(mp4).decode()}},
                                        {"type": "text", "text": "What happens?"}]}]  # fmt: skip
    ((status, reply),) = greedy_chat_through_server(llm, url, 8, extras=[{}])
    frames, metadata = load_video(str(tmp_path / "a.mp4"), backend="pyav")
    hf_in = _hf(processor, text, videos=[frames], video_metadata=[metadata])
    assert status == 200 and reply["usage"]["prompt_tokens"] == hf_in["input_ids"].shape[1], reply
    answer = processor.tokenizer.decode(hf_vlm_greedy(hf, hf_in, 8), skip_special_tokens=True)
    assert reply["choices"][0]["message"]["content"] == answer


@needs_torchvision
def test_gemma4_video_frames_equal_transformers(tmp_path):
    """Gemma 4 (its larger models' bidirectional spans, one per frame): each frame, between its timestamp text, read by
    the tower as an image; a video of bare frames beside an image, logits within 1e-4 at every prompt position."""
    import transformers

    from tests.vlm_harness import VLMRunner
    from tests.vlm_models import GEMMA4_CHAT_TEMPLATE, GEMMA4_SPECIALS, byte_tokenizer, gemma4_config, hf_vlm_logits, images
    from tests.vlm_models import random_gemma4, write_vlm

    hf = random_gemma4(gemma4_config(bidirectional=True), seed=1)
    tokenizer = byte_tokenizer(
        GEMMA4_SPECIALS, GEMMA4_CHAT_TEMPLATE, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
                              "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"},
    )  # fmt: skip
    sizes = {"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 70}
    processor = transformers.Gemma4Processor(
        feature_extractor=transformers.Gemma4AudioFeatureExtractor(), image_processor=transformers.Gemma4ImageProcessor(**sizes),
        video_processor=transformers.Gemma4VideoProcessor(**sizes), tokenizer=tokenizer, chat_template=GEMMA4_CHAT_TEMPLATE,
    )  # fmt: skip
    folder = write_vlm(tmp_path, hf, processor)
    processor, runner = transformers.AutoProcessor.from_pretrained(folder), VLMRunner(folder)
    text = "<bos>See <|image|> and <|video|>: what changed?"
    picture, video = images((40, 30), seed=2), _video(4, frames=3)
    ids, mm = runner.processor.prompt(text, picture, None, [video])
    hf_in = _hf(processor, text, picture, [video], do_sample_frames=False)
    assert ids == hf_in["input_ids"][0].tolist() and len(mm.images) == 4  # the image and 3 frames
    (got,) = runner.logits([(ids, mm)])
    np.testing.assert_allclose(got, hf_vlm_logits(hf, hf_in), atol=1e-4)

"""The engine with images (issue 46, step 2), on tiny Qwen2.5-VL (causal, M-RoPE) and Gemma 3 (an image's span
attended both ways) checkpoints against transformers' greedy tokens: the encoder compiled per patch-count bucket at
warm-up (odd sizes compile nothing later) and batched across requests; the encoder budget and a small encoder cache
spreading images over steps; an image encoded once by content and its KV blocks reused only for the same image;
chunked prefill through an image's span, and never through a bidirectional one; preemption, n > 1, beams,
structured outputs and ngram speculative decoding with images."""

from __future__ import annotations


import pytest
import torch
from jaxpaged import LLM, SamplingParams, StructuredOutputsParams
from jaxpaged.engine.beam_search import BeamSearchParams

from tests.vlm_models import gemma3_checkpoint, hf_inputs, hf_vlm_greedy, images, qwen2_5_vl_checkpoint

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\nLook {IMAGE} closely.<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{IMAGE} beside {IMAGE}?<|im_end|>\n<|im_start|>assistant\n"
ODD = [(17, 93), (31, 31), (100, 20), (57, 77), (112, 112), (13, 13)]  # resized to grids of 4x4 .. 8x8 patches
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("qwen-vl-engine"), seed=1)


def _request(text, pictures):
    return {"prompt": text, "multi_modal_data": {"image": list(pictures)}}


def _want(qwen, text, pictures, max_tokens=8):
    hf, processor, _ = qwen
    return hf_vlm_greedy(hf, hf_inputs(processor, text, pictures), max_tokens)


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def _llm(folder, **kwargs):
    kwargs = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "num_kv_blocks": 64, "log_level": "WARNING", **kwargs}
    return LLM(str(folder), **kwargs)


def _idle(llm):
    """Nothing held: no sequence running or waiting, every KV block free (cached ones count as free)."""
    stats = llm.get_stats()
    return stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_odd_sizes_compile_nothing_after_warmup_and_the_encoder_batches(qwen):
    llm = _llm(qwen[2], max_num_encoder_input_tokens=256)
    runner = llm.engine.runner.mm
    assert runner.buckets == [16, 32, 64, 128, 256]  # multiples of one padded window's patches
    warm_calls = runner.num_calls
    pictures = [images(size, seed=i)[0] for i, size in enumerate(ODD)]
    outs = llm.generate([_request(PROMPT, [p]) for p in pictures], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_want(qwen, PROMPT, [p]) for p in pictures]
    stats = llm.get_stats()
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["encoder_images_encoded"] == len(ODD)
    assert runner.num_calls - warm_calls < len(ODD)  # several images per encoder call
    assert _idle(llm)


def test_encoder_budget_and_a_small_cache_spread_images_over_steps(qwen):
    """Two images' patches a step and an encoder cache of two images' rows: a prompt with three images prefills in
    several steps, the third evicting the first once its span is computed; tokens unchanged. An image larger than the
    encoder's batch is refused (the processor's own sizes are kept, not shrunk behind the user's back)."""
    pictures = images((112, 112), (84, 100), (100, 100), seed=7)
    three = f"<|im_start|>user\n{IMAGE}, {IMAGE} and {IMAGE}?<|im_end|>\n<|im_start|>assistant\n"
    llm = _llm(qwen[2], max_num_encoder_input_tokens=128, encoder_cache_size=32)
    outs = llm.generate([_request(three, pictures), _request(PROMPT, pictures[1:2])], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_want(qwen, three, pictures), _want(qwen, PROMPT, pictures[1:2])]
    assert llm.get_stats()["encoder_images_encoded"] >= 3
    assert _idle(llm)
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens"):
        _llm(qwen[2], max_num_encoder_input_tokens=32).generate(_request(PROMPT, pictures[:1]), GREEDY)


def test_an_image_is_encoded_once_and_its_blocks_serve_only_itself(qwen):
    hf, processor, folder = qwen
    first, other = images((112, 112), seed=8)[0], images((112, 112), seed=9)[0]
    llm = _llm(folder, max_num_batched_tokens=16, max_num_seqs=4)  # the prompt in chunks: its blocks registered
    (a,) = llm.generate(_request(PROMPT, [first]), GREEDY, use_tqdm=False)
    encoded = llm.get_stats()["encoder_images_encoded"]
    (b,) = llm.generate(_request(PROMPT, [first]), GREEDY, use_tqdm=False)
    assert llm.get_stats()["encoder_images_encoded"] == encoded  # the cached embeddings, or no image token to run
    offset = a.prompt_token_ids.index(processor.image_token_id)
    assert b.num_cached_tokens > offset + 16  # blocks holding the image reused
    (c,) = llm.generate(_request(PROMPT, [other]), GREEDY, use_tqdm=False)
    assert c.prompt_token_ids == a.prompt_token_ids  # the same tokens ...
    assert c.num_cached_tokens <= offset  # ... but no block holding the other image's placeholders
    assert _tokens([a, b]) == [_want(qwen, PROMPT, [first])] * 2 and _tokens([c]) == [_want(qwen, PROMPT, [other])]
    assert _tokens([a]) != _tokens([c])  # the image decides the answer


def test_preemption_with_images(qwen):
    pictures = [images(size, seed=10 + i)[0] for i, size in enumerate(ODD[:4])]
    llm = _llm(qwen[2], num_kv_blocks=20, block_size=4)
    outs = llm.generate([_request(PROMPT, [p]) for p in pictures], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    assert llm.get_stats()["num_preemptions"] > 0
    assert _tokens(outs) == [_want(qwen, PROMPT, [p], 12) for p in pictures]
    assert _idle(llm)


def test_n_samples_beams_and_structured_outputs_with_images(qwen):
    hf, processor, folder = qwen
    picture = images((57, 77), seed=11)[0]
    llm = _llm(folder)
    request = _request(PROMPT, [picture])
    # n > 1: each sample as the same request alone with its seed (the first computes the prompt, the others fork)
    (both,) = llm.generate(request, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True), use_tqdm=False)
    alone = [llm.generate(request, SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
             for s in (3, 4)]  # fmt: skip
    assert [list(c.token_ids) for c in both.outputs] == [list(a.outputs[0].token_ids) for a in alone]
    # beams: transformers' generate(num_beams=2) with the image
    (beams,) = llm.beam_search([request], BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        want = hf.generate(**hf_inputs(processor, PROMPT, [picture]), num_beams=2, num_return_sequences=2, do_sample=False,
                           max_new_tokens=6, early_stopping=False, eos_token_id=None)  # fmt: skip
    prompt_len = len(beams.sequences[0].tokens) - len(beams.sequences[0].output_token_ids)
    assert [s.output_token_ids for s in beams.sequences] == [row[prompt_len:].tolist() for row in want]
    # structured outputs: the grammar's mask applies beside the image
    choice = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    (picked,) = llm.generate(request, choice, use_tqdm=False)
    assert picked.outputs[0].text in ("yes", "no")
    assert llm.get_stats()["num_compiles_after_warmup"] == 0 and _idle(llm)


def test_ngram_speculative_decoding_with_images(qwen):
    pictures = [images(size, seed=20 + i)[0] for i, size in enumerate(ODD[:3])]
    llm = _llm(qwen[2], speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([_request(PROMPT, [p]) for p in pictures], params, use_tqdm=False)
    assert _tokens(outs) == [_want(qwen, PROMPT, [p], 12) for p in pictures]


def test_a_bidirectional_span_is_computed_in_one_step(tmp_path):
    """Gemma 3 with 8-token steps: an image's 4 soft tokens never split; a span longer than the step is refused."""
    hf, processor, folder = gemma3_checkpoint(tmp_path / "gemma3", seed=1)
    text = "<bos>A <start_of_image> and <start_of_image> here."
    pictures = images((40, 30), (80, 64), seed=12)
    llm = LLM(str(folder), max_num_seqs=2, max_num_batched_tokens=8, num_kv_blocks=32, log_level="WARNING")
    scheduler = llm.engine.scheduler
    spans, seen = [], []
    original = scheduler.mm.fit

    def fit(req, start, n):  # record every row's extent over image spans
        got = original(req, start, n)
        seen.append((start, start + got))
        return got

    scheduler.mm.fit = fit
    (out,) = llm.generate(_request(text, pictures), GREEDY, use_tqdm=False)
    spans = [(image.offset, image.end) for image in llm.engine.mm.processor.prompt(text, pictures)[1].images]
    assert all(not (a < end < b) for a, b in spans for _, end in seen if end > a)  # no step ends inside a span
    assert list(out.outputs[0].token_ids) == hf_vlm_greedy(hf, hf_inputs(processor, text, pictures), 8)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(str(folder), max_num_seqs=2, max_num_batched_tokens=2, num_kv_blocks=32, log_level="WARNING").generate(
            _request(text, pictures), GREEDY)  # fmt: skip


def test_bad_images_are_value_errors_and_nothing_is_held(qwen, cycle_model_dir):
    picture = images((40, 30), seed=13)[0]
    llm = _llm(qwen[2], limit_mm_per_prompt={"image": 1})
    bad = [
        (_request(PROMPT, [b"not an image at all"]), "not a readable image"),
        (_request(TWO, [picture, picture]), "at most 1 are allowed"),
        (_request(TWO, [picture]), "do not match"),  # two placeholders, one image
        ({"prompt": PROMPT, "multi_modal_data": {"video": [picture]}}, "reads images only"),
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": [picture]}}, "as text"),
        (_request(PROMPT, ["/etc/hostname"]), "local files are not allowed"),
    ]
    for prompt, why in bad:
        with pytest.raises(ValueError, match=why):
            llm.generate(prompt, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="not a readable image"):  # one bad prompt refuses the batch, queueing nothing
        llm.generate([_request(PROMPT, [picture]), _request(PROMPT, [b"\x89PNG broken"])], GREEDY, use_tqdm=False)
    assert _idle(llm) and llm.get_stats()["encoder_images_encoded"] == 0
    text_only = LLM(str(cycle_model_dir), max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=16, log_level="WARNING")
    with pytest.raises(ValueError, match="reads text only"):
        text_only.generate({"prompt": "hi", "multi_modal_data": {"image": [picture]}}, GREEDY)
    with pytest.raises(ValueError, match="reads text only"):
        text_only.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)


def test_the_async_engine_reads_media_off_the_engine_thread(qwen, monkeypatch):
    """A server's request names its image by URL: the image is read and decoded in a worker thread while the engine's
    thread goes on stepping, and the answer is the one LLM.chat gives for the image itself."""
    import threading

    from jaxpaged.multimodal.media import MediaLoader

    from tests.vlm_harness import greedy_chat_through_server, png_data_url

    picture = images((40, 30), seed=5)[0]
    llm = _llm(qwen[2])
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": picture}, {"type": "text", "text": "Look."}]}]
    (want,) = llm.chat(chat, GREEDY, use_tqdm=False)
    readers, decode = [], MediaLoader._decode
    monkeypatch.setattr(MediaLoader, "_decode", lambda self, *a: readers.append(threading.current_thread().name) or decode(self, *a))
    chat[0]["content"][0] = {"type": "image_url", "image_url": {"url": png_data_url(picture)}}
    reply = greedy_chat_through_server(llm, chat, 8)
    assert reply["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert reply["choices"][0]["message"]["content"] == want.outputs[0].text
    assert len(readers) == 1 and readers[0] != "jaxpaged-engine" and readers[0] != threading.main_thread().name
    url = png_data_url(picture)
    data = {"prompt": PROMPT, "multi_modal_data": {"image": [url]}}
    loaded = llm.engine.load_media(data)  # a prompt dict's files too (the prompt itself untouched)
    assert loaded["multi_modal_data"]["image"][0].size == picture.size and data["multi_modal_data"]["image"] == [url]
    assert llm.engine.load_media(_request(PROMPT, [picture]))["multi_modal_data"]["image"][0] is picture


def test_the_pool_is_sized_after_the_encoders_workspace(qwen, monkeypatch, tmp_path):
    """Where the pool is sized from free device memory (a GPU; forced here), the vision encoder's largest bucket is
    compiled before it and its workspace kept out of the pool, with the samplers' (warm-up then uses it as is)."""
    from jaxpaged.platforms.cpu.platform import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "reserve_step_workspace", True)
    runner = _llm(qwen[2], num_kv_blocks=None, cache_dir=str(tmp_path)).engine.runner
    largest = runner.mm.buckets[-1]
    memory = runner._compiled["encode", largest].memory_analysis()
    assert memory.temp_size_in_bytes > 0
    assert runner._workspace_bytes() >= memory.temp_size_in_bytes + memory.output_size_in_bytes
    assert runner.executables.num_compiled > 0 and runner.mm.num_calls == len(runner.mm.buckets)  # warm-up ran each

"""Llama 4 with images (models/vision/llama4.py) against transformers in float32, on a tiny random checkpoint: 32-pixel
tiles of 8-pixel patches (16 patches and a class token, 4 tokens after the pixel shuffle), 2 tower layers, under
tests/models/test_llama4.py's language model (chunked RoPE layers, a NoPE layer, MoE). Tiles of one encoder call equal
transformers' features within 1e-5; logits within 1e-4 at every position of a one-tile image, a 2 x 2-tile image with
its global tile, two images and a text prompt in one ragged step; greedy tokens through the engine and a chat's
image_url through the server's app, no compiles after warm-up.

transformers' Llama 4 image processor needs torchvision, which the suite's environment lacks on purpose: the first
test re-runs this file in a subprocess with torchvision (tests/vlm_harness.rerun_with_torchvision). Without it the
checkpoint serves text and an image request is refused, saying why (the last test, here).
(transformers 5.24's own forward fails building its output for this class, so the reference below merges the image
features into the embeddings as that forward does and runs its language model.)"""

from __future__ import annotations

import copy
import importlib.util
import types

import numpy as np
import pytest

from tests.vlm_harness import rerun_with_torchvision

torch = pytest.importorskip("torch")

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
needs_torchvision = pytest.mark.skipif(not HAS_TORCHVISION, reason="runs in the subprocess the first test starts")
SPECIALS = ["<|begin_of_text|>", "<|eot|>", "<|header_start|>", "<|header_end|>", "<|image_start|>", "<|image_end|>",
            "<|image|>", "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>", "<|finetune_right_pad|>"]  # fmt: skip
IDS = {t: 256 + i for i, t in enumerate(SPECIALS)}
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|header_start|>{{ m['role'] }}<|header_end|>\n\n{% if m['content'] is "
            "string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|image|>{% else %}"
            "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|eot|>{% endfor %}{% if add_generation_prompt %}"
            "<|header_start|>assistant<|header_end|>\n\n{% endif %}")  # fmt: skip
ONE = "<|begin_of_text|>Look at <|image|> closely."
TWO = "<|begin_of_text|><|image|> and <|image|>: which is wider?"
TEXT = "<|begin_of_text|>No image here, just text."
VISION = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8,
              vision_output_dim=64, projector_input_dim=64, projector_output_dim=64, pixel_shuffle_ratio=0.5)  # fmt: skip


def test_in_a_subprocess_with_torchvision():
    if HAS_TORCHVISION:
        pytest.skip("torchvision is here: the tests below run in this process")
    rerun_with_torchvision(__file__, passed=3, skipped=2)


class Reference:
    """transformers' Llama4ForConditionalGeneration as its forward would compute it: logits, and greedy tokens."""

    def __init__(self, hf):
        self.hf = hf

    def __call__(self, input_ids, pixel_values=None, **_):
        with torch.no_grad():
            embeds = self.hf.get_input_embeddings()(input_ids)
            if pixel_values is not None:
                features = self.hf.get_image_features(pixel_values.float()).last_hidden_state
                flat = self.hf.multi_modal_projector(features.reshape(-1, features.shape[-1]))
                mask = (input_ids == self.hf.config.image_token_id)[..., None].expand_as(embeds)
                embeds = embeds.masked_scatter(mask, flat)
            return types.SimpleNamespace(logits=self.hf.language_model(inputs_embeds=embeds).logits)

    def generate(self, input_ids, max_new_tokens, **kwargs):
        ids = input_ids
        for _ in range(max_new_tokens):  # no cache: the whole sequence each time (a few tokens)
            ids = torch.cat([ids, self(ids, **kwargs).logits[:, -1:].argmax(-1)], dim=1)
        return ids


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    import transformers

    from tests.models.test_llama4 import TEXT as LANGUAGE
    from tests.vlm_harness import VLMRunner
    from tests.vlm_models import byte_tokenizer, random_vlm, write_vlm

    text = copy.deepcopy(LANGUAGE) | dict(vocab_size=256 + len(SPECIALS), bos_token_id=IDS["<|begin_of_text|>"],
                                          eos_token_id=IDS["<|eot|>"], pad_token_id=IDS["<|finetune_right_pad|>"])  # fmt: skip
    config = transformers.Llama4Config(text_config=text, vision_config=VISION, image_token_id=IDS["<|patch|>"],
                                       boi_token_index=IDS["<|image_start|>"], eoi_token_index=IDS["<|image_end|>"],
                                       tie_word_embeddings=False)  # fmt: skip
    hf = random_vlm(config, seed=1)
    tokenizer = byte_tokenizer(SPECIALS, TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot|>",
                               pad_token="<|finetune_right_pad|>")  # fmt: skip
    processor = transformers.Llama4Processor(
        image_processor=transformers.Llama4ImageProcessor(size={"height": 32, "width": 32}, max_patches=4),
        tokenizer=tokenizer, patch_size=8, pixel_shuffle_ratio=0.5, chat_template=TEMPLATE,
    )  # fmt: skip
    folder = write_vlm(tmp_path_factory.mktemp("llama4-vlm"), hf, processor)
    return Reference(hf), transformers.AutoProcessor.from_pretrained(folder), folder, VLMRunner(folder)


def _pictures():
    from tests.vlm_models import images

    return images((30, 30), seed=2)[0], images((70, 40), seed=3)[0]  # one tile; 2 x 2 tiles and the global one


@needs_torchvision
def test_tiles_equal_transformers_features(llama4):
    reference, processor, _, runner = llama4
    small, large = _pictures()
    inputs = processor.image_processor(images=[small, large], return_tensors="pt")
    with torch.no_grad():
        features = reference.hf.get_image_features(inputs["pixel_values"].float()).last_hidden_state
        want = reference.hf.multi_modal_projector(features).reshape(-1, features.shape[-1]).numpy()
    items = runner.adapter.items({"pixel_values": inputs["pixel_values"].float().numpy()}, [])
    assert len(items) == 6 and all(item.num_rows == 4 for item in items)  # 1 + 4 + 1 tiles of 4 tokens
    bucket = runner.adapter.buckets(sum(item.num_patches for item in items))[-1]
    got = np.asarray(runner._encode(runner.state, runner.adapter.batch(items, bucket)))[:, 0]
    np.testing.assert_allclose(got[: len(want)], want, atol=1e-5)


@needs_torchvision
def test_logits_equal_transformers(llama4):
    from tests.vlm_harness import check_logits
    from tests.vlm_models import hf_inputs

    reference, processor, _, runner = llama4
    small, large = _pictures()
    cases = {
        "one-tile": ({"text": ONE, "images": [small]}, hf_inputs(processor, ONE, [small])),
        "tiles-and-global": ({"text": ONE, "images": [large]}, hf_inputs(processor, ONE, [large])),
        "two-images": ({"text": TWO, "images": [large, small]}, hf_inputs(processor, TWO, [large, small])),
        "text-only": ({"text": TEXT}, hf_inputs(processor, TEXT)),
    }
    requests = check_logits(reference, runner, cases)
    assert [len(mm.images) if mm else 0 for _, mm in requests] == [1, 5, 6, 0]


@needs_torchvision
def test_greedy_equals_transformers_through_the_engine_and_server(llama4):
    from jaxpaged import LLM, SamplingParams

    from tests.vlm_harness import greedy_chat_through_server, png_data_url
    from tests.vlm_models import hf_inputs, hf_vlm_greedy

    reference, processor, folder, _ = llama4
    small, large = _pictures()
    llm = LLM(str(folder), max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, log_level="WARNING")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt": ONE, "multi_modal_data": {"image": [large]}}, {"prompt": TWO, "multi_modal_data": {"image": [small, large]}}]
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    for out, (text, pictures) in zip(outs, [(ONE, [large]), (TWO, [small, large])]):
        hf_in = hf_inputs(processor, text, pictures)
        assert out.prompt_token_ids == hf_in["input_ids"][0].tolist()
        assert list(out.outputs[0].token_ids) == hf_vlm_greedy(reference, hf_in, 6)
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": large}, {"type": "text", "text": "What is it?"}]}]
    (want,) = llm.chat(chat, greedy, use_tqdm=False)
    chat[0]["content"][0] = {"type": "image_url", "image_url": {"url": png_data_url(large)}}
    reply = greedy_chat_through_server(llm, chat, 6)
    assert reply["usage"]["prompt_tokens"] == len(want.prompt_token_ids) and len(want.prompt_token_ids) > 20
    assert reply["choices"][0]["message"]["content"] == want.outputs[0].text


def test_without_its_processor_the_checkpoint_serves_text_and_says_why_not_images(tmp_path):
    """transformers builds Llama 4's image processor only with torchvision: without it (this environment), or without
    processor files, the engine warns and runs the language model; an image request is a ValueError naming why."""
    if HAS_TORCHVISION:
        pytest.skip("runs where torchvision is missing (the suite's own environment)")
    from jaxpaged import LLM, SamplingParams

    from tests.hf_reference import hf_greedy, save_hf_model
    from tests.models.test_llama4 import llama4_config, llama4_hf_model

    hf = llama4_hf_model(llama4_config())
    folder = save_hf_model(hf, tmp_path)  # no processor files at all
    llm = LLM(str(folder), max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=32, log_level="WARNING")
    assert llm.engine.runner.mm is None and "could not load the image processor" in llm.engine.runner.images_off
    (out,) = llm.generate([[3, 1, 4, 1, 5]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_greedy(hf.language_model, [3, 1, 4, 1, 5], 4)
    with pytest.raises(ValueError, match="multi_modal_data: this engine runs the model on text only: could not load"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": [np.zeros((8, 8, 3), np.uint8)]}}, SamplingParams())

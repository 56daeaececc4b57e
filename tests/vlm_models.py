"""Tiny random-weight vision-language checkpoints written by transformers, with a byte-level tokenizer carrying each
family's special tokens, its processor (the Pillow image processors: no torchvision) and its chat template: what
the VLM tests load into jaxpaged and run through transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np

torch = __import__("pytest").importorskip("torch", reason="torch (the dev extra) is the reference model")
PIL = __import__("pytest").importorskip("PIL", reason="Pillow (the vision extra) reads images")
import transformers  # noqa: E402
from PIL import Image  # noqa: E402

from tests.hf_reference import random_hf_model  # noqa: E402

GEMMA3_CHAT_TEMPLATE = (  # google/gemma-3-4b-it's, as published
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)


def byte_tokenizer(specials: list[str], chat_template: str, **kwargs):
    """Bytes are tokens 0-255, then `specials` in order (ids 256, 257, ...)."""
    from jaxpaged.models.gguf_io import _bytes_to_unicode
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spelling = _bytes_to_unicode()
    vocab = {spelling[b]: b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=chat_template, **kwargs)


GEMMA3_SPECIALS = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                   "<image_soft_token>"]  # fmt: skip
GEMMA3_IDS = {t: 256 + i for i, t in enumerate(GEMMA3_SPECIALS)}
GEMMA3_VOCAB = 256 + len(GEMMA3_SPECIALS)


def gemma3_config(image_size: int = 56, patch_size: int = 14, mm_tokens: int = 4, **text) -> transformers.Gemma3Config:
    """Images of (56 / 14)^2 = 16 patches pooled 2x2 into 4 soft tokens; windows of 8 (an image's span lies in one)."""
    ids = GEMMA3_IDS
    text_kwargs = dict(
        vocab_size=GEMMA3_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=3, max_position_embeddings=512, sliding_window=8, query_pre_attn_scalar=20,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 20000.0}},
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=image_size,
        patch_size=patch_size, vision_use_head=False,
    )  # fmt: skip
    return transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**(text_kwargs | text)), vision_config=vision, mm_tokens_per_image=mm_tokens,
        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
    )  # fmt: skip


def gemma3_processor(config: transformers.Gemma3Config):
    tokenizer = byte_tokenizer(
        GEMMA3_SPECIALS, GEMMA3_CHAT_TEMPLATE, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    )  # fmt: skip
    size = config.vision_config.image_size
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": size, "width": size})
    return transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=GEMMA3_CHAT_TEMPLATE,
        image_seq_length=config.mm_tokens_per_image,
    )  # fmt: skip


def random_vlm(config, seed: int = 0, std: float = 0.15):
    """tests.hf_reference.random_hf_model for an image-text model (every parameter random, norms near one)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("ln_q.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def write_vlm(folder: Path, model, processor) -> Path:
    """The checkpoint, its tokenizer and processor, as a published folder holds them."""
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def gemma3_checkpoint(folder: Path, seed: int = 0, **text):
    """(transformers model, processor, folder) of a tiny Gemma 3 image-text model."""
    config = gemma3_config(**text)
    model = random_hf_model(config, seed=seed)
    processor = gemma3_processor(config)
    return model, processor, write_vlm(folder, model, processor)


def images(*sizes: tuple[int, int], seed: int = 0) -> list:
    """Random RGB images of the given (width, height)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def write_video(path: Path, frames: np.ndarray, codec: str = "mpeg4", pix_fmt: str = "yuv420p", fps: int = 6) -> bytes:
    """frames [T, H, W, 3] uint8 encoded with PyAV into `path` (its suffix names the container); the file's bytes."""
    import fractions

    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fractions.Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], pix_fmt
        for image in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())
    return path.read_bytes()


def hf_inputs(processor, text: str | None = None, imgs=(), messages=None, **settings) -> dict:
    """transformers' own inputs for a prompt with images (or a conversation), as torch tensors; `settings`: the
    image processor's (a request's mm_processor_kwargs)."""
    if messages is not None:
        return dict(processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                  return_tensors="pt", processor_kwargs=settings or None))  # fmt: skip
    return dict(processor(text=text, images=list(imgs) or None, return_tensors="pt", **settings))


def hf_vlm_greedy(model, inputs: dict, max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def hf_vlm_logits(model, inputs: dict) -> np.ndarray:
    with torch.no_grad():
        return model(**inputs).logits[0].float().numpy()




# -- Qwen2.5-VL ---------------------------------------------------------------------------------------------------

QWEN_VL_CHAT_TEMPLATE = (  # Qwen/Qwen2.5-VL-7B-Instruct's, as published
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content "
    "or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' "
    "or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                 "<|video_pad|>"]  # fmt: skip
QWEN_IDS = {t: 256 + i for i, t in enumerate(QWEN_SPECIALS)}
QWEN_VOCAB = 256 + len(QWEN_SPECIALS)


QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_ONE = f"<|im_start|>user\n{QWEN_IMAGE}Describe it.<|im_end|>\n<|im_start|>assistant\n"
QWEN_TWO = f"<|im_start|>user\nFirst {QWEN_IMAGE} then {QWEN_IMAGE}: which is brighter?<|im_end|>\n<|im_start|>assistant\n"
QWEN_TEXT = "<|im_start|>user\nNo picture, just words.<|im_end|>\n<|im_start|>assistant\n"


def chat_with_image(picture) -> list[dict]:
    """A chat whose image comes in its third turn."""
    return [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "Hi! Send a picture."},
        {"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "What is it?"}]},
    ]


def chat_with_image_parts(picture) -> list[dict]:
    """A chat whose third turn holds text parts around an image part (the Gemma and Mistral tests' conversation)."""
    return [
        {"role": "user", "content": [{"type": "text", "text": "Hello there."}]},
        {"role": "assistant", "content": "Hi! Send a picture."},
        {"role": "user", "content": [{"type": "text", "text": "Here:"}, {"type": "image", "image": picture},
                                     {"type": "text", "text": "What is it?"}]},
    ]  # fmt: skip


def qwen_vl_cases(processor, second: tuple[int, int]) -> dict:
    """name -> (jaxpaged's request, transformers' inputs) for the Qwen-VL families: one image, two of different
    sizes (the second `second` pixels), an image mid-chat, and text only."""
    one, two, chat = images((40, 30), seed=2), images((120, 64), second, seed=3), images((64, 48), seed=4)[0]
    return {
        "one-image": ({"text": QWEN_ONE, "images": one}, hf_inputs(processor, QWEN_ONE, one)),
        "two-images-of-different-sizes": ({"text": QWEN_TWO, "images": two}, hf_inputs(processor, QWEN_TWO, two)),
        "image-mid-chat": ({"messages": chat_with_image(chat)}, hf_inputs(processor, messages=chat_with_image(chat))),
        "text-only": ({"text": QWEN_TEXT}, hf_inputs(processor, QWEN_TEXT)),
    }


def qwen2_5_vl_config(**text) -> transformers.Qwen2_5_VLConfig:
    """Patches of 14, merged 2x2; windows of 56 pixels (2x2 merge units: 16 patches), one full-attention block of
    two; M-RoPE sections (2, 3, 3) of head dim 16."""
    ids = QWEN_IDS
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1], out_hidden_size=64, in_channels=3)  # fmt: skip
    text_kwargs = dict(
        vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=ids["<|im_end|>"], bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )  # fmt: skip
    return transformers.Qwen2_5_VLConfig(
        text_config=text_kwargs | text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], eos_token_id=ids["<|im_end|>"],
    )  # fmt: skip


def qwen_vl_processor(cls=None, image_processor=None, chat_template: str = QWEN_VL_CHAT_TEMPLATE):
    """Images resized to multiples of 28 between 56x56 and 112x112 pixels (4 to 16 merge units)."""
    tokenizer = byte_tokenizer(QWEN_SPECIALS, chat_template, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    image_processor = image_processor or transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}, patch_size=14, merge_size=2, temporal_patch_size=2)
    from jaxpaged.models.vision.qwen_vl import images_only

    cls = images_only(cls or transformers.Qwen2_5_VLProcessor)  # transformers' own, less its torchvision video part
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


def qwen2_5_vl_checkpoint(folder: Path, seed: int = 0, **text):
    config = qwen2_5_vl_config(**text)
    model = random_vlm(config, seed=seed)
    processor = qwen_vl_processor()
    return model, processor, write_vlm(folder, model, processor)


# -- Qwen3-VL -----------------------------------------------------------------------------------------------------


def qwen3_vl_config(**text) -> transformers.Qwen3VLConfig:
    """Patches of 16 merged 2x2, a learned 4 x 4 position grid resampled to each image, DeepStack from block 0 into
    the first decoder layer; Qwen3 text (q/k norm) with interleaved M-RoPE sections (2, 3, 3) of head dim 16."""
    ids = QWEN_IDS
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64, in_channels=3, num_position_embeddings=16,
                  deepstack_visual_indexes=[0])  # fmt: skip
    text_kwargs = dict(
        vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=ids["<|im_end|>"],
        bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True},
    )  # fmt: skip
    return transformers.Qwen3VLConfig(
        text_config=text_kwargs | text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], eos_token_id=ids["<|im_end|>"],
    )  # fmt: skip


def qwen3_vl_checkpoint(folder: Path, seed: int = 0, **text):
    """Images resized to multiples of 32 between 64x64 and 128x128 pixels."""
    config = qwen3_vl_config(**text)
    model = random_vlm(config, seed=seed)
    image_processor = transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": 64 * 64, "longest_edge": 128 * 128}, patch_size=16, merge_size=2, temporal_patch_size=2)
    processor = qwen_vl_processor(transformers.Qwen3VLProcessor, image_processor)
    return model, processor, write_vlm(folder, model, processor)


# -- the LLaVA family ---------------------------------------------------------------------------------------------

LLAVA_CHAT_TEMPLATE = (  # llava-hf's: USER / ASSISTANT turns, <image> where an image goes
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<image>\n' }}{% endif %}{% endfor %}{% for item in message['content'] %}"
    "{% if item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
LLAVA_SPECIALS = ["<s>", "</s>", "<pad>", "<image>", "<video>"]
LLAVA_IDS = {t: 256 + i for i, t in enumerate(LLAVA_SPECIALS)}
LLAVA_VOCAB = 256 + len(LLAVA_SPECIALS)


def llava_config(kind: str, **text):
    """CLIP (LLaVA-1.5, NeXT) or SigLIP (OneVision) towers of 2 layers over 28 x 28 tiles of 14-pixel patches (4 rows
    a tile); NeXT and OneVision tile on grids up to 2 x 3 tiles; OneVision resizes maps past 2 tiles' worth
    (anyres_max_2, so tests reach the resize) and takes a Qwen2 text model."""
    text_type = "qwen2" if kind == "onevision" else "llama"
    text_kwargs = dict(
        model_type=text_type, vocab_size=LLAVA_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
        bos_token_id=LLAVA_IDS["<s>"], eos_token_id=LLAVA_IDS["</s>"], pad_token_id=LLAVA_IDS["<pad>"],
    ) | text  # fmt: skip
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=28, patch_size=14)
    pinpoints = [[28, 56], [56, 28], [56, 56], [28, 84], [84, 28], [56, 84]]
    common = dict(text_config=text_kwargs, image_token_id=LLAVA_IDS["<image>"])
    if kind == "llava":
        return transformers.LlavaConfig(vision_config=dict(tower, model_type="clip_vision_model", projection_dim=16), **common)
    if kind == "next":
        return transformers.LlavaNextConfig(vision_config=dict(tower, model_type="clip_vision_model", projection_dim=16),
                                            image_grid_pinpoints=pinpoints, **common)  # fmt: skip
    return transformers.LlavaOnevisionConfig(vision_config=dict(tower, model_type="siglip_vision_model"), image_grid_pinpoints=pinpoints,
                                             vision_aspect_ratio="anyres_max_2", video_token_id=LLAVA_IDS["<video>"], **common)  # fmt: skip


def llava_processor(kind: str, config):
    from jaxpaged.models.vision.common import images_only

    tokenizer = byte_tokenizer(LLAVA_SPECIALS, LLAVA_CHAT_TEMPLATE, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                               extra_special_tokens={"image_token": "<image>"})  # fmt: skip
    size = {"height": 28, "width": 28}
    if kind == "llava":
        image_processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size=size)
        return transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                                           vision_feature_select_strategy="default", chat_template=LLAVA_CHAT_TEMPLATE,
                                           num_additional_image_tokens=1)  # fmt: skip
    pinpoints = config.image_grid_pinpoints
    if kind == "next":
        image_processor = transformers.LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size=size, image_grid_pinpoints=pinpoints)
        return transformers.LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                                               vision_feature_select_strategy="default", chat_template=LLAVA_CHAT_TEMPLATE,
                                               num_additional_image_tokens=1)  # fmt: skip
    image_processor = transformers.LlavaOnevisionImageProcessorPil(size=size, image_grid_pinpoints=pinpoints)
    cls = images_only(transformers.LlavaOnevisionProcessor)
    return cls(image_processor=image_processor, tokenizer=tokenizer, num_image_tokens=4, vision_feature_select_strategy="full",
               chat_template=LLAVA_CHAT_TEMPLATE, vision_aspect_ratio="anyres_max_2")  # fmt: skip


def llava_checkpoint(kind: str, folder: Path, seed: int = 0, **text):
    config = llava_config(kind, **text)
    model = random_vlm(config, seed=seed)
    processor = llava_processor(kind, config)
    return model, processor, write_vlm(folder, model, processor)


# -- Mistral 3 and Pixtral-12B (Pixtral towers) -------------------------------------------------------------------

MISTRAL3_CHAT_TEMPLATE = (  # the shape of Mistral Small 3.1's: [INST] turns, [IMG] where an image goes
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for block in message['content'] %}{% if block['type'] == 'text' %}{{ block['text'] }}"
    "{% elif block['type'] == 'image' %}[IMG]{% endif %}{% endfor %}{% endif %}[/INST]{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] if message['content'] is string else message['content'][0]['text'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)
MISTRAL3_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
MISTRAL3_IDS = {t: 256 + i for i, t in enumerate(MISTRAL3_SPECIALS)}
MISTRAL3_VOCAB = 256 + len(MISTRAL3_SPECIALS)


def mistral3_config(kind: str = "mistral3", **text):
    """A 2-layer Pixtral tower over 4-pixel patches; Mistral 3 merges them 2 x 2 under a Ministral 3 language model
    (YaRN and the q temperature past position 16), Pixtral-12B (LLaVA) reads every patch under a Mistral one."""
    ids = MISTRAL3_IDS
    text_kwargs = dict(
        vocab_size=MISTRAL3_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"], pad_token_id=ids["<unk>"], tie_word_embeddings=False,
    ) | text  # fmt: skip
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  patch_size=4, image_size=32, hidden_act="silu")  # fmt: skip
    if kind == "pixtral":
        return transformers.LlavaConfig(text_config=dict(text_kwargs, model_type="mistral", sliding_window=None),
                                        vision_config=vision, image_token_id=ids["[IMG]"], vision_feature_layer=-1,
                                        vision_feature_select_strategy="full", projector_hidden_act="gelu")  # fmt: skip
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "original_max_position_embeddings": 16,
            "max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1}  # fmt: skip
    text_config = transformers.Ministral3Config(**text_kwargs, rope_parameters=rope)
    return transformers.Mistral3Config(text_config=text_config.to_dict(), vision_config=vision, image_token_index=ids["[IMG]"],
                                       spatial_merge_size=2, tie_word_embeddings=False)  # fmt: skip


def mistral3_processor(kind: str = "mistral3"):
    """Images resized to fit 32 pixels (Mistral 3: whole 8-pixel tokens, 2 x 2 patches) or 24 (Pixtral-12B: 4-pixel
    tokens): transformers' PixtralProcessor, built without torchvision as jaxpaged builds it."""
    from jaxpaged.models.vision.pixtral import pixtral_processor_class

    tokenizer = byte_tokenizer(MISTRAL3_SPECIALS, MISTRAL3_CHAT_TEMPLATE, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    merge, longest = (2, 32) if kind == "mistral3" else (1, 24)
    image_processor = transformers.PixtralImageProcessorPil(size={"longest_edge": longest}, patch_size=4)
    return pixtral_processor_class()(image_processor=image_processor, tokenizer=tokenizer, patch_size=4,
                                     spatial_merge_size=merge, chat_template=MISTRAL3_CHAT_TEMPLATE)  # fmt: skip


def mistral3_checkpoint(folder: Path, kind: str = "mistral3", seed: int = 0, **text):
    """(transformers model, processor, folder) of a tiny Mistral 3 ("mistral3") or Pixtral-12B ("pixtral")."""
    model = random_vlm(mistral3_config(kind, **text), seed=seed)
    return model, mistral3_processor(kind), write_vlm(folder, model, mistral3_processor(kind))


# -- Qwen3.5 (Qwen3-VL's tower less DeepStack, the hybrid Gated DeltaNet language model) ---------------------------


def qwen3_5_config(moe: bool = False, **text):
    """Qwen3-VL's tower (1 block, patches of 16 merged 2x2, a learned 4 x 4 position grid) under a Gated DeltaNet layer
    and a gated attention layer with partial rotary 0.5 (8 of 16 dims) and interleaved M-RoPE sections (2, 1, 1): its 4
    frequencies take t, h, w, t; MoE: 4 experts, top-2, a shared expert."""
    ids = QWEN_IDS
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64, in_channels=3, num_position_embeddings=16)  # fmt: skip
    text_kwargs = dict(
        vocab_size=QWEN_VOCAB, hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=512, eos_token_id=ids["<|im_end|>"],
        bos_token_id=None, pad_token_id=ids["<|endoftext|>"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )  # fmt: skip
    if moe:
        text_kwargs |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    else:
        text_kwargs |= dict(intermediate_size=96)
    cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    return cls(text_config=text_kwargs | text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
               video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
               vision_end_token_id=ids["<|vision_end|>"])  # fmt: skip


def random_qwen3_5(config, seed: int = 0):
    """random_vlm at std 0.1, the language model's zero-centred RMSNorms (x * (1 + w)) around 0, as
    tests/models/test_hybrid_models.py explains (float32 rounding in the delta rule's solve otherwise nears 1e-4)."""
    model = random_vlm(config, seed=seed, std=0.1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and "norm" in name and "linear_attn.norm" not in name:
                p.sub_(1.0)
    return model


def qwen3_5_checkpoint(folder: Path, moe: bool = False, seed: int = 0, **text):
    """Images resized to multiples of 32 between 64x64 and 128x128 pixels, through transformers' Qwen3VLProcessor
    (the one Qwen3.5's folders name)."""
    model = random_qwen3_5(qwen3_5_config(moe, **text), seed=seed)
    image_processor = transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": 64 * 64, "longest_edge": 128 * 128}, patch_size=16, merge_size=2, temporal_patch_size=2)
    processor = qwen_vl_processor(transformers.Qwen3VLProcessor, image_processor)
    return model, processor, write_vlm(folder, model, processor)


# -- Gemma 4 (its own variable-resolution tower, the language model of models/gemma4.py) ----------------------------

GEMMA4_CHAT_TEMPLATE = GEMMA3_CHAT_TEMPLATE.replace("<start_of_image>", "<|image|>")
GEMMA4_SPECIALS = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<|image>", "<image|>", "<|image|>",
                   "<|audio>", "<audio|>", "<|audio|>", "<|video|>"]  # fmt: skip
GEMMA4_IDS = {t: 256 + i for i, t in enumerate(GEMMA4_SPECIALS)}
GEMMA4_VOCAB = 256 + len(GEMMA4_SPECIALS)


def gemma4_config(bidirectional: bool = False, audio: bool = False, **text) -> transformers.Gemma4Config:
    """The tower: 4-pixel patches pooled 2 x 2 (a soft token per 8 x 8 pixels), 2 layers, GQA 2:1, clipped linears and
    standardized outputs; under a 6-layer Gemma 4 (2 sliding layers, window 8, then a full one, twice; per-layer
    embeddings; the last 2 layers sharing K/V). `bidirectional`: an image's tokens see each other on the sliding layers
    (`use_bidirectional_attention: vision`, Gemma 4's larger models). `audio`: a one-layer audio tower beside it, as
    the E2B/E4B checkpoints hold one."""
    ids = GEMMA4_IDS
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=64, use_clipped_linears=True,
        standardize=True, rope_parameters={"rope_type": "axial", "rope_theta": 100.0},
    )  # fmt: skip
    text_kwargs = dict(
        vocab_size=GEMMA4_VOCAB, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, sliding_window=8, max_position_embeddings=512, num_hidden_layers=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=GEMMA4_VOCAB,
        bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"], final_logit_softcapping=5.0,
        use_bidirectional_attention="vision" if bidirectional else None,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 10.0}},
    )  # fmt: skip
    return transformers.Gemma4Config(
        text_config=text_kwargs | text, vision_config=vision, image_token_id=ids["<|image|>"],
        audio_config=transformers.Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                    subsampling_conv_channels=[4, 4], output_proj_dims=16) if audio else None,
        boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"], video_token_id=ids["<|video|>"],
        audio_token_id=ids["<|audio|>"], boa_token_id=ids["<|audio>"], eoa_token_index=ids["<audio|>"],
    )  # fmt: skip


def gemma4_processor():
    """transformers' Gemma4Processor without its video part (torchvision) nor audio (no feature extractor): images
    resized to at most 70 soft tokens (the smallest budget the image processor takes)."""
    from jaxpaged.models.vision.common import images_only

    tokenizer = byte_tokenizer(
        GEMMA4_SPECIALS, GEMMA4_CHAT_TEMPLATE, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
                              "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"},
    )  # fmt: skip
    image_processor = transformers.Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    return images_only(transformers.Gemma4Processor)(image_processor=image_processor, tokenizer=tokenizer,
                                                     chat_template=GEMMA4_CHAT_TEMPLATE)  # fmt: skip


def random_gemma4(config, seed: int = 0):
    """random_vlm, with each layer_scalar random and the q/k norms halved (as tests/models/test_gemma4.py does), the
    clipped linears' bounds inside the range their inputs and outputs reach (so clipping happens) and the
    standardization's bias and scale random (buffers random_vlm leaves alone)."""
    model = random_vlm(config, seed=seed, std=0.15)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand_like(buffer))
            elif name.endswith(("input_min", "output_min")):
                buffer.fill_(-1.5)
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(1.5)
            elif name.endswith("std_bias"):
                buffer.normal_(0.0, 0.5)
            elif name.endswith("std_scale"):
                buffer.copy_(0.5 + torch.rand_like(buffer))
    return model


def gemma4_checkpoint(folder: Path, bidirectional: bool = False, audio: bool = False, seed: int = 0, **text):
    """(transformers model, processor, folder) of a tiny Gemma 4 image-text model."""
    model = random_gemma4(gemma4_config(bidirectional, audio, **text), seed=seed)
    processor = gemma4_processor()
    return model, processor, write_vlm(folder, model, processor)

"""An engine's door for images: prompts with `multi_modal_data` and chat messages with image parts become token ids
and MultimodalInputs (processing.py), checked against what the engine can run (its encoder budget, its cache, its
token budget where an image's span must be computed at once, limit_mm_per_prompt); and the scheduler's encoder part.
A text-only model refuses images with a ValueError that says so."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxpaged.models.vision.common import EncoderItem
from jaxpaged.multimodal.encoder_cache import EncoderScheduler
from jaxpaged.multimodal.inputs import MultimodalInputs
from jaxpaged.multimodal.media import MediaLoader, encoded
from jaxpaged.multimodal.processing import MultimodalProcessor, preload_messages
from jaxpaged.utils.text import ChatPrompt

if TYPE_CHECKING:
    from jaxpaged.engine.llm_engine import LLMEngine

IMAGE_PART_TYPES = ("image_url", "image", "image_pil", "video", "video_url")  # (and video: a vision model's parts)


def has_image_parts(messages: Sequence[Any]) -> bool:
    """Whether a conversation holds image content parts."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in content):
            return True
    return False


def prompt_images(prompt: dict) -> tuple[list, list]:
    """A prompt dict's multi_modal_data (vLLM's {"image": image or [images], "video": video or [videos]}): (its
    images, its videos); ValueError for other data. A video is its frames ([T, H, W, 3] uint8), or (frames,
    metadata); a list holds several videos."""
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, dict):
        raise ValueError("multi_modal_data must be a dict such as {'image': [...]}")
    unknown = set(data) - {"image", "video"}
    if unknown:
        raise ValueError(f"multi_modal_data: only 'image' and 'video' are supported (got {', '.join(sorted(unknown))})")
    images = data.get("image", [])
    videos = data.get("video", [])
    videos = list(videos) if isinstance(videos, list) else [videos]  # one video: an array or (frames, metadata)
    return (list(images) if isinstance(images, (list, tuple)) else [images]), videos


def text_only_refusal(what: str, model=None, images_off: str | None = None) -> ValueError:
    if images_off:  # its processor could not be built (multimodal/runner.py)
        return ValueError(f"{what}: this engine runs the model on text only: {images_off}")
    if getattr(model, "vision_spec", None) is not None:  # a vision-language model on a runner without images
        return ValueError(f"{what}: this engine runs the model on text only (images need one process and "
                          "pipeline_parallel_size 1)")
    return ValueError(f"{what}: this model reads text only; images need a vision-language model")


class MultimodalFrontend:
    def __init__(self, engine: LLMEngine):
        runner = engine.runner.mm
        config = engine.config
        self.spec, self.adapter = runner.spec, runner.adapter
        self.max_patches = runner.max_patches
        self.cache_rows = runner.cache.num_rows
        self.max_step_tokens = config.max_num_batched_tokens
        loader = MediaLoader(config.allowed_local_media_path, config.media_domains)
        limits = config.limit_mm_per_prompt or {}
        self.processor = MultimodalProcessor(self.adapter.processor, self.adapter, self.spec, loader, limits.get("image"),
                                             self._check, limits.get("video"))  # fmt: skip
        engine.scheduler.mm = self.scheduler = EncoderScheduler(runner.cache, self.max_patches, self.spec.bidirectional)

    def _check(self, item: EncoderItem, what: str) -> None:
        if item.num_patches > self.max_patches:
            raise ValueError(f"{what} has {item.num_patches} patches, more than the encoder runs in one step "
                             f"(max_num_encoder_input_tokens={self.max_patches})")  # fmt: skip
        if item.num_rows > self.cache_rows:
            raise ValueError(f"{what} needs {item.num_rows} embeddings, more than the encoder cache holds "
                             f"(encoder_cache_size={self.cache_rows})")  # fmt: skip
        if self.spec.bidirectional and item.num_rows > self.max_step_tokens:
            raise ValueError(f"{what} spans {item.num_rows} tokens, which this model computes in one step: more than "
                             f"max_num_batched_tokens ({self.max_step_tokens})")  # fmt: skip

    def load_media(self, prompt):
        """`prompt` with the media files it names (URLs, paths, bytes) read and decoded; thread-safe (the loader
        alone: no tokenizer, no processor), so a server does it before the engine's thread takes the request."""
        loader = self.processor.loader
        if isinstance(prompt, ChatPrompt) and has_image_parts(prompt.messages):
            return dataclasses.replace(prompt, messages=preload_messages(prompt.messages, loader))
        if not (isinstance(prompt, dict) and prompt.get("multi_modal_data")):
            return prompt
        images, videos = prompt_images(prompt)
        data = {**prompt["multi_modal_data"]}
        if images:
            data["image"] = [loader.load(s, what=f"multi_modal_data.image[{i}]") if encoded(s) else s for i, s in enumerate(images)]
        if videos:
            data["video"] = [loader.load_video(s, what=f"multi_modal_data.video[{i}]") if encoded(s) else s
                             for i, s in enumerate(videos)]  # fmt: skip
        return {**prompt, "multi_modal_data": data}

    def prompt(self, prompt: dict) -> tuple[str | None, list[int], MultimodalInputs | None]:
        images, videos = prompt_images(prompt)
        if "prompt_token_ids" in prompt:
            raise ValueError("multi_modal_data needs the prompt as text ('prompt'), which the processor expands")
        text = prompt.get("prompt")
        ids, mm = self.processor.prompt(text, images, prompt.get("mm_processor_kwargs"), videos)
        return text, ids, mm if mm.images else None

    def chat(self, prompt: ChatPrompt) -> tuple[None, list[int], MultimodalInputs | None]:
        ids, mm = self.processor.chat(prompt.messages, prompt.add_generation_prompt, prompt.tools, prompt.template_kwargs,
                                      prompt.chat_template, prompt.mm_processor_kwargs)  # fmt: skip
        return None, ids, mm if mm.images else None

    def stats(self) -> dict:
        cache = self.scheduler.cache
        return {"encoder_images_encoded": self.scheduler.num_encoded, "encoder_patches_encoded": self.scheduler.num_patches_encoded,
                "encoder_cache_hits": cache.hits, "encoder_cache_rows_used": cache.num_used}  # fmt: skip

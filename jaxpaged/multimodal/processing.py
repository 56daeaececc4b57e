"""Prompts with images -> token ids and placed images, through the model's own transformers processor (its image
processor resizes and normalizes; its chat template and placeholder expansion make the tokens), never a copy.

transformers builds some processors only with torchvision (Qwen2.5-VL's needs its video processor): where
AutoProcessor fails for that reason, the processor class is built from the Pillow image processor and the tokenizer,
images only (/work/shared/vision.md).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxpaged.models.vision.common import ImageAdapter, VisionSpec
from jaxpaged.multimodal.inputs import MultimodalInputs, place_images
from jaxpaged.multimodal.media import MediaLoader, encoded

logger = logging.getLogger("jaxpaged.multimodal")


class ProcessorUnavailable(ValueError):
    """The model's processor cannot be built here (no processor files, or a part that needs a missing package)."""


def load_processor(folder: str | Path, images_only=None):
    """The model's processor (images only), from its folder; images_only(cls): the family's processor class with its
    video part left out, for when AutoProcessor cannot build it."""
    import transformers

    folder = str(folder)
    try:
        processor = transformers.AutoProcessor.from_pretrained(folder)
        if getattr(processor, "image_processor", None) is not None:
            return processor
        first = f"AutoProcessor made a {type(processor).__name__} without an image processor"
    except (ImportError, OSError, ValueError, TypeError, AttributeError) as exc:
        first = exc
    # a processor whose video part needs torchvision: its class less that part (images_only), from the same files
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
        name = transformers.models.auto.processing_auto.PROCESSOR_MAPPING_NAMES.get(config.model_type)
        cls = getattr(transformers, name) if name else None
        if cls is None:
            raise ValueError(f"no processor class for model type {config.model_type!r}")
        processor = (images_only(cls) if images_only is not None else cls).from_pretrained(folder)
        logger.info("processor %s loaded for images only (%s): %s", name, type(processor.image_processor).__name__, first)
        return processor
    except Exception as exc:  # noqa: BLE001
        raise ProcessorUnavailable(f"could not load the image processor in {folder}: {first}; then: {exc}") from exc


IMAGE_KINDS = ("image_url", "image", "image_pil")  # OpenAI's content part, vLLM's two
VIDEO_KINDS = ("video", "video_url")


def _image_source(part: dict, kind: str):
    source = part.get(kind) if kind != "image" else part.get("image", part.get("url"))
    return source.get("url") if isinstance(source, dict) else source


def openai_parts(messages: Sequence[dict], loader: MediaLoader) -> tuple[list[dict], list, list]:
    """OpenAI chat messages (content parts: text, image_url, or vLLM's image/image_pil, video, video_url) ->
    (messages as transformers' chat templates take them, each image part {"type": "image", "image": <PIL image>},
    each video part {"type": "video"}; the images in order; the videos' (where, source) in order)."""
    converted, images, videos = [], [], []
    for m, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{m}] must be an object")
        content = message.get("content")
        if not isinstance(content, list):
            converted.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            where = f"messages[{m}].content[{p}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind in IMAGE_KINDS:
                image = loader.load(_image_source(part, kind), what=where)
                images.append(image)
                parts.append({"type": "image", "image": image})
            elif kind in VIDEO_KINDS:  # its frames or file (vLLM's video part); the template writes a placeholder
                source = part.get(kind)
                videos.append((where, source.get("url") if kind == "video_url" and isinstance(source, dict) else source))
                parts.append({"type": "video"})
            else:
                raise ValueError(f"{where}: content part type {kind!r} is not supported (text, image_url, video)")
        converted.append({**message, "content": parts})
    return converted, images, videos


def preload_messages(messages: Sequence[dict], loader: MediaLoader) -> list[dict]:
    """The messages with each image or video part that names a file (a URL, a path, bytes) read and decoded: the
    slow part of taking in a request's media, which needs no tokenizer or processor and so can run off the engine's
    thread. Refusals are openai_parts' ValueErrors; the other parts are left to it."""
    loaded = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            loaded.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            kind, where = part.get("type") if isinstance(part, dict) else None, f"messages[{m}].content[{p}]"
            if kind in IMAGE_KINDS and encoded(source := _image_source(part, kind)):
                part = {"type": "image_pil", "image_pil": loader.load(source, what=where)}
            elif kind in VIDEO_KINDS and encoded(part.get(kind)):
                part = {"type": "video", "video": loader.load_video(part[kind], what=where)}
            parts.append(part)
        loaded.append({**message, "content": parts})
    return loaded


def processor_settings(adapter: ImageAdapter) -> set[str]:
    """The settings a request's mm_processor_kwargs may name: those of the model's image processor (transformers'
    `valid_kwargs` of it) its family's adapter lets change (ImageAdapter.SETTINGS: not the patch size, nor a size
    the tower is fixed to), and how its video processor samples frames (ImageAdapter.VIDEO_SETTINGS)."""
    known = set()
    for part, allowed in (("image_processor", adapter.SETTINGS), ("video_processor", adapter.VIDEO_SETTINGS)):
        valid = getattr(getattr(getattr(adapter.processor, part, None), "valid_kwargs", None), "__annotations__", {})
        known |= set(valid) & set(allowed)
    return known


def check_processor_kwargs(adapter: ImageAdapter, kwargs, what: str = "mm_processor_kwargs") -> dict:
    """kwargs as a dict of processor settings (processor_settings); ValueError naming the first key that is not one
    (transformers would ignore it with a warning, or build images the tower cannot read)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"{what} must be a dict of the image processor's settings (got {kwargs!r})")
    known = processor_settings(adapter)
    for key in kwargs:
        if key not in known:
            raise ValueError(f"{what}: {key!r} is not a setting this model's processor may change "
                             f"(it takes: {', '.join(sorted(known))})")  # fmt: skip
    return dict(kwargs)


class MultimodalProcessor:
    """One engine's: prompt text or chat messages plus images -> (token ids, MultimodalInputs). The engine's
    mm_processor_kwargs are the adapter's settings (vision_parts), which a request's own override."""

    def __init__(self, processor, adapter: ImageAdapter, spec: VisionSpec, loader: MediaLoader,
                 limit_images: int | None = None, check=None, limit_videos: int | None = None):  # fmt: skip
        self.processor = processor
        self.adapter = adapter
        self.spec = spec
        self.loader = loader
        self.limit_images, self.limit_videos = limit_images, limit_videos
        self.check = check  # the engine's limits on one image (encoder budget, cache size): raises ValueError

    def _settings(self, request_kwargs) -> dict:
        """The image processor's settings for a request: the engine's, under the request's own mm_processor_kwargs."""
        return {**self.adapter.settings, **check_processor_kwargs(self.adapter, request_kwargs)}

    def _count(self, n: int) -> None:
        if self.limit_images is not None and n > self.limit_images:
            raise ValueError(f"the prompt has {n} images; at most {self.limit_images} are allowed (limit_mm_per_prompt)")

    def _videos(self, videos: Sequence[Any], whats: Sequence[str]) -> dict:
        """The processor's arguments for a prompt's videos (frames and their metadata), or {} for none."""
        if not videos:
            return {}
        if not self.adapter.reads_videos:
            raise ValueError(f"{whats[0]}: this model reads images only (videos: Qwen3-VL, Qwen3.5 and Gemma 4)")
        if self.limit_videos is not None and len(videos) > self.limit_videos:
            raise ValueError(f"the prompt has {len(videos)} videos; at most {self.limit_videos} are allowed (limit_mm_per_prompt)")
        if getattr(self.processor, "video_processor", None) is None:
            raise ValueError(f"{whats[0]}: this model's processor reads no videos (transformers builds video processors "
                             "only with torchvision: pip install 'jaxpaged[video]')")  # fmt: skip
        loaded = [self.loader.load_video(video, what=what) for video, what in zip(videos, whats)]
        what = whats[0]
        metadata = [m for _, m in loaded]
        if any(m is None for m in metadata):  # frames as given: no fps to sample them by
            if any(m is not None for m in metadata):
                raise ValueError(f"{what}: give every video its metadata, or none")
            return {"videos": [f for f, _ in loaded], "do_sample_frames": False}
        return {"videos": [f for f, _ in loaded], "video_metadata": metadata}

    def prompt(self, text: str, images: Sequence[Any], processor_kwargs: dict | None = None,
               videos: Sequence[Any] = (), video_whats: Sequence[str] | None = None) -> tuple[list[int], MultimodalInputs]:  # fmt: skip
        """A prompt string holding the model's image (video) placeholder once per image (video), as its chat
        template writes it."""
        if not isinstance(text, str):
            raise ValueError("prompt: multi_modal_data needs the prompt as text")
        self._count(len(images))
        settings = self._settings(processor_kwargs)
        loaded = [self.loader.load(image, what=f"multi_modal_data.image[{i}]") for i, image in enumerate(images)]
        video_args = self._videos(videos, video_whats or [f"multi_modal_data.video[{i}]" for i in range(len(videos))])
        try:
            out = self.processor(text=text, images=loaded or None, return_tensors=self.adapter.RETURN_TENSORS,
                                 **{**settings, **video_args})  # fmt: skip
        except ValueError as exc:
            what = "the processor refused the prompt, its images or mm_processor_kwargs" if settings else "the prompt and its images do not match"
            raise ValueError(f"{what}: {exc}") from None
        return self._inputs(dict(out))

    def chat(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, tools=None, template_kwargs: dict | None = None,
        chat_template: str | None = None, processor_kwargs: dict | None = None,
    ) -> tuple[list[int], MultimodalInputs]:
        """chat_template: Jinja text used instead of the processor's template (vLLM's --chat-template)."""
        converted, images, videos = openai_parts(messages, self.loader)
        self._count(len(images))
        extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        if chat_template:
            extra["chat_template"] = chat_template
        if videos:  # the template's text, then the processor on it with the frames (transformers would decode files)
            try:
                text = self.processor.apply_chat_template(converted, add_generation_prompt=add_generation_prompt,
                                                          tokenize=False, **extra)  # fmt: skip
            except Exception as exc:
                raise ValueError(f"messages could not be rendered by the chat template: {exc}") from exc
            return self.prompt(text, images, processor_kwargs, [v for _, v in videos], [w for w, _ in videos])
        settings = self._settings(processor_kwargs)
        if settings:
            extra["processor_kwargs"] = settings
        try:
            out = self.processor.apply_chat_template(
                converted, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True,
                return_tensors=self.adapter.RETURN_TENSORS, **extra,
            )  # fmt: skip
        except ValueError:
            raise
        except Exception as exc:  # a template's raise_exception(), or a message it cannot render
            raise ValueError(f"messages could not be rendered by the chat template: {exc}") from exc
        return self._inputs(dict(out))

    def _inputs(self, out: dict) -> tuple[list[int], MultimodalInputs]:
        out = {k: _numpy(v) for k, v in out.items()}
        ids = [int(t) for t in np.asarray(out["input_ids"]).reshape(-1)]
        items = self.adapter.items(out, ids) if "pixel_values" in out or "pixel_values_videos" in out else []
        for i, item in enumerate(items):
            if self.check is not None:
                self.check(item, f"image {i}")
        images = place_images(ids, self.adapter.placeholder_tokens(), items)
        mm = MultimodalInputs(images)
        if self.spec.mrope:
            mm.mrope_positions, mm.mrope_delta = self.adapter.mrope_positions(ids, items)
        return ids, mm


def _numpy(value):
    """A processor's output as numpy: a torch tensor (ImageAdapter.RETURN_TENSORS "pt") too, bfloat16 as float32."""
    if type(value).__module__.startswith("torch") and hasattr(value, "numpy"):
        return (value.float() if value.is_floating_point() else value).cpu().numpy()
    return value

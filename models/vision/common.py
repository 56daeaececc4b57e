"""What every vision-language port shares: the facts the engine reads (VisionSpec), an image as its encoder reads it
(EncoderItem), the host-side adapter a family provides (ImageAdapter), dense attention for vision towers, and the
merge of cached image embeddings into a step's token embeddings (MultimodalStep).

How an image travels: transformers' own processor (jaxpaged/multimodal/processing.py) turns the prompt and its images
into token ids, with each image a contiguous span of placeholder tokens, and the encoder's arrays; the family's
adapter cuts those into one EncoderItem per span. The engine runs the port's `encode` on a batch of items padded to a
patch-count bucket, writes the output rows into its encoder cache (a device array of embedding rows), and each step
hands the port the cache and, per token, the cache row that replaces its embedding (-1 for text).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class VisionSpec:
    """Static facts of a vision-language port the engine needs."""

    image_token_id: int  # the placeholder a processor expands each image into
    hidden_size: int  # the language model's embedding width: one encoder-cache row
    levels: int = 1  # feature levels per row: the input embedding, then DeepStack's per-layer additions (Qwen3-VL)
    bidirectional: bool = False  # an image's tokens attend to each other both ways in prefill (Gemma 3)
    mrope: bool = False  # 3-D M-RoPE positions (Qwen2.5-VL, Qwen3-VL)


@dataclasses.dataclass
class EncoderItem:
    """One image as its encoder reads it: `arrays` of one image (their layout is the family's), what the encoder's work
    and the buckets count (`num_patches`), the embedding rows it yields (its placeholder span's length) and `key`,
    the hash of its arrays (the encoder cache and prefix caching know an image by it)."""

    arrays: dict[str, np.ndarray]
    num_patches: int
    num_rows: int
    key: bytes = b""
    meta: dict = dataclasses.field(default_factory=dict)  # family facts the host needs (Qwen: the grid)

    def __post_init__(self):
        if not self.key:
            digest = hashlib.sha256()
            for name in sorted(self.arrays):
                array = np.ascontiguousarray(self.arrays[name])
                digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
                digest.update(array.tobytes())
            self.key = digest.digest()


NOT_IMAGES = ("video_processor", "feature_extractor")  # a processor's parts images never use (torchvision, audio)


@functools.cache
def _without_parts():
    """A class between a processor class and transformers' ProcessorMixin (so it comes right after the processor class
    in the MRO): the parts images_only left out, which the class's __init__ still hands on (Gemma 4's names them
    all), are dropped there."""
    from transformers.processing_utils import ProcessorMixin

    class WithoutParts(ProcessorMixin):
        def __init__(self, *args, **kwargs):
            for name in NOT_IMAGES:
                if name not in self.get_attributes() and kwargs.get(name, 0) is None:
                    del kwargs[name]
            super().__init__(*args, **kwargs)

    return WithoutParts


def images_only(processor_cls):
    """transformers' processor class with its video processor and audio feature extractor left out of its parts:
    transformers 5.24 builds video processors only with torchvision (/work/shared/vision.md). Every image method
    (placeholder expansion, the chat template, token type ids) is the class's own; its __init__ gets None for the
    parts left out, which images never use."""
    parts = [name for name in processor_cls.get_attributes() if name not in NOT_IMAGES]
    if len(parts) == len(processor_cls.get_attributes()):
        return processor_cls
    body = {"get_attributes": classmethod(lambda cls: list(parts)), "__qualname__": processor_cls.__qualname__,
            "__module__": processor_cls.__module__}  # fmt: skip
    params = inspect.signature(processor_cls.__init__).parameters
    dropped = [name for name in params if name in NOT_IMAGES]
    if dropped:  # an __init__ naming them (Gemma 4's, without defaults): one that does not, with the class's other
        # parameters by name, as transformers' from_pretrained reads them (from __code__)
        kept = [p for name, p in params.items() if name not in dropped]
        own = [p.name for p in kept if p.kind is p.POSITIONAL_OR_KEYWORD][1:]
        rest = next((p.name for p in kept if p.kind is p.VAR_KEYWORD), None)
        signature = ", ".join(["self", *(f"{n}=_defaults[{n!r}]" for n in own), *([f"**{rest}"] if rest else [])])
        call = ", ".join([*(f"{n}={n}" for n in own), *(f"{n}=None" for n in dropped), *([f"**{rest}"] if rest else [])])
        defaults = {n: (None if params[n].default is params[n].empty else params[n].default) for n in own}
        scope = {"_defaults": defaults, "_init": processor_cls.__init__}
        exec(f"def __init__({signature}):\n    _init(self, {call})", scope)  # noqa: S102 (names from a signature)
        body["__init__"] = scope["__init__"]
    # (the class's own name: processor_config.json says it, as a published folder's does)
    return type(processor_cls.__name__, (processor_cls, _without_parts()), body)


class ImageAdapter:
    """A family's host side: the processor's outputs -> EncoderItems, a batch of items -> the arrays its `encode`
    takes at a bucket's shapes, and the buckets. Subclasses set the details; the engine calls nothing else."""

    # the image processor's settings a request's mm_processor_kwargs may change (those that leave the tower's input
    # shape to the processor); a family adds the size settings its adapter follows
    SETTINGS: tuple[str, ...] = ("do_convert_rgb", "resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean",
                                 "image_std")  # fmt: skip
    # what the processor is asked to return: "pt" where it makes tensors numpy cannot hold (Llama 4's bfloat16 pixels)
    RETURN_TENSORS = "np"
    # how the video processor samples a video's frames (a family that reads videos): they change how many frames
    # are encoded, not what one frame's encoder input is
    VIDEO_SETTINGS: tuple[str, ...] = ("fps", "num_frames", "do_sample_frames", "min_frames", "max_frames")

    def __init__(self, hf_config, spec: VisionSpec):
        self.hf_config = hf_config
        self.spec = spec
        self.processor = None  # the model's transformers processor (configure)
        self.settings: dict = {}  # the engine's mm_processor_kwargs (configure)

    # -- processing --------------------------------------------------------------------------

    def items(self, processed: dict, input_ids: Sequence[int]) -> list[EncoderItem]:
        """One item per image, in prompt order, from the processor's outputs (numpy arrays)."""
        raise NotImplementedError

    @property
    def video_token_id(self) -> int | None:
        """The placeholder of a video's frame (group) spans, for a family whose items() reads videos (Qwen3-VL's frame
        groups, Gemma 4's frames); None: videos are refused."""
        return None

    @property
    def reads_videos(self) -> bool:
        return self.video_token_id is not None

    def placeholder_tokens(self) -> tuple[int, ...]:
        """The token ids an image's (or video frame's) span is made of: its placeholder, and any the processor
        interleaves whose rows the encoder yields too (Pixtral's [IMG_BREAK] between token rows)."""
        video = self.video_token_id
        return (self.spec.image_token_id,) if video is None else (self.spec.image_token_id, video)

    def mrope_positions(self, input_ids: Sequence[int], items: Sequence[EncoderItem]) -> tuple[np.ndarray, int] | None:
        """M-RoPE families: ([3, L] positions of the prompt's tokens, the offset decode positions carry)."""
        return None

    processor_class = staticmethod(images_only)  # (cls -> cls) the processor class to build when AutoProcessor cannot

    def configure(self, processor, settings: dict | None = None) -> None:
        """The model's processor, once loaded, and the engine's mm_processor_kwargs: they bound the images
        (max_image_patches)."""
        self.processor = processor
        self.settings = dict(settings or {})

    def max_image_patches(self) -> int:
        """The patches of the largest image the processor makes (the default encoder batch)."""
        raise NotImplementedError

    # -- the encoder step --------------------------------------------------------------------

    def buckets(self, max_patches: int) -> list[int]:
        """Patch counts the encoder compiles for, up to max_patches (powers of two by default)."""
        out, b = [], 1
        while b < max_patches:
            out.append(b)
            b *= 2
        return out + [max_patches]

    def call_patches(self, items: Sequence[EncoderItem], largest_bucket: int) -> int:
        """The most patches one encoder call of these items should take: the largest bucket where images are a batch
        axis (no image's attention meets another's); families whose batches attend across a segment mask cap it."""
        return largest_bucket

    def rows_for(self, bucket: int) -> int:
        """The encoder's output rows at a bucket (an upper bound on its items' rows)."""
        raise NotImplementedError

    def batch(self, items: Sequence[EncoderItem], bucket: int) -> dict[str, np.ndarray]:
        """The items' arrays at the bucket's shapes (padding that yields rows nobody reads); their output rows come
        first, item after item."""
        raise NotImplementedError

    def blank(self, bucket: int) -> dict[str, np.ndarray]:
        """A batch of no item: compiles the bucket."""
        return self.batch([], bucket)


class SameSizeImages(ImageAdapter):
    """A family whose processor resizes (or tiles) every image to the tower's size: each item is `pixel_values`
    [C, S, S] of `patches` patches yielding `tokens` rows, so the buckets count items. A subclass sets the four
    sizes in __init__."""

    image_size: int
    channels: int
    patches: int
    tokens: int

    def items(self, processed: dict, input_ids: Sequence[int]) -> list[EncoderItem]:
        pixels = np.asarray(processed["pixel_values"], np.float32)
        return [EncoderItem({"pixel_values": p}, self.patches, self.tokens) for p in pixels]

    def max_image_patches(self) -> int:
        return self.patches

    def buckets(self, max_patches: int) -> list[int]:
        items = max(1, max_patches // self.patches)
        return [n * self.patches for n in ImageAdapter.buckets(self, items)]

    def rows_for(self, bucket: int) -> int:
        return bucket // self.patches * self.tokens

    def batch(self, items: Sequence[EncoderItem], bucket: int) -> dict[str, np.ndarray]:
        pixels = np.zeros((bucket // self.patches, self.channels, self.image_size, self.image_size), np.float32)
        for i, item in enumerate(items):
            pixels[i] = item.arrays["pixel_values"]
        return {"pixel_values": pixels}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MultimodalStep:
    """A step's image inputs, as the port's forward reads them: the encoder cache and, per token, its row there."""

    rows: jax.Array  # [T] the encoder-cache row replacing each token's embedding; -1: its own (text, padding)
    cache: jax.Array  # [N, levels, D] the encoder cache
    mrope_positions: jax.Array | None = None  # [3, T] M-RoPE families: each token's (t, h, w) position


def merge_embeddings(x: jax.Array, mm: MultimodalStep | None, level: int = 0) -> jax.Array:
    """x [T, D] with each image token's row replaced by its cached embedding (level 0: the input embedding)."""
    if mm is None:
        return x
    rows = mm.rows
    image = mm.cache[jnp.maximum(rows, 0), level].astype(x.dtype)
    return jnp.where((rows >= 0)[:, None], image, x)


def placeholder_ids(input_ids: jax.Array, mm: MultimodalStep | None) -> jax.Array:
    """Token ids to embed: an image token's id may lie outside the vocabulary (transformers embeds id 0 there)."""
    return input_ids if mm is None else jnp.where(mm.rows >= 0, 0, input_ids)


def dense_attention(q, k, v, mask, scale: float) -> jax.Array:
    """q, k, v [B, N, H, D], mask [B, N, N] (or None: all) -> [B, N, H, D]: softmax in float32, as transformers'
    eager vision attention (its float32 towers compute at full precision)."""
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=prec, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        s = jnp.where(mask[:, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(jnp.isnan(p), 0.0, p)  # rows that see nothing (padding)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32).astype(q.dtype)


QUERY_CHUNK = 1024  # attention across a batch of images takes queries this many at a time: [H, chunk, P] scores at most


def segment_attention(q, k, v, q_seg, k_seg, scale: float) -> jax.Array:
    """q, k, v [N, H, D]: each query attends to the keys of its segment (a key's segment -1: padding, seen by none)
    -> [N, H, D]; softmax in float32. Images batched into one sequence attend block-diagonally this way, as
    transformers' variable-resolution towers do (Qwen's full blocks, Pixtral)."""
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = jnp.einsum("qhd,khd->hqk", q, k, precision=prec, preferred_element_type=jnp.float32) * scale
    mask = (q_seg[:, None] == k_seg[None, :]) & (k_seg >= 0)[None, :]
    s = jnp.where(mask[None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(jnp.isnan(p), 0.0, p)  # padding queries see nothing
    out = jnp.einsum("hqk,khd->qhd", p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def batch_attention(q, k, v, seg, scale: float) -> jax.Array:
    """segment_attention over a whole batch [N, H, D] of images (seg [N]), queries QUERY_CHUNK at a time, so no
    [N, N] matrix is made."""
    chunk = min(q.shape[0], QUERY_CHUNK)
    return jnp.concatenate([segment_attention(q[i : i + chunk], k, v, seg[i : i + chunk], seg, scale)
                            for i in range(0, q.shape[0], chunk)])  # fmt: skip


def axial_rope(pos: jax.Array, inv_h, inv_w) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [P, 2 * (len(inv_h) + len(inv_w))] for patches at pos [P, 2] (row, column): the row's angles, then
    the column's, twice (the rotate-half layout of layers.apply_rope): Qwen's and Pixtral's 2-D RoPE."""
    pos = pos.astype(jnp.float32)
    rows, cols = pos[:, :1] * jnp.asarray(inv_h, jnp.float32), pos[:, 1:] * jnp.asarray(inv_w, jnp.float32)
    hw = jnp.concatenate([rows, cols], axis=-1)
    emb = jnp.concatenate([hw, hw], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def segment_call_patches(adapter: ImageAdapter, items: Sequence[EncoderItem], largest_bucket: int) -> int:
    """ImageAdapter.call_patches for towers whose batches attend across a segment mask: its cost is every pair of a
    call's patches, so a call holds images up to twice the largest one's bucket (batching without paying for a
    quadratic whole)."""
    biggest = max(item.num_patches for item in items)
    return min(largest_bucket, next((b for b in adapter.buckets(largest_bucket) if b >= 2 * biggest), largest_bucket))


def in_prompt_order(input_ids: Sequence[int], images: list[EncoderItem], image_token_id: int, frames: list[EncoderItem],
                    video_token_id: int) -> list[EncoderItem]:  # fmt: skip
    """A prompt's image items and video items (each a frame or frame group in a placeholder span of its own) in the
    order of their spans; ValueError where the spans and the items disagree."""
    ids = np.asarray(input_ids)
    image_starts = [a for a, _ in contiguous_spans(ids, image_token_id)]
    video_starts = [a for a, _ in contiguous_spans(ids, video_token_id)]
    if len(image_starts) != len(images) or len(video_starts) != len(frames):
        raise ValueError(f"the prompt holds {len(image_starts)} image and {len(video_starts)} video placeholder spans "
                         f"where the processor made {len(images)} images and {len(frames)} video frame groups")  # fmt: skip
    both = images + frames
    return [both[k] for _, k in sorted(zip(image_starts + video_starts, range(len(both))))]


def contiguous_spans(input_ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token_id` in input_ids, in order."""
    ids = np.asarray(input_ids)
    hit = np.concatenate([[False], ids == token_id, [False]])
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]

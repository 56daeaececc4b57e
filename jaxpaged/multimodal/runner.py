"""The device side of images: the encoder cache (one array of embedding rows), the port's encoder compiled once per
patch-count bucket (every bucket at warm-up, so no image size up to the maximum compiles later), and each step's
per-token arrays: the cache row replacing a token's embedding, M-RoPE's 3-D positions, the image span an image token
attends across (Gemma 3).

Encoding is its own executable, dispatched before the step's forward: it writes its output rows into the cache,
which it donates, and the forward reads them. Images of a step are batched into as few calls as the largest bucket
allows, each padded to the smallest bucket that holds its patches.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.models.vision.common import ImageAdapter, MultimodalStep, VisionSpec
from jaxpaged.multimodal.encoder_cache import EncodeWork, EncoderCache

if TYPE_CHECKING:
    from jaxpaged.config import EngineConfig
    from jaxpaged.models.loader import LoadedModel
    from jaxpaged.worker.model_runner import ModelRunner

logger = logging.getLogger("jaxpaged.multimodal")


def vision_parts(loaded: LoadedModel, processor_kwargs: dict | None = None) -> tuple[VisionSpec, ImageAdapter] | None:
    """(the port's VisionSpec, its family's ImageAdapter, the model's processor and the engine's mm_processor_kwargs
    loaded into it), or None for a model that reads text only."""
    spec = getattr(loaded.model, "vision_spec", None)
    if spec is None:
        return None
    from pathlib import Path

    from jaxpaged.multimodal.processing import check_processor_kwargs, load_processor

    adapter = type(loaded.model).IMAGES(loaded.hf_config, spec)
    folder = Path(loaded.source)
    processor = load_processor(folder if folder.is_dir() else folder.parent, adapter.processor_class)
    adapter.configure(processor)
    if processor_kwargs:  # (checked against the processor's settings: configure first)
        adapter.configure(processor, check_processor_kwargs(adapter, processor_kwargs))
    return spec, adapter


def encoder_sizes(config: EngineConfig, adapter: ImageAdapter) -> tuple[int, int]:
    """(patches the encoder runs per step: its largest bucket; rows of the encoder cache), from the config or, by
    default, one largest image's patches (at least the token budget) and twice a full step's rows."""
    patches = config.max_num_encoder_input_tokens or max(config.max_num_batched_tokens, adapter.max_image_patches())
    rows = config.encoder_cache_size or 2 * adapter.rows_for(adapter.buckets(patches)[-1])
    return patches, rows


def encoder_runner(runner: ModelRunner, loaded: LoadedModel, config: EngineConfig) -> EncoderRunner | None:
    """The runner's encoder, or None: a text-only model, or a process group (whose followers replay only the step
    calls, not the encoder's: there the model runs on text)."""
    if getattr(loaded.model, "vision_spec", None) is None:
        return None
    from jaxpaged import distributed

    if distributed.is_multiprocess():
        logger.warning("images are not supported in a multi-process group: %s runs on text only", loaded.config.architecture)
        return None
    from jaxpaged.multimodal.processing import ProcessorUnavailable

    try:
        spec, adapter = vision_parts(loaded, config.mm_processor_kwargs)
    except ProcessorUnavailable as exc:  # the language model still serves text; an image request is told why not
        logger.warning("images are off, %s runs on text only: %s", loaded.config.architecture, exc)
        runner.images_off = str(exc)
        return None
    patches, rows = encoder_sizes(config, adapter)
    return EncoderRunner(runner, spec, adapter, patches, rows)


class EncoderRunner:
    def __init__(self, runner: ModelRunner, spec: VisionSpec, adapter: ImageAdapter, max_patches: int, cache_rows: int):
        self.runner = runner
        self.spec = spec
        self.adapter = adapter
        self.buckets = adapter.buckets(max_patches)
        self.max_patches = self.buckets[-1]
        self.cache = EncoderCache(cache_rows)
        shape = (cache_rows, spec.levels, spec.hidden_size)
        if runner.mesh is None:
            with jax.default_device(runner.device):
                self.array = jnp.zeros(shape, runner.dtype)
            self._encode = jax.jit(self._encode_impl, donate_argnums=(1,))
        else:  # replicated: every device reads its tokens' rows (the tower itself runs replicated too)
            from jax.sharding import NamedSharding, PartitionSpec

            replicated = NamedSharding(runner.mesh, PartitionSpec())
            self.array = jax.device_put(jnp.zeros(shape, runner.dtype), replicated)
            self._encode = jax.jit(self._encode_impl, donate_argnums=(1,), out_shardings=replicated)
        self.num_calls = 0
        logger.info("encoder cache: %d embedding rows (%.1f MB); encoder buckets %s patches", cache_rows,
                    self.array.nbytes / 1e6, self.buckets)  # fmt: skip

    def _encode_impl(self, state, cache, batch, dst):
        """The port's encode on a bucket's batch, its rows written to the cache rows `dst` (out of range: dropped)."""
        model = nnx.merge(self.runner.graphdef, state)
        out = model.encode(batch)
        return cache.at[dst].set(out.astype(cache.dtype), mode="drop")

    def bucket_for(self, patches: int) -> int:
        for b in self.buckets:
            if patches <= b:
                return b
        raise ValueError(f"an encoder batch of {patches} patches exceeds max_num_encoder_input_tokens ({self.max_patches})")

    def _call(self, items: Sequence, rows: Sequence[np.ndarray], bucket: int) -> None:
        batch = self.adapter.batch(list(items), bucket)
        dst = np.full(self.adapter.rows_for(bucket), self.cache.num_rows, np.int32)
        at = 0
        for r in rows:
            dst[at : at + len(r)] = r
            at += len(r)
        args = (self.runner.state, self.array, jax.tree.map(self.runner._put, batch), self.runner._put(dst))
        with self.runner._on_mesh():
            self.array = self.runner._executable("encode", self._encode, bucket, args)(*args)
        self.num_calls += 1

    def encode(self, work: Sequence[EncodeWork]) -> None:
        """Encode the step's images into their cache rows, in as few calls as the family's call size allows."""
        if not work:
            return
        limit = self.adapter.call_patches([w.item for w in work], self.max_patches)
        batch, patches = [], 0
        for w in sorted(work, key=lambda w: -w.item.num_patches):
            if batch and patches + w.item.num_patches > limit:
                self._call([b.item for b in batch], [b.rows for b in batch], self.bucket_for(patches))
                batch, patches = [], 0
            batch.append(w)
            patches += w.item.num_patches
        if batch:
            self._call([b.item for b in batch], [b.rows for b in batch], self.bucket_for(patches))

    def warmup(self) -> None:
        """Compile every bucket (an all-padding batch writes nothing)."""
        for bucket in self.buckets:
            self._call([], [], bucket)

    # -- a step's per-token arrays ----------------------------------------------------------------

    def step_leaves(self, step, num_tokens: int) -> dict:
        """What the forward's packed inputs carry for images (a blank step: no image rows)."""
        rows = step.mm_rows if step.mm_rows is not None else np.full(num_tokens, -1, np.int32)
        leaves = {"rows": rows}
        if self.spec.mrope:
            mrope = step.mrope_positions
            leaves["mrope"] = mrope if mrope is not None else np.broadcast_to(step.positions, (3, num_tokens)).astype(np.int32)
        return leaves

    def step_inputs(self, leaves: dict, encoder_cache) -> MultimodalStep:
        """Inside the jitted forward: the port's MultimodalStep."""
        return MultimodalStep(leaves["rows"], encoder_cache, leaves.get("mrope"))

    def step_arrays(self, num_tokens: int, positions: np.ndarray, rows, deltas):
        """image_step_arrays with this engine's cache."""
        return image_step_arrays(self.spec, self.cache.rows, num_tokens, positions, rows, deltas)


def image_step_arrays(spec: VisionSpec, cache_rows_of, num_tokens: int, positions: np.ndarray,
                      rows: Sequence[tuple[int, object, int, int]], deltas: np.ndarray | None):  # fmt: skip
    """(cache row per token, key ends or None, M-RoPE positions [3, T] or None) for a step whose rows with images are
    `rows`: (first token row, MultimodalInputs, start position, token count); cache_rows_of(key): an image's rows in
    the encoder cache; deltas: each token's M-RoPE offset (its request's rope_delta: a token past the prompt at
    position p has M-RoPE position p + delta)."""
    cache_rows = np.full(num_tokens, -1, np.int32)
    key_ends = positions.copy() if spec.bidirectional else None
    mrope = None
    if spec.mrope:
        mrope = np.broadcast_to(positions + (0 if deltas is None else deltas), (3, num_tokens)).astype(np.int32)
    for first, mm, start, count in rows:
        stop = start + count
        for image in mm.overlapping(start, stop):
            a, b = max(start, image.offset), min(stop, image.end)
            at = slice(first + a - start, first + b - start)
            cache_rows[at] = cache_rows_of(image.key)[a - image.offset : b - image.offset]
            if key_ends is not None:
                key_ends[at] = image.end - 1
        if mrope is not None and mm.mrope_positions is not None:
            b = min(stop, mm.mrope_positions.shape[1])
            if b > start:
                mrope[:, first : first + b - start] = mm.mrope_positions[:, start:b]
    return cache_rows, key_ends, mrope

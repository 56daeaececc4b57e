"""A vision-language port's float32 logits at every prompt position, several prompts in one ragged step, with their
images encoded first: built with the engine's own processing (MultimodalProcessor) and per-token image arrays
(image_step_arrays), so what is checked against transformers is the path requests take, less the scheduler."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxpaged.models.loader import load_model
from jaxpaged.models.vision.common import MultimodalStep
from jaxpaged.multimodal.media import MediaLoader
from jaxpaged.multimodal.processing import MultimodalProcessor
from jaxpaged.multimodal.runner import image_step_arrays, vision_parts
from jaxpaged.pallas_kernels import AttentionMetadata, kv_cache_shape
from jaxpaged.pallas_kernels.state_cache import HybridCache

BLOCK = 16


class VLMRunner:
    def __init__(self, folder, **load_kwargs):
        self.loaded = load_model(str(folder), **load_kwargs)
        self.model = self.loaded.model
        self.spec, self.adapter = vision_parts(self.loaded)
        self.processor = MultimodalProcessor(self.adapter.processor, self.adapter, self.spec, MediaLoader())
        graphdef, state = nnx.split(self.model)
        self._encode = jax.jit(lambda st, batch: nnx.merge(graphdef, st).encode(batch))
        self._logits = jax.jit(lambda st, *args: self._logits_impl(nnx.merge(graphdef, st), *args))
        self.state = state

    @staticmethod
    def _logits_impl(model, ids, positions, kv, md, mm):
        hidden, _ = model.forward(ids, positions, kv, md, mm)
        return model.compute_logits(hidden)

    def inputs(self, text: str | None = None, images: Sequence = (), messages=None):
        """(token ids, MultimodalInputs or None) as the engine makes them."""
        if messages is not None:
            ids, mm = self.processor.chat(messages)
        else:
            ids, mm = self.processor.prompt(text, list(images))
        return ids, (mm if mm.images else None)

    def logits(self, requests: Sequence[tuple[list[int], object]]) -> list[np.ndarray]:
        """Each request's logits at every prompt position, all requests in one step."""
        items = {}
        for _, mm in requests:
            for image in mm.images if mm is not None else ():
                items.setdefault(image.key, image.item)
        rows, cache = {}, []
        for key, item in items.items():  # each image alone, at the bucket of its own patches
            bucket = self.adapter.buckets(item.num_patches)[-1]
            out = np.asarray(self._encode(self.state, jax.tree.map(jnp.asarray, self.adapter.batch([item], bucket))))
            rows[key] = np.arange(item.num_rows, dtype=np.int32) + sum(len(c) for c in cache)
            cache.append(out[: item.num_rows])
        cache = jnp.asarray(np.concatenate(cache) if cache else np.zeros((1, self.spec.levels, self.spec.hidden_size), np.float32))
        lens = [len(ids) for ids, _ in requests]
        total = sum(lens)
        width = -(-max(lens) // BLOCK)
        ids = np.concatenate([np.asarray(i, np.int32) for i, _ in requests])
        positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        slots = np.concatenate([i * width * BLOCK + np.arange(n, dtype=np.int32) for i, n in enumerate(lens)])
        tables = np.arange(len(requests) * width, dtype=np.int32).reshape(len(requests), width)
        image_rows = [(int(qsl[i]), mm, 0, n) for i, ((_, mm), n) in enumerate(zip(requests, lens)) if mm is not None]
        mm_rows, key_ends, mrope = image_step_arrays(self.spec, rows.__getitem__, total, positions, image_rows, None)
        states = getattr(self.model, "state_spec", None)  # a hybrid model: request i's linear layers' state in slot i
        md = AttentionMetadata(jnp.asarray(slots), jnp.asarray(tables), jnp.asarray(lens, jnp.int32), jnp.asarray(qsl),
                               key_ends=None if key_ends is None else jnp.asarray(key_ends),
                               state_slots=None if states is None else jnp.arange(len(requests), dtype=jnp.int32))  # fmt: skip
        cfg = self.loaded.config
        kv = jnp.zeros(kv_cache_shape(cfg.num_kv_layers, cfg.num_kv_heads, len(requests) * width, BLOCK, cfg.head_dim), jnp.float32)
        if states is not None:
            kv = HybridCache(kv, states().empty(len(requests)))
        mm = MultimodalStep(jnp.asarray(mm_rows), cache, None if mrope is None else jnp.asarray(mrope))
        out = np.asarray(self._logits(self.state, jnp.asarray(ids), jnp.asarray(positions), kv, md, mm))
        return [out[qsl[i] : qsl[i + 1]] for i in range(len(requests))]


def check_logits(hf, runner: VLMRunner, cases: dict, label: str = "") -> list:
    """cases: name -> (a request spec for VLMRunner.inputs, transformers' inputs). All requests in one ragged step:
    each one's prompt ids are transformers', and its logits at every position within 1e-4 of transformers' for it
    alone. Returns the requests (token ids, MultimodalInputs or None)."""
    from tests.vlm_models import hf_vlm_logits

    requests = [runner.inputs(spec.get("text"), spec.get("images", ()), spec.get("messages")) for spec, _ in cases.values()]
    for (name, (_, hf_in)), (ids, mm), got in zip(cases.items(), requests, runner.logits(requests)):
        assert ids == hf_in["input_ids"][0].tolist(), name
        assert (mm is None) == ("pixel_values" not in hf_in), name
        np.testing.assert_allclose(got, hf_vlm_logits(hf, hf_in), atol=1e-4, err_msg=f"{label} {name}".strip())
    return requests


def png_data_url(image) -> str:
    """A PIL image as the data URL an OpenAI client sends: PNG, lossless, so the server sees the same pixels."""
    import base64
    import io

    png = io.BytesIO()
    image.save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def greedy_chat_through_server(llm, messages: list, max_tokens: int, extras: list[dict] | None = None):
    """`llm`'s engine behind the OpenAI app, in this process (ASGI, no socket): the JSON reply to one greedy chat
    completion of `messages`, EOS ignored; with `extras`, one request per dict of more body fields, and a list of
    (HTTP status, JSON reply). The engine is shut down after."""
    import asyncio

    import httpx

    from jaxpaged.engine.async_engine import AsyncLLMEngine
    from jaxpaged.entrypoints.openai import ServerSettings, build_app

    engine = AsyncLLMEngine(llm.engine)
    app = build_app(engine, ServerSettings(["m"]))
    engine.start()

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as http:
            body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            replies = [await http.post("/v1/chat/completions", json=body | extra) for extra in extras or [{}]]
            return [(r.status_code, r.json()) for r in replies] if extras is not None else replies[0].json()

    try:
        return asyncio.run(ask())
    finally:
        engine.shutdown()


def rerun_with_torchvision(test_file: str, passed: int, skipped: int) -> None:
    """Run `test_file` again in a subprocess with torchvision from JAXPAGED_TEST_TORCHVISION (a `pip install --no-deps
    --target` folder; .ci/run sets it) and assert its summary: transformers builds video processors, and some image
    processors, only with torchvision, which the suite's environment lacks on purpose (it changes which image
    processor AutoProcessor builds for other families). Skips without the folder."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    from tests import REPO

    folder = os.environ.get("JAXPAGED_TEST_TORCHVISION")
    if not folder:
        pytest.skip("JAXPAGED_TEST_TORCHVISION names a folder holding torchvision (pip install --no-deps --target); .ci/run sets it")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([folder, str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", str(Path(test_file).resolve())],
                          check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert f"{passed} passed" in summary and f"{skipped} skipped" in summary, summary

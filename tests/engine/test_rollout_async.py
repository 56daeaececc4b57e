"""A trainer's rollout calls on AsyncLLMEngine and the server (issue 47): update_weights while requests stream
(finished on the old weights, new ones held until the update is in, or aborted with the reason), sleep refusing or
queueing requests until wake_up, and the server's --allow-weight-updates routes with OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import jax.numpy as jnp
import pytest

from jaxpaged import SamplingParams
from jaxpaged.config import EngineConfig
from jaxpaged.engine.async_engine import AsyncLLMEngine
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine.weight_sync import ABORT_REASON, EngineAsleepError
from tests.hf_reference import hf_greedy, random_hf_model, random_prompts, save_hf_model

PROMPTS = random_prompts(256, [7, 13, 4], seed=21)


def hf_arrays(model):
    return {name: jnp.asarray(t.detach().numpy()) for name, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def hf_model_b(hf_model):
    return random_hf_model(hf_model.config, seed=9)


@pytest.fixture(scope="module")
def engine(model_dir):
    config = EngineConfig(model=model_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
                          num_kv_blocks=64)  # fmt: skip
    return LLMEngine(config)


@pytest.fixture
def async_engine(engine, hf_model):
    made = AsyncLLMEngine(engine)
    yield made
    made.shutdown()
    if engine.is_sleeping:
        engine.wake_up()
    engine.update_weights(hf_arrays(hf_model))
    assert not engine.has_unfinished_requests()


def _greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def _tokens(engine, prompt, n, rid):
    out = None
    async for out in engine.generate({"prompt_token_ids": prompt}, _greedy(n), rid):
        pass
    return out


def test_finish_streams_the_old_weights_then_holds_new_requests(async_engine, hf_model, hf_model_b):
    async def main():
        streams = await async_engine.add_requests([(f"old-{i}", {"prompt_token_ids": p}, _greedy(20)) for i, p in enumerate(PROMPTS)])
        update = asyncio.ensure_future(async_engine.update_weights(hf_arrays(hf_model_b), in_flight="finish"))
        await asyncio.sleep(0)
        late = asyncio.ensure_future(_tokens(async_engine, PROMPTS[0], 5, "new"))
        finals = []
        for stream in streams:
            async for out in stream:
                last = out
            finals.append(last)
        result = await update
        return finals, result, await late

    finals, result, late = asyncio.run(main())
    assert [list(o.outputs[0].token_ids) for o in finals] == [hf_greedy(hf_model, p, 20) for p in PROMPTS]
    assert result["tensors"] > 0 and result["outputs"] == []  # they had finished (and streamed) before it ran
    assert list(late.outputs[0].token_ids) == hf_greedy(hf_model_b, PROMPTS[0], 5)


def test_abort_ends_the_streams_with_the_reason(async_engine, hf_model_b):
    async def main():
        streams = await async_engine.add_requests([(f"a-{i}", {"prompt_token_ids": p}, _greedy(40)) for i, p in enumerate(PROMPTS)])
        async for _ in streams[0]:
            break  # running
        await async_engine.update_weights(hf_arrays(hf_model_b), in_flight="abort")
        finals = []
        for stream in streams:
            out = None
            async for out in stream:
                pass
            finals.append(out)
        return finals

    for out in asyncio.run(main()):
        assert out.finished and out.outputs[0].finish_reason == "abort" and out.outputs[0].stop_reason == ABORT_REASON
        assert len(out.outputs[0].token_ids) < 40


def test_bad_weights_raise_at_once_while_the_requests_in_flight_run_on(async_engine, engine, hf_model, hf_model_b,
                                                                     monkeypatch, tmp_path):  # fmt: skip
    """in_flight="finish" checks the weights before it waits: bad ones raise at once, naming the tensor, while the
    request in flight runs on (and ends as it would have); good ones (a folder) still wait for it, then apply."""
    paused = threading.Event()
    real_step = engine.step

    def step():  # paused: the request stays in flight, the engine thread still takes commands
        if paused.is_set():
            time.sleep(0.002)
            return []
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    good = hf_arrays(hf_model_b)
    norm = "model.norm.weight"
    bad = [({**good, norm: good[norm][:-1]}, "model.norm.weight has shape"),
           ({"model.nope.weight": good[norm]}, "unknown tensor model.nope.weight"),
           ({norm: good[norm].astype(jnp.int32)}, "model.norm.weight is int32"),
           (str(tmp_path / "missing"), "does not exist")]  # fmt: skip
    folder = save_hf_model(hf_model_b, tmp_path / "b")

    async def main():
        stream = await async_engine.add_request("long", {"prompt_token_ids": PROMPTS[0]}, _greedy(60))
        async for _ in stream:
            break  # running
        paused.set()
        for weights, match in bad:  # (before the check, each waited for "long": for ever, paused)
            with pytest.raises(ValueError, match=match):
                await asyncio.wait_for(async_engine.update_weights(weights, in_flight="finish"), 30)
        assert engine.has_request("long") and not stream.finished
        update = asyncio.ensure_future(async_engine.update_weights(str(folder), in_flight="finish"))
        await asyncio.sleep(0.2)
        assert not update.done()  # it waits for "long"
        paused.clear()
        async for last in stream:
            pass
        return last, await update, await _tokens(async_engine, PROMPTS[1], 5, "after")

    last, result, after = asyncio.run(main())
    assert last.outputs[0].finish_reason == "length"
    assert list(last.outputs[0].token_ids) == hf_greedy(hf_model, PROMPTS[0], 60)  # the old weights to its end
    assert result["tensors"] == len(good) and result["outputs"] == []
    assert list(after.outputs[0].token_ids) == hf_greedy(hf_model_b, PROMPTS[1], 5)


def test_sleep_refuses_or_queues_until_wake_up(async_engine, hf_model):
    async def main():
        asleep = await async_engine.sleep(1)
        assert async_engine.is_sleeping and asleep["engine_bytes_asleep"] == 0 < asleep["engine_bytes_before"]
        with pytest.raises(EngineAsleepError, match="wake_up"):
            await async_engine.add_request("refused", {"prompt_token_ids": PROMPTS[0]}, _greedy(3))
        await async_engine.wake_up()
        await async_engine.sleep(2, queue_requests=True)
        queued = asyncio.ensure_future(_tokens(async_engine, PROMPTS[1], 4, "queued"))
        await asyncio.sleep(0.2)
        assert not queued.done()
        await async_engine.wake_up(["weights"])
        await async_engine.update_weights(hf_arrays(hf_model))  # level 2 dropped them: the trainer sends them
        await asyncio.sleep(0.2)
        assert not queued.done()  # the KV pool is still away
        await async_engine.wake_up(["kv_cache"])
        return await queued

    assert list(asyncio.run(main()).outputs[0].token_ids) == hf_greedy(hf_model, PROMPTS[1], 4)


def test_server_routes(engine, hf_model, hf_model_b, tmp_path):
    from jaxpaged.entrypoints.openai import ServerSettings, build_app

    folder = save_hf_model(hf_model_b, tmp_path / "b")
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
    closed = build_app(AsyncLLMEngine(engine), ServerSettings(["tiny"]))
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, ServerSettings(["tiny"], allow_weight_updates=True))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=closed), base_url="http://t") as client:
            assert (await client.post("/sleep", json={})).status_code == 404  # not without the flag
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            bad = await client.post("/update_weights", json={"path": str(tmp_path / "missing")})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "path"
            bad = await client.post("/sleep", json={"level": 3})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
            ok = await client.post("/update_weights", json={"path": str(folder)})
            assert ok.status_code == 200 and ok.json()["tensors"] == len(hf_model_b.state_dict())
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            assert (await client.post("/sleep", json={"level": 1})).json()["status"] == "ok"
            assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
            refused = await client.post("/v1/completions", json=body)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_asleep"
            assert (await client.post("/wake_up", json={"tags": ["weights", "kv_cache"]})).status_code == 200
            assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
            assert (await client.post("/v1/completions", json=body)).json()["usage"]["completion_tokens"] == 3

    try:
        asyncio.run(main())
    finally:
        async_engine.shutdown()
    engine.add_request("check", {"prompt_token_ids": PROMPTS[0]}, _greedy(4))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert list(outs[-1].outputs[0].token_ids) == hf_greedy(hf_model_b, PROMPTS[0], 4)
    engine.update_weights(hf_arrays(hf_model))

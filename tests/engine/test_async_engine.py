"""AsyncLLMEngine in-process: shared batch, abort, cancellation, bad input, queue limit, loop death."""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import traceback

import httpx
import pytest

from jaxpaged import SamplingParams
from jaxpaged.config import EngineConfig
from jaxpaged.engine.async_engine import AsyncLLMEngine, ChatPrompt, EngineDeadError, QueueFullError
from jaxpaged.engine.llm_engine import LLMEngine
from tests.cycle_model import greedy_text


@pytest.fixture(scope="module")
def llm_engine(cycle_model_dir):
    # the servers' configuration (tests/conftest.py), so the persistent XLA cache already holds its steps
    config = EngineConfig(model=str(cycle_model_dir), dtype="float32", max_model_len=512, max_num_seqs=32,
                          max_num_batched_tokens=64, block_size=8, num_kv_blocks=1024)
    return LLMEngine(config)


@pytest.fixture
def make_engine(llm_engine):
    made = []

    def make(**kwargs) -> AsyncLLMEngine:
        engine = AsyncLLMEngine(llm_engine, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()
    stats = llm_engine.get_stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
    assert not llm_engine.output_processor.parents


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


async def _collect(engine: AsyncLLMEngine, prompt, params, rid):
    outs = [out async for out in engine.generate(prompt, params, rid)]
    return outs


async def _until(condition, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)


async def _bounded(engine: AsyncLLMEngine, coro, seconds: float = 120.0):
    """coro's result, or a failure showing where the engine stands (a hang otherwise tells nothing)."""
    try:
        return await asyncio.wait_for(coro, seconds)
    except TimeoutError:
        frame = sys._current_frames().get(engine._thread.ident) if engine._thread is not None else None
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no engine thread)\n"
        pytest.fail(f"hung: held {[c[0] for c in engine._held]}, unfinished {engine.engine.has_unfinished_requests()}, "
                    f"dead {engine._dead!r}; the engine thread at:\n{stack}")


def test_concurrent_callers_share_one_batch(make_engine):
    running = []
    engine = make_engine(stats_listener=lambda s: running.append(s.engine["num_running"]))

    async def main():
        return await asyncio.gather(*(
            _collect(engine, {"prompt_token_ids": [65 + i]}, _greedy(10 + i), f"r{i}") for i in range(20)
        ))

    results = asyncio.run(main())
    for i, outs in enumerate(results):
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        assert final.outputs[0].text == greedy_text(65 + i, 10 + i)
        assert len(final.outputs[0].token_ids) == 10 + i
        # outputs are cumulative: each extends the one before
        assert all(b.outputs[0].token_ids[: len(a.outputs[0].token_ids)] == a.outputs[0].token_ids for a, b in itertools.pairwise(outs))
    assert max(running) == 20  # all twenty decoded in the same steps


def test_text_is_templated_and_tokenized_off_the_engine_thread(make_engine, llm_engine, monkeypatch):
    """A conversation and a string are rendered in a worker thread with the renderer's own tokenizer copy (the
    engine's thread decodes with the original meanwhile), and come out as the engine's thread would make them."""
    from jaxpaged.engine import prompt_renderer

    threads, render = [], prompt_renderer.render_chat_prompt
    monkeypatch.setattr(prompt_renderer, "render_chat_prompt",
                        lambda tok, prompt: threads.append((threading.current_thread().name, tok)) or render(tok, prompt))  # fmt: skip
    engine = make_engine()
    chat = ChatPrompt([{"role": "user", "content": "hi"}])
    outs = asyncio.run(_collect(engine, chat, _greedy(6), "chat"))
    assert outs[-1].outputs[0].text == greedy_text(ord("\n"), 6)
    text, ids = llm_engine._prompt_ids(chat)  # as the engine's thread renders it
    assert outs[-1].prompt_token_ids == ids and outs[-1].prompt == text and ids[-1] == ord("\n")
    ((name, tokenizer),) = threads
    assert name not in ("jaxpaged-engine", threading.main_thread().name) and tokenizer is not llm_engine.tokenizer
    (by_text,) = asyncio.run(_collect(engine, "abc", _greedy(3), "text"))[-1:]
    assert by_text.prompt == "abc" and by_text.prompt_token_ids == list(llm_engine.tokenizer.encode("abc"))
    assert llm_engine.render_prompt([5, 6]) == [5, 6] and llm_engine.render_prompt({"prompt_token_ids": [5]}) == {"prompt_token_ids": [5]}


def test_abort_ends_the_stream_and_frees_blocks_at_once(make_engine, llm_engine):
    engine = make_engine()

    async def main():
        seen = []
        async for out in engine.generate({"prompt_token_ids": [5]}, _greedy(480), "long"):
            seen.append(out)
            if len(seen) == 3:
                engine.abort("long")
        return seen

    seen = asyncio.run(main())
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert len(seen[-1].outputs[0].token_ids) < 480
    assert engine.get_stats()["kv_blocks_used"] == 0 and "long" not in llm_engine.output_processor.parents


def test_cancelled_caller_aborts_its_request(make_engine, llm_engine):
    engine = make_engine()

    async def main():
        first = asyncio.Event()

        async def consume():
            async for _ in engine.generate({"prompt_token_ids": [5]}, _greedy(480), "cancel-me"):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # the abort lands after the step in flight
            if "cancel-me" not in llm_engine.output_processor.parents:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert "cancel-me" not in llm_engine.output_processor.parents


def test_bad_requests_raise_and_the_loop_goes_on(make_engine):
    engine = make_engine()

    async def main():
        with pytest.raises(ValueError, match="prompt_token_ids"):
            await engine.add_request("bad", {"prompt_token_ids": [10_000]}, _greedy(4))
        with pytest.raises(ValueError, match="max_tokens"):
            await engine.add_request("long", {"prompt_token_ids": [1] * 500}, _greedy(100))
        with pytest.raises(ValueError, match="messages"):
            await engine.add_request("tmpl", ChatPrompt([1]), _greedy(4))
        # all or none: the good first request of a failing batch is not left queued
        with pytest.raises(ValueError):
            await engine.add_requests([("ok", {"prompt_token_ids": [3]}, _greedy(4)), ("bad2", {"prompt_token_ids": []}, _greedy(4))])
        return await _collect(engine, {"prompt_token_ids": [3]}, _greedy(4), "ok")

    outs = asyncio.run(main())
    assert outs[-1].outputs[0].text == greedy_text(3, 4)


def test_max_tokens_none_fills_what_is_left(make_engine):
    engine = make_engine()
    outs = asyncio.run(_collect(engine, {"prompt_token_ids": [1] * 500}, SamplingParams(temperature=0, max_tokens=None), "fill"))
    assert len(outs[-1].outputs[0].token_ids) == 12 and outs[-1].outputs[0].finish_reason == "length"


def test_full_waiting_queue_refuses(make_engine, llm_engine, monkeypatch):
    engine = make_engine(max_waiting=2)
    gate, stepping = threading.Event(), threading.Event()
    real_step = llm_engine.step

    def gated_step():  # hold the loop inside a step so the adds below queue up behind it
        stepping.set()
        gate.wait(10)
        return real_step()

    monkeypatch.setattr(llm_engine, "step", gated_step)
    prompt = {"prompt_token_ids": [3]}

    async def main():
        with pytest.raises(ValueError, match="waiting queue"):
            await engine.add_requests([(f"x{i}", prompt, _greedy(4)) for i in range(3)])
        blocker = await engine.add_request("blocker", prompt, _greedy(4))
        await asyncio.get_running_loop().run_in_executor(None, stepping.wait, 10)
        two = asyncio.ensure_future(engine.add_requests([(f"q{i}", prompt, _greedy(4)) for i in range(2)]))
        one = asyncio.ensure_future(engine.add_request("q2", prompt, _greedy(4)))
        await asyncio.sleep(0.05)
        gate.set()
        streams = await two
        with pytest.raises(QueueFullError):
            await one
        for stream in [blocker, *streams]:
            outs = [out async for out in stream]
            assert outs[-1].outputs[0].finish_reason == "length"

    asyncio.run(main())
    monkeypatch.undo()


def test_loop_death_fails_every_caller_and_marks_the_engine_dead(make_engine, llm_engine, monkeypatch):
    engine = make_engine()
    real_step = llm_engine.step
    calls = 0

    def failing_step():
        nonlocal calls
        calls += 1
        if calls == 5:
            raise RuntimeError("device fell over")
        return real_step()

    monkeypatch.setattr(llm_engine, "step", failing_step)

    async def main():
        results = await asyncio.gather(
            *(_collect(engine, {"prompt_token_ids": [7]}, _greedy(100), f"d{i}") for i in range(4)), return_exceptions=True
        )
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "device fell over" in str(results[0])
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", {"prompt_token_ids": [7]}, _greedy(4))

    asyncio.run(main())
    assert engine.errored and not engine.is_running
    monkeypatch.undo()


def test_health_and_requests_are_503_once_the_loop_is_dead(make_engine, llm_engine, monkeypatch):
    from jaxpaged.entrypoints.openai import ServerSettings, build_app

    engine = make_engine()
    app = build_app(engine, ServerSettings(["m"]))

    def broken_step():
        raise RuntimeError("boom")

    monkeypatch.setattr(llm_engine, "step", broken_step)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            assert (await client.get("/health")).status_code == 200
            r = await client.post("/v1/completions", json={"model": "m", "prompt": [5], "max_tokens": 3})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            health = await client.get("/health")
            assert health.status_code == 503 and "boom" in health.json()["error"]["message"]
            for method in ("GET", "POST"):  # vLLM's /ping is /health
                ping = await client.request(method, "/ping")
                assert ping.status_code == 503 and ping.json() == health.json()
            r = await client.post("/v1/completions", json={"model": "m", "prompt": [5], "max_tokens": 3})
            assert r.status_code == 503
            metrics = (await client.get("/metrics")).text
            assert "jaxpaged:engine_alive 0.0" in metrics

    asyncio.run(main())
    monkeypatch.undo()


def test_abort_of_an_add_held_behind_an_update_lands_after_it(make_engine, llm_engine, cycle_model_dir, monkeypatch):
    """An add held behind update_weights(in_flight="finish") keeps its abort in order: a cancelled caller's request
    and one aborted by id while its add waited end at once when released (they ran to their end for nobody)."""
    engine = make_engine()
    aborted = {}
    real_abort = llm_engine.abort_request_with_output

    def recording_abort(request_id):
        out = real_abort(request_id)
        if out is not None:
            aborted[request_id] = out
        return out

    monkeypatch.setattr(llm_engine, "abort_request_with_output", recording_abort)

    async def main():
        busy = await engine.add_request("busy", {"prompt_token_ids": [5]}, _greedy(480))
        update = asyncio.ensure_future(engine.update_weights(str(cycle_model_dir), in_flight="finish"))
        victim = asyncio.create_task(_collect(engine, {"prompt_token_ids": [6]}, _greedy(400), "victim"))
        gone = asyncio.ensure_future(engine.add_request("gone", {"prompt_token_ids": [7]}, _greedy(400)))
        await _until(lambda: len(engine._held) == 3)  # the update and both adds wait for "busy" to finish
        assert len(engine._held) == 3 and engine.engine.has_request("busy")
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        engine.abort("gone")
        engine.abort("busy")
        async for _ in busy:
            pass
        await update
        return [out async for out in await gone]

    outs = asyncio.run(_bounded(engine, main()))  # (it hung once in a loaded two-worker run)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort" and outs[-1].outputs[0].token_ids == []
    assert aborted["victim"].outputs[0].token_ids == [] and aborted["victim"].outputs[0].finish_reason == "abort"
    monkeypatch.undo()


def test_held_commands_after_one_that_kills_the_loop_fail_instead_of_waiting(make_engine, llm_engine, monkeypatch):
    """The loop dying while it releases the held commands fails those after the fatal one with EngineDeadError:
    taken off the held list for the release, they were nowhere _die looks, and their callers waited forever."""
    engine = make_engine()
    real_abort = llm_engine.abort_request_with_output
    calls = []

    def abort_failing_when_released(request_id):
        calls.append(request_id)
        if calls.count("a") == 2:  # the abort of "a" held behind its add, run on release
            raise RuntimeError("abort fell over")
        return real_abort(request_id)

    monkeypatch.setattr(llm_engine, "abort_request_with_output", abort_failing_when_released)

    async def main():
        busy = await engine.add_request("busy", {"prompt_token_ids": [5]}, _greedy(480))
        call = asyncio.ensure_future(engine._on_engine(lambda _: "ran", when_idle=True))
        added = asyncio.ensure_future(engine.add_request("a", {"prompt_token_ids": [6]}, _greedy(4)))
        await _until(lambda: len(engine._held) == 2)
        engine.abort("a")
        later = asyncio.ensure_future(engine.add_request("b", {"prompt_token_ids": [7]}, _greedy(4)))
        await _until(lambda: len(engine._held) == 4)
        assert [c[0] for c in engine._held] == ["call", "add", "abort", "add"] and engine.engine.has_request("busy")
        engine.abort("busy")
        async for _ in busy:
            pass
        assert await call == "ran"
        await added
        with pytest.raises(EngineDeadError, match="abort fell over"):
            await later

    asyncio.run(_bounded(engine, main(), 60))
    assert engine.errored
    monkeypatch.undo()

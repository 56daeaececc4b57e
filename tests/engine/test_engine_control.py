"""vLLM's engine-control calls on the tiny cycle model: reset_prefix_cache (refused while blocks are held),
get_metrics (vLLM's metric objects, the server's /metrics from the same source), start_profile / stop_profile (a
JAX trace on disk), on LLM, AsyncLLMEngine and the server's routes."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.metrics import Counter, Gauge, Histogram
from jaxpaged.engine.profiler import Profiler, ProfilerError

BLOCK = 8
PROMPT = {"prompt_token_ids": list(range(65, 65 + 3 * BLOCK + 2))}  # three full blocks to cache
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def llm(cycle_model_dir, profiles):
    return LLM(str(cycle_model_dir), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, block_size=BLOCK,
               max_model_len=128, num_kv_blocks=64, profiler_dir=str(profiles), log_level="WARNING")  # fmt: skip


def _hits(llm) -> int:
    return llm.get_stats()["prefix_cache_hits"]


def test_reset_prefix_cache(llm):
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    assert llm.get_stats()["kv_blocks_cached"] >= 3
    before = _hits(llm)
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    assert _hits(llm) - before == 3 * BLOCK  # the prompt's full blocks came from the cache
    assert llm.reset_prefix_cache() is True
    assert llm.get_stats()["kv_blocks_cached"] == 0
    before = _hits(llm)
    (out,) = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    assert _hits(llm) == before and out.num_cached_tokens == 0  # computed afresh

    engine = llm.engine  # a request holding blocks: refused, nothing forgotten
    engine.add_request("held", PROMPT, GREEDY)
    engine.step()
    cached = llm.get_stats()["kv_blocks_cached"]
    assert llm.reset_prefix_cache() is False and llm.get_stats()["kv_blocks_cached"] == cached > 0
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache() is True and llm.get_stats()["kv_blocks_cached"] == 0
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def _by_name(metrics) -> dict:
    return {(m.name, tuple(sorted(m.labels.items()))): m for m in metrics}


def test_get_metrics(llm):
    before = _by_name(llm.get_metrics())
    prompts = [{"prompt_token_ids": [70 + i] * (5 + i)} for i in range(3)]
    outs = llm.generate(prompts, [GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=2, n=2, ignore_eos=True)],
                        use_tqdm=False)  # fmt: skip
    after = _by_name(llm.get_metrics())

    def grew(name, labels=()):
        return after[(name, labels)].value - before[(name, labels)].value

    assert isinstance(after[("jaxpaged:prompt_tokens", ())], Counter)
    assert grew("jaxpaged:prompt_tokens") == 5 + 6 + 7
    assert grew("jaxpaged:generation_tokens") == sum(len(c.token_ids) for o in outs for c in o.outputs) == 4 + 4 + 2 * 2
    assert grew("jaxpaged:request_finished", (("finished_reason", "length"),)) == 4  # per choice, as the server
    e2e = after[("jaxpaged:e2e_request_latency_seconds", ())]
    assert isinstance(e2e, Histogram) and e2e.count == before[("jaxpaged:e2e_request_latency_seconds", ())].count + 3
    assert e2e.buckets["+Inf"] == e2e.count and list(e2e.buckets.values()) == sorted(e2e.buckets.values())
    assert not any("time_to_first_token" in name for name, _ in after)  # generate sees outputs only at their end
    stats = llm.get_stats()
    gauges = {name: m.value for (name, _), m in after.items() if isinstance(m, Gauge)}
    assert gauges["jaxpaged:kv_blocks_total"] == stats["kv_blocks_total"] and gauges["jaxpaged:num_requests_running"] == 0
    assert after[("jaxpaged:prefix_cache_queries", ())].value == stats["prefix_cache_queries"]


def test_metrics_render_as_prometheus(llm):
    """The server renders the same objects: every series of get_metrics() appears in the text with its value."""
    from prometheus_client import CollectorRegistry, generate_latest

    from jaxpaged.entrypoints.openai.metrics import families

    metrics = llm.get_metrics()

    class Collector:
        def collect(self):
            return families(metrics)

    registry = CollectorRegistry()
    registry.register(Collector())
    text = generate_latest(registry).decode()
    for m in metrics:
        if isinstance(m, Counter):
            labels = "".join(f'{{{k}="{v}"}}' for k, v in m.labels.items())
            assert f"{m.name}_total{labels} {float(m.value)}" in text
        elif isinstance(m, Histogram):
            assert f'{m.name}_bucket{{le="+Inf"}} {float(m.count)}' in text


def test_profile(llm, profiles):
    with pytest.raises(ProfilerError, match="no profile is running"):
        llm.stop_profile()
    with pytest.raises(ValueError, match="profile_prefix"):
        llm.start_profile("../elsewhere")
    llm.start_profile("first")
    with pytest.raises(ProfilerError, match="already running"):
        llm.start_profile()
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    run = llm.stop_profile()
    assert run.startswith(str(profiles / "first" / "plugins" / "profile"))
    assert list((profiles / "first").rglob("*.xplane.pb"))
    with pytest.raises(ProfilerError, match="profiler_dir"):
        Profiler(None).start()


def test_async_engine_and_server_routes(llm, profiles):
    from jaxpaged.engine.async_engine import AsyncLLMEngine
    from jaxpaged.entrypoints.openai import ServerSettings, build_app

    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    closed = build_app(AsyncLLMEngine(llm.engine), ServerSettings(["cycle"]))
    engine = AsyncLLMEngine(llm.engine)
    app = build_app(engine, ServerSettings(["cycle"], enable_dev_endpoints=True))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=closed), base_url="http://t") as client:
            assert (await client.post("/reset_prefix_cache")).status_code == 404  # not without the flag
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            bad = await client.post("/reset_prefix_cache?reset_running_requests=true")
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "reset_running_requests"
            assert llm.get_stats()["kv_blocks_cached"] > 0
            ok = await client.post("/reset_prefix_cache")
            assert ok.status_code == 200 and ok.json() == {"reset": True}
            assert llm.get_stats()["kv_blocks_cached"] == 0
            stream = await engine.add_request("busy", PROMPT, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
            busy = await client.post("/reset_prefix_cache")
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "kv_blocks_in_use"
            engine.abort(stream.request_id)
            async for _ in stream:
                pass
            assert await engine.reset_prefix_cache() is True

            assert (await client.post("/start_profile?profile_prefix=served")).status_code == 200
            again = await client.post("/start_profile")
            assert again.status_code == 409 and "already running" in again.json()["error"]["message"]
            body = {"model": "cycle", "prompt": "ab", "max_tokens": 3, "temperature": 0}
            served = app.state.metrics.metrics.snapshot(engine.get_stats())
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            stopped = await client.post("/stop_profile")
            assert stopped.status_code == 200 and (await client.post("/stop_profile")).status_code == 409
            assert list((profiles / "served").rglob("*.xplane.pb"))
            text = (await client.get("/metrics")).text  # the server's counts, from the same objects
            before = _by_name(served)
            tokens, firsts = before[("jaxpaged:generation_tokens", ())].value, before[("jaxpaged:time_to_first_token_seconds", ())].count
            assert f"jaxpaged:generation_tokens_total {tokens + 3.0}" in text
            assert f"jaxpaged:time_to_first_token_seconds_count {firsts + 1.0}" in text

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert not llm.engine.has_unfinished_requests()

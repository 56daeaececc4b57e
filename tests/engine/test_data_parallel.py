"""Data parallelism on 4 CPU devices: D=4 replicas give D=1's greedy tokens (and transformers'), the router
spreads and balances requests, each replica lives on its own device and gives every KV block back, aborts reach
the right replica, and the OpenAI server serves concurrent requests with --data-parallel-size 2. The in-process
tests share one D=4 engine (D=2 runs in the server test here and as D=2 x P=2 in test_pipeline_parallel.py).

As in tests/models/test_tensor_parallel.py, the device count must be fixed before JAX starts, so in a normal run
the first test re-runs this file in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4 and the
device tests run only there.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import jax
import pytest

from tests.multi_device import needs_devices, rerun_with_devices


def test_dp_suite_on_four_cpu_devices():
    rerun_with_devices(__file__)


def test_bad_data_parallel_size_is_a_value_error():
    from jaxpaged.config import EngineConfig

    for bad in (0, jax.device_count() + 1):
        with pytest.raises(ValueError, match="data_parallel_size"):
            EngineConfig(data_parallel_size=bad)


def test_cli_has_the_flag():
    from jaxpaged.entrypoints.serve import build_parser

    assert build_parser().parse_args(["--data-parallel-size", "4"]).data_parallel_size == 4


# -- below: only with 4 devices ------------------------------------------------------------------

VOCAB = 256
PROMPT_LENGTHS = [3, 11, 29, 40, 5, 17, 8, 23]
MAX_TOKENS = 12
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, block_size=8, attention_backend="reference")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(checkpoint folder, prompts, transformers' greedy tokens)."""
    from tests.hf_reference import hf_greedy, random_hf_model, random_prompts, save_hf_model, tiny_llama_config

    hf = random_hf_model(tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    folder = save_hf_model(hf, tmp_path_factory.mktemp("tiny-llama"))
    prompts = random_prompts(VOCAB, PROMPT_LENGTHS, seed=5)
    return folder, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


_LLMS: dict = {}


def _llm(folder, d):
    """One LLM per data_parallel_size, shared by the tests (start-up compiles every replica's steps)."""
    from jaxpaged import LLM

    if d not in _LLMS:
        _LLMS[d] = LLM(str(folder), data_parallel_size=d, log_level="WARNING", **ENGINE)
    return _LLMS[d]


def _greedy(llm, prompts):
    from jaxpaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_idle(engine):
    """Nothing queued, and every KV block back in each replica's pool."""
    assert not engine.has_unfinished_requests()
    for r, stats in enumerate(engine.get_stats()["replicas"]):
        assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"], f"replica {r}"


@needs_devices
def test_d4_equals_d1_and_transformers(reference):
    from jaxpaged.engine.data_parallel import DataParallelEngine
    from jaxpaged.engine.llm_engine import LLMEngine

    folder, prompts, expected = reference
    single = _llm(folder, 1)
    assert isinstance(single.engine, LLMEngine)
    assert _greedy(single, prompts) == expected
    llm = _llm(folder, 4)
    assert isinstance(llm.engine, DataParallelEngine) and len(llm.engine.replicas) == 4
    assert _greedy(llm, prompts) == expected, "data_parallel_size=4 differs"
    stats = llm.get_stats()
    assert stats["num_compiles_after_warmup"] == 0
    # every replica computed its share of the 8 prompts
    assert all(s["num_computed_tokens"] > 0 for s in stats["replicas"]), stats["replicas"]
    assert stats["num_computed_tokens"] == sum(s["num_computed_tokens"] for s in stats["replicas"])
    _assert_idle(llm.engine)


@needs_devices
def test_beam_search_runs_within_a_replica(reference):
    from jaxpaged.engine.beam_search import BeamSearchParams

    folder, prompts, _ = reference
    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    beams = lambda llm: [[s.output_token_ids for s in o.sequences] for o in llm.beam_search(  # noqa: E731
        [{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)]  # fmt: skip
    llm = _llm(folder, 4)
    assert beams(llm) == beams(_llm(folder, 1))
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    _assert_idle(llm.engine)


@needs_devices
def test_reset_prefix_cache_resets_every_replica_or_none(reference):
    from jaxpaged import SamplingParams

    folder, prompts, _ = reference
    llm = _llm(folder, 4)
    _greedy(llm, prompts)  # every replica caches some prompt blocks
    assert all(s["kv_blocks_cached"] > 0 for s in llm.get_stats()["replicas"])
    engine = llm.engine
    engine.add_request("held", {"prompt_token_ids": prompts[2]}, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    cached = [s["kv_blocks_cached"] for s in llm.get_stats()["replicas"]]
    assert llm.reset_prefix_cache() is False  # one replica's sequence holds blocks: neither replica forgets
    assert [s["kv_blocks_cached"] for s in llm.get_stats()["replicas"]] == cached
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache() is True
    assert all(s["kv_blocks_cached"] == 0 for s in llm.get_stats()["replicas"])
    _assert_idle(engine)


@needs_devices
def test_each_replica_lives_on_its_own_device(reference):
    engine = _llm(reference[0], 4).engine
    for r, replica in enumerate(engine.replicas):
        want = {jax.devices()[r]}
        assert all(leaf.devices() == want for leaf in jax.tree.leaves(replica.runner.state)), f"replica {r} weights"
        assert all(leaf.devices() == want for leaf in jax.tree.leaves(replica.runner.kv_cache)), f"replica {r} KV"
    assert len({id(r.runner.kv_cache) for r in engine.replicas}) == 4
    assert engine.replicas[0].loaded is engine.replicas[3].loaded  # read from disk once


@needs_devices
def test_router_balances_equal_requests(reference):
    from jaxpaged import SamplingParams

    folder, prompts, expected = reference
    engine = _llm(folder, 4).engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(None, {"prompt_token_ids": prompts[0]}, params) for _ in range(8)]
    assert len(set(ids)) == 8
    placed = [engine.replica_of(rid) for rid in ids]
    assert sorted(placed) == [0, 0, 1, 1, 2, 2, 3, 3], placed
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(ids[5], {"prompt_token_ids": prompts[0]}, params)  # unique across replicas
    done = {}
    while engine.has_unfinished_requests():
        done |= {out.request_id: out.outputs[0].token_ids for out in engine.step() if out.finished}
    assert done == {rid: expected[0] for rid in ids}
    assert engine.get_stats()["num_compiles_after_warmup"] == 0
    _assert_idle(engine)


@needs_devices
def test_abort_frees_the_blocks_on_its_replica(reference):
    from jaxpaged import SamplingParams

    folder, prompts, _ = reference
    engine = _llm(folder, 4).engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = engine.add_request(None, {"prompt_token_ids": prompts[3]}, params)
    second = engine.add_request(None, {"prompt_token_ids": prompts[2]}, params)
    assert (engine.replica_of(first), engine.replica_of(second)) == (0, 1)
    for _ in range(3):
        engine.step()
    assert engine.get_stats()["replicas"][1]["kv_blocks_used"] > 0
    out = engine.abort_request_with_output(second)
    assert out is not None and out.finished and not engine.has_request(second)
    assert engine.get_stats()["replicas"][1]["kv_blocks_used"] == 0
    assert not engine.abort_request(second)  # gone
    while engine.has_unfinished_requests():
        engine.step()
    _assert_idle(engine)


@needs_devices
def test_openai_server_with_two_replicas(tmp_path):
    import httpx

    from tests.cycle_model import greedy_text, write_cycle_model
    from tests.server_harness import ServerProcess

    folder = write_cycle_model(tmp_path / "cycle", max_position_embeddings=128)
    args = ["--model", str(folder), "--data-parallel-size", "2", "--max-num-seqs", "4", "--max-num-batched-tokens", "8",
            "--block-size", "8", "--num-kv-blocks", "64", "--dtype", "float32", "--log-level", "INFO"]  # fmt: skip
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        assert "data parallel: 2 replicas on [cpu:0], [cpu:1]" in server.log()

        def complete(last: int):
            body = {"model": str(folder), "prompt": [5, 9, last], "max_tokens": 9, "temperature": 0.0}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        lasts = [97, 98, 32, 7, 105, 200, 11, 98]
        with ThreadPoolExecutor(len(lasts)) as pool:
            texts = list(pool.map(complete, lasts))
        assert texts == [greedy_text(last, 9) for last in lasts]  # what one engine answers (tests/entrypoints)
        metrics = server.wait_metrics(lambda m: m["jaxpaged:kv_blocks_used"] == 0)
        assert metrics["jaxpaged:kv_blocks_total"] == 2 * 64 and metrics["jaxpaged:kv_blocks_used"] == 0
    finally:
        server.stop()

"""The engine on a tiny random Llama: continuous batching, preemption, chunked prefill, no recompiles, seeds."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.platforms.cpu.platform import available_host_memory
from tests.hf_reference import hf_greedy, random_prompts

VOCAB = 256


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", max_num_seqs=16, max_num_batched_tokens=128, block_size=8, log_level="WARNING")


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def mixed_workload(hf_model):
    rng = np.random.default_rng(11)
    lengths = rng.integers(1, 60, size=32).tolist()
    prompts = random_prompts(VOCAB, lengths, seed=12)
    max_tokens = rng.integers(8, 40, size=32).tolist()
    expected = [hf_greedy(hf_model, p, m) for p, m in zip(prompts, max_tokens)]
    return prompts, max_tokens, expected


def _run(llm: LLM, prompts, max_tokens) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], [_greedy(m) for m in max_tokens], use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outs]


def _assert_all_blocks_back(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_32_mixed_prompts_match_transformers_one_at_a_time(llm, mixed_workload):
    prompts, max_tokens, expected = mixed_workload
    assert _run(llm, prompts, max_tokens) == expected
    _assert_all_blocks_back(llm)


def test_identical_under_forced_preemption(model_dir, mixed_workload):
    prompts, max_tokens, expected = mixed_workload
    tiny_pool = LLM(model_dir, dtype="float32", max_num_seqs=16, max_num_batched_tokens=128, block_size=8,
                    num_kv_blocks=24, log_level="WARNING")
    assert _run(tiny_pool, prompts, max_tokens) == expected
    assert tiny_pool.get_stats()["num_preemptions"] > 0
    _assert_all_blocks_back(tiny_pool)


def test_identical_under_forced_chunked_prefill(model_dir, mixed_workload):
    prompts, max_tokens, expected = mixed_workload
    chunked = LLM(model_dir, dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, block_size=8, log_level="WARNING")
    engine = chunked.engine
    chunks = []
    original = engine.scheduler.schedule

    def spy():
        out = original()
        chunks.extend(s.num_tokens for s in out.scheduled if not s.samples)
        return out

    engine.scheduler.schedule = spy
    assert _run(chunked, prompts, max_tokens) == expected
    assert chunks, "no prompt was split into chunks"
    _assert_all_blocks_back(chunked)


def test_short_request_overtakes_long_one(llm):
    """Batching happens per iteration: a late short request finishes while a long one keeps running."""
    engine = llm.engine
    engine.add_request("long", {"prompt_token_ids": [5, 6, 7]}, _greedy(120))
    for _ in range(5):
        engine.step()
    engine.add_request("short", {"prompt_token_ids": [9, 10]}, _greedy(4))
    long_tokens_before = len(engine.output_processor.parents["long"].sequences[0].output_token_ids)
    finished_first = None
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        for out in outs:
            if out.finished and finished_first is None:
                finished_first = out.request_id
        if finished_first == "short":
            long_now = len(engine.output_processor.parents["long"].sequences[0].output_token_ids)
            assert long_now == long_tokens_before + steps  # the long one advanced every single step
            break
    assert finished_first == "short"
    engine.abort_request("long")
    _assert_all_blocks_back(llm)


def test_no_compiles_after_warmup_across_200_random_requests(llm):
    rng = np.random.default_rng(5)
    prompts, params = [], []
    for i in range(200):
        prompts.append({"prompt_token_ids": rng.integers(0, VOCAB, size=int(rng.integers(1, 100))).tolist()})
        params.append(
            SamplingParams(
                n=int(rng.integers(1, 4)),
                temperature=float(rng.choice([0.0, 0.7, 1.3])),
                top_k=int(rng.choice([0, 5, 50])),
                top_p=float(rng.choice([1.0, 0.9, 0.5])),
                min_p=float(rng.choice([0.0, 0.1])),
                presence_penalty=float(rng.choice([0.0, 0.5])),
                frequency_penalty=float(rng.choice([0.0, -0.3])),
                repetition_penalty=float(rng.choice([1.0, 1.2])),
                seed=int(rng.integers(0, 1000)) if i % 3 == 0 else None,
                logprobs=int(rng.choice([0, 3, 20])) if i % 4 == 0 else None,
                min_tokens=int(rng.integers(0, 3)),
                max_tokens=int(rng.integers(1, 40)),
                stop_token_ids=[int(rng.integers(0, VOCAB))] if i % 5 == 0 else None,
            )
        )
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 200 and all(o.finished for o in outs)
    for out, p in zip(outs, params):
        assert len(out.outputs) == p.n
        for completion in out.outputs:
            assert 1 <= len(completion.token_ids) <= p.max_tokens
            if p.logprobs is not None:
                assert len(completion.logprobs) == len(completion.token_ids)
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    _assert_all_blocks_back(llm)


def test_seeds_reproduce_alone_and_inside_a_batch(llm):
    prompt = {"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(VOCAB, np.random.default_rng(2).integers(1, 50, size=32).tolist(), seed=3)
    batch = [{"prompt_token_ids": p} for p in others[:16]] + [prompt] + [{"prompt_token_ids": p} for p in others[16:]]
    params = [SamplingParams(temperature=0.9, max_tokens=20)] * 16 + [seeded] + [SamplingParams(temperature=1.1, max_tokens=12)] * 16
    inside = llm.generate(batch, params, use_tqdm=False)[16].outputs[0].token_ids
    assert inside == alone
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=24, ignore_eos=True)
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_samples_differ_and_logprobs_are_reported(llm):
    out = llm.generate(
        [{"prompt_token_ids": [7, 8, 9]}],
        SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True, logprobs=5),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        for token, entry in zip(c.token_ids, c.logprobs):
            assert token in entry and 5 <= len(entry) <= 6
            assert all(lp.logprob <= 0.0 for lp in entry.values())
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)), rel=1e-5)


def test_too_long_requests_are_refused_and_serving_continues(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [1] * 250}], _greedy(10), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [1] * 300}], _greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [VOCAB + 5]}], _greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], _greedy(1), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], _greedy(5), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    _assert_all_blocks_back(llm)


def test_request_that_cannot_fit_in_the_pool_is_refused(model_dir):
    small = LLM(model_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, block_size=8, num_kv_blocks=4,
                log_level="WARNING")
    with pytest.raises(ValueError, match="num_kv_blocks"):
        small.generate([{"prompt_token_ids": [1] * 20}], _greedy(20), use_tqdm=False)
    assert small.generate([{"prompt_token_ids": [1] * 10}], _greedy(10), use_tqdm=False)[0].finished


def test_abort_returns_blocks(llm):
    engine = llm.engine
    engine.add_request("x", {"prompt_token_ids": list(range(1, 40))}, _greedy(50))
    engine.step()
    engine.step()
    assert llm.get_stats()["kv_blocks_free"] < llm.get_stats()["kv_blocks_total"]
    assert engine.abort_request("x")
    _assert_all_blocks_back(llm)


def test_pool_size_from_blocks_or_memory(model_dir):
    kw = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=8, log_level="WARNING")
    explicit = LLM(model_dir, num_kv_blocks=10, **kw)
    assert explicit.get_stats()["kv_blocks_total"] == 10
    default = LLM(model_dir, **kw)  # on CPU: enough for every sequence at full length, within 2 GiB
    assert default.get_stats()["kv_blocks_total"] == 4 * (256 // 8)
    runner = default.engine.runner
    fraction = LLM(model_dir, kv_cache_memory_fraction=1e-6, **kw)  # a fraction of free RAM, capped the same way
    free = available_host_memory()
    expected = max(1, min(int(1e-6 * free) // runner.block_bytes, 4 * (256 // 8)))
    assert abs(fraction.get_stats()["kv_blocks_total"] - expected) <= 2  # free RAM moves a little in between


def test_host_memory_counts_the_page_cache_the_kernel_can_drop(tmp_path):
    """A host whose RAM is mostly page cache has little free but much available: the pool sizing and the memory
    check read what is available (once they read free pages and refused a 0.5 GB model on a 24 GB machine)."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:          300000 kB\nMemAvailable:   20000000 kB\n")
    assert available_host_memory(str(meminfo)) == 20000000 * 1024
    import os

    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert abs(available_host_memory(str(tmp_path / "missing")) - free) < 0.1 * free  # elsewhere: free pages


def test_pallas_kernel_backend_gives_the_same_greedy_tokens(model_dir, mixed_workload):
    """The kernel (interpret mode on CPU) through the whole engine: same tokens as transformers and the reference."""
    prompts, max_tokens, expected = mixed_workload
    kernel = LLM(model_dir, dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, block_size=8,
                 attention_backend="pallas", log_level="WARNING")  # fmt: skip
    assert kernel.engine.loaded.model.layers[0].self_attn.backend.name == "pallas"
    assert _run(kernel, prompts[:12], max_tokens[:12]) == expected[:12]
    assert kernel.get_stats()["num_compiles_after_warmup"] == 0
    _assert_all_blocks_back(kernel)


@pytest.mark.parametrize("max_tokens,max_seqs", [(256, 64), (2048, 256), (32, 8), (128, 32), (100, 64), (8, 8)])
def test_token_buckets_are_fine_in_the_decode_range_and_end_at_the_budget(max_tokens, max_seqs):
    from jaxpaged.worker.bucket_compiles import token_buckets

    buckets = token_buckets(max_tokens, max_seqs)
    assert buckets[-1] == max_tokens and buckets == sorted(set(buckets))
    assert buckets[0] == min(4, max_tokens)
    decode = [b for b in buckets if b <= max_seqs]
    if buckets[0] <= max_seqs <= max_tokens:
        assert max_seqs in buckets  # a full decode batch pads nothing
    for small, big in zip(decode, decode[1:]):
        assert big % 4 == 0 and big <= 2 * small
        if small >= 16:  # a shrinking decode batch of 16 rows or more never pads by more than a third
            assert big % 8 == 0 and big <= 1.5 * small
    above = [b for b in buckets if b > max_seqs]
    for small, big in zip(above, above[1:]):
        assert big <= 2 * small

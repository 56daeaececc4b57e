"""Pipeline parallelism on 4 CPU devices: P=2, P=4 and P=2 x T=2 give P=1's greedy tokens (and transformers'),
each stage holds its layers' weights and KV cache on its own devices, and nothing compiles after warm-up.

As in test_tensor_parallel.py, the first test re-runs this file in a subprocess with 4 CPU devices; the device
tests run only there. split_step, which cuts a step into micro-batches, is checked here on the host.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.multi_device import needs_devices, reference_family, rerun_with_devices

VOCAB = 256
PROMPT_LENGTHS = [3, 11, 29, 40]  # with 8-token steps: chunked prefills cut across micro-batches
MAX_TOKENS = 16


def test_pp_suite_on_four_cpu_devices():
    rerun_with_devices(__file__)


def test_split_step_gives_each_micro_batch_the_metadata_of_its_own_step():
    """Two sequences of 3 and 6 rows in a 12-row step cut into 3 chunks of 4: the second sequence's rows 1..4 and
    5 continue in later chunks, their seq_len ending at the chunk's last row."""
    from jaxpaged.pallas_kernels import AttentionMetadata
    from jaxpaged.worker.input_batch import StepInputs
    from jaxpaged.worker.pipeline_runner import split_step

    qsl = np.array([0, 3, 9, 9], np.int32)  # 3 slots, the last padding
    md = AttentionMetadata(
        slot_mapping=np.r_[np.arange(10, 13), np.arange(40, 46), [-1, -1, -1]].astype(np.int32),
        block_tables=np.array([[1, 0], [5, 6], [0, 0]], np.int32),
        seq_lens=np.array([8, 6, 0], np.int32),  # the first has 5 tokens cached, the second none
        query_start_loc=qsl,
    )
    step = StepInputs(np.arange(12, dtype=np.int32), np.r_[5:8, 0:6, 0, 0, 0].astype(np.int32), md,
                      np.array([2, 8, 8], np.int32), None, None, np.r_[[-1, -1, 0], np.full(9, -1)].astype(np.int32))  # fmt: skip
    chunks = split_step(step, 3, 4, 4)
    assert [list(c.input_ids) for c in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    first, second, third = (c.attention for c in chunks)
    assert list(first.query_start_loc) == [0, 3, 4, 4, 4] and list(first.seq_lens) == [8, 1, 0, 0]
    assert first.block_tables[:2].tolist() == [[1, 0], [5, 6]]
    assert list(second.query_start_loc) == [0, 4, 4, 4, 4] and list(second.seq_lens) == [5, 0, 0, 0]
    assert second.block_tables[0].tolist() == [5, 6]
    assert list(third.query_start_loc) == [0, 1, 1, 1, 1] and list(third.seq_lens) == [6, 0, 0, 0]
    assert list(third.slot_mapping) == [45, -1, -1, -1]
    assert list(chunks[0].prev_rows) == [-1, -1, 0, -1]


def test_more_stages_than_layers_is_a_value_error():
    from jaxpaged.worker.pipeline_runner import stage_bounds

    assert stage_bounds(6, 4) == [(0, 1), (1, 3), (3, 4), (4, 6)]
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 exceeds the model's 2 layers"):
        stage_bounds(2, 4)


# -- below: only with 4 devices ------------------------------------------------------------------


def _families():
    import transformers

    from tests.hf_reference import tiny_llama_config

    return {
        "llama": tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_hidden_layers=4),
        # learned positions in the embedding, a tied head read out by the last stage
        "gpt2": transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=256, bos_token_id=0,
                                        eos_token_id=1, tie_word_embeddings=True),  # fmt: skip
    }


_PREPARED: dict = {}


def _prepare(name, tmp_path_factory):
    """(name, checkpoint folder, prompts, transformers' greedy tokens), once per family."""
    return name, *reference_family(_PREPARED, name, _families()[name], tmp_path_factory, PROMPT_LENGTHS, MAX_TOKENS)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def family(request, tmp_path_factory):
    return _prepare(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _prepare("llama", tmp_path_factory)


def _llm(folder, **kw):
    from jaxpaged import LLM

    kw = {"attention_backend": "reference", **kw}
    return LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, block_size=8, log_level="WARNING", **kw)


def _greedy(llm, prompts, **params):
    from jaxpaged import SamplingParams

    params = SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **params})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@needs_devices
def test_stages_give_one_stage_and_transformers_tokens(family):
    """P=2 (GPT-2), P=4 and P=2 x T=2 (Llama); Llama at P=2 gives transformers' tokens in the native-kernel and
    data-parallel tests below, and its prompt logprobs and samples equal P=1's."""
    name, folder, prompts, expected = family
    sizes = [(4, 1), (2, 2)] if name == "llama" else [(2, 1)]
    for p, t in sizes:
        llm = _llm(folder, pipeline_parallel_size=p, tensor_parallel_size=t)
        got = [list(o.outputs[0].token_ids) for o in _greedy(llm, prompts)]
        assert got == expected, f"pipeline_parallel_size={p} x tensor_parallel_size={t} differs"
        assert llm.get_stats()["num_compiles_after_warmup"] == 0
        _assert_stages_placed(llm.engine.runner, p, t)
        assert llm.engine.scheduler.kv.pool.num_used == 0  # every block came back


def _assert_stages_placed(runner, p, t):
    """Stage s: its layers' weights and a KV array of its layers only, on devices s*t .. s*t + t - 1."""
    devices = jax.devices()
    layers = runner.model_config.num_layers
    assert sum(kv.shape[0] for kv in runner.kv_cache) == layers
    for s, (a, b) in enumerate(runner.bounds):
        mine = set(devices[s * t : (s + 1) * t])
        assert runner.kv_cache[s].shape[0] == b - a and runner.kv_cache[s].devices() == mine
        assert all(leaf.devices() == mine for leaf in runner.stage_leaves[s])


@needs_devices
def test_prompt_logprobs_sampling_and_prefix_sharing_match_one_stage(llama):
    """Prompt logprobs (every row's logits, joined from the micro-batches), seeded sampling with n=2 (forked
    blocks copied in every stage) and a shared prefix give P=1's results; every block comes back."""
    from jaxpaged import SamplingParams

    _, folder, prompts, _ = llama
    shared = prompts[3][:24]
    batch = [{"prompt_token_ids": shared + p[:5]} for p in prompts]
    params = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=8, prompt_logprobs=1, logprobs=2)
    results = []
    for p in (1, 2):
        llm = _llm(folder, pipeline_parallel_size=p)
        outs = llm.generate(batch, params, use_tqdm=False)
        results.append(outs)
        assert llm.engine.scheduler.kv.pool.num_used == 0
    for one, two in zip(*results, strict=True):
        assert [c.token_ids for c in one.outputs] == [c.token_ids for c in two.outputs]
        ids = one.prompt_token_ids[1:]
        lp1 = [d[t].logprob for d, t in zip(one.prompt_logprobs[1:], ids, strict=True)]
        lp2 = [d[t].logprob for d, t in zip(two.prompt_logprobs[1:], ids, strict=True)]
        np.testing.assert_allclose(lp1, lp2, atol=1e-4)


@needs_devices
def test_native_cpu_attention_runs_in_each_stage(llama):
    _, folder, prompts, expected = llama
    from jaxpaged.platforms.cpu import attention as cpu_attention

    if not cpu_attention.available():
        pytest.skip("the native CPU kernel could not be built here")
    llm = _llm(folder, pipeline_parallel_size=2, attention_backend="native")
    assert [list(o.outputs[0].token_ids) for o in _greedy(llm, prompts)] == expected
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_start_up_says_how_many_devices_the_model_needs_and_refuses_too_few(tmp_path, monkeypatch, caplog):
    """With devices of 0.2 MB (a GPU's memory, as the platform reports it), a model of about 0.3 MB of weights and
    KV is refused before the KV pool is allocated, naming the device count that would hold it."""
    import logging

    from jaxpaged import LLM
    from jaxpaged.platforms.cpu.platform import CpuPlatform
    from tests.hf_reference import random_hf_model, save_hf_model, tiny_llama_config

    folder = save_hf_model(random_hf_model(tiny_llama_config(max_position_embeddings=256)), tmp_path / "m")
    monkeypatch.setattr(CpuPlatform, "device_memory", lambda self, device: (200_000, False))
    caplog.set_level(logging.INFO, logger="jaxpaged.runner")
    with pytest.raises(ValueError, match=r"tensor_parallel_size x pipeline_parallel_size must reach \d+ devices"):
        LLM(str(folder), dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, log_level="INFO")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory: weights"))
    needed = int(line.split("needs ")[1].split(" device")[0])
    assert needed >= 2 and "this engine spans 1" in line


def test_batch_invariance_with_stages_is_refused():
    from jaxpaged.config import EngineConfig

    with pytest.raises(ValueError, match="batch_invariant needs pipeline_parallel_size 1"):
        EngineConfig(model="unused", batch_invariant=True, pipeline_parallel_size=2)


@needs_devices
def test_data_parallel_replicas_of_two_stages(llama):
    """D=2 x P=2 on 4 devices: each replica's two stages on its own two devices, transformers' tokens."""
    _, folder, prompts, expected = llama
    llm = _llm(folder, pipeline_parallel_size=2, data_parallel_size=2)
    assert [list(o.outputs[0].token_ids) for o in _greedy(llm, prompts)] == expected
    devices = jax.devices()
    for r, replica in enumerate(llm.engine.replicas):
        assert [kv.devices() for kv in replica.runner.kv_cache] == [{devices[2 * r]}, {devices[2 * r + 1]}]
    assert llm.get_stats()["num_compiles_after_warmup"] == 0

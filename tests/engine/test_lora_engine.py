"""LoRA through the engine: three PEFT adapters and the base model mixed in continuous batches over two device slots
(so adapters wait, get evicted and come back), each request's greedy tokens those of transformers + PEFT alone;
nothing compiles after warm-up; prefixes cached under one adapter never serve another; bad adapters are refused
while the engine keeps serving."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from jaxpaged import LLM, LoRARequest, SamplingParams
from jaxpaged.models.lora import LoRALinear

from tests.hf_reference import hf_greedy, random_prompts
from tests.models.test_lora import write_peft_adapter

pytest.importorskip("peft")

ADAPTERS = {"alpha": (4, 8, ["q_proj", "v_proj"], False), "beta": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj",
            "gate_proj", "up_proj", "down_proj"], False), "gamma": (6, 12, ["o_proj", "down_proj"], True)}  # fmt: skip
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory):
    """name -> (LoRARequest, the PEFT model for reference)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        ref = write_peft_adapter(hf_model, root / name, rank, alpha, targets, rslora, seed=20 + i)
        out[name] = (LoRARequest(name, i + 1, str(root / name)), ref)
    return out


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2,
               max_num_seqs=8, max_num_batched_tokens=32, block_size=8, log_level="WARNING")  # fmt: skip


def _greedy(max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _assert_idle(llm):
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_compiles_after_warmup"] == 0


def test_mixed_adapters_match_peft_alone(llm, hf_model, adapters):
    """Three adapters over two slots and the base, interleaved: each request gets what PEFT gives it alone."""
    names = ["alpha", None, "beta", "gamma", "alpha", None, "gamma", "beta", "beta", "alpha"]
    prompts = random_prompts(256, [5, 11, 3, 17, 9, 6, 14, 4, 20, 8], seed=5)
    loras = [None if n is None else adapters[n][0] for n in names]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False, lora_request=loras)
    for name, prompt, out in zip(names, prompts, outs):
        ref = hf_model if name is None else adapters[name][1]
        assert list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, MAX_TOKENS), name
    _assert_idle(llm)


def test_one_adapter_for_every_prompt(llm, adapters):
    request, ref = adapters["gamma"]
    prompts = random_prompts(256, [4, 7], seed=6)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False, lora_request=request)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(ref, p, MAX_TOKENS) for p in prompts]
    _assert_idle(llm)


def test_prefix_cached_under_an_adapter_serves_it_alone(llm, hf_model, adapters):
    """The same 3-block prompt under alpha, then the base, then beta, then alpha again: only the last finds it cached."""
    prompt = random_prompts(256, [25], seed=8)[0]
    order = ["alpha", None, "beta", "alpha"]
    cached = []
    for name in order:
        lora = None if name is None else adapters[name][0]
        out = llm.generate([{"prompt_token_ids": prompt}], _greedy(), use_tqdm=False, lora_request=lora)[0]
        ref = hf_model if name is None else adapters[name][1]
        assert list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, MAX_TOKENS), name
        cached.append(out.num_cached_tokens)
    assert cached[:3] == [0, 0, 0] and cached[3] >= 16
    _assert_idle(llm)


def test_bad_adapter_is_refused_and_the_engine_keeps_serving(llm, adapters, tmp_path):
    (tmp_path / "empty").mkdir()
    good, ref = adapters["alpha"]
    prompt = random_prompts(256, [6], seed=9)[0]
    bad = [LoRARequest("empty", 9, str(tmp_path / "empty")), LoRARequest("gone", 10, str(tmp_path / "gone")),
           LoRARequest("clash", good.lora_int_id, str(tmp_path / "empty"))]  # fmt: skip
    for request in bad:
        with pytest.raises(ValueError, match="lora_path|lora_int_id"):
            llm.generate([{"prompt_token_ids": prompt}] * 2, _greedy(), use_tqdm=False, lora_request=[good, request])
        _assert_idle(llm)
    out = llm.generate([{"prompt_token_ids": prompt}], _greedy(), use_tqdm=False, lora_request=good)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, MAX_TOKENS)
    with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
        llm.generate([{"prompt_token_ids": prompt}] * 2, _greedy(), use_tqdm=False, lora_request=[good])
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "somewhere")


def test_adapter_given_as_a_hub_id_loads_from_the_hf_cache(llm, adapters, tmp_path, monkeypatch):
    """lora_path "org/alpha-adapter", offline, found in a Hugging Face cache folder (huggingface_hub's layout, as
    tests/models/test_hub.py fakes it): the same tokens as the adapter's local folder; an id the cache lacks is refused."""
    import shutil

    from huggingface_hub import constants

    local, ref = adapters["alpha"]
    repo = tmp_path / "hub" / "models--org--alpha-adapter"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("c" * 40)
    shutil.copytree(local.lora_path, repo / "snapshots" / ("c" * 40))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    prompt = random_prompts(256, [7], seed=12)[0]
    hub = LoRARequest("alpha-hub", 11, "org/alpha-adapter")
    out = llm.generate([{"prompt_token_ids": prompt}], _greedy(), use_tqdm=False, lora_request=hub)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, MAX_TOKENS)
    with pytest.raises(ValueError, match="org/absent-adapter"):
        llm.generate([{"prompt_token_ids": prompt}], _greedy(), use_tqdm=False, lora_request=LoRARequest("absent", 12, "org/absent-adapter"))
    llm.engine.remove_lora(hub.lora_int_id)
    _assert_idle(llm)


def test_n_samples_and_abort_give_slots_back(llm, adapters):
    request, _ = adapters["beta"]
    engine = llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}], params, use_tqdm=False, lora_request=request)
    assert len(outs[0].outputs) == 3
    ids = [engine.add_request(None, {"prompt_token_ids": [3, 4, 5]}, _greedy(), lora_request=adapters[n][0])
           for n in ("alpha", "beta", "gamma")]  # fmt: skip  # gamma waits: two slots
    assert engine.has_unfinished_requests()
    for rid in ids:
        engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert engine.lora.stats()["lora_slots_held"] == 0
    _assert_idle(llm)


def test_without_enable_lora_the_step_is_unchanged(model_dir, adapters):
    """enable_lora off: no wrapped projection, no extra operand, and a lora_request is refused."""
    plain = LLM(model_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, precompile=False, log_level="WARNING")
    runner = plain.engine.runner
    assert runner.lora_weights is None
    assert not any(isinstance(getattr(m, "method", None), LoRALinear) for _, m in nnx.iter_modules(nnx.merge(runner.graphdef, runner.state)))
    assert len(runner._forward_args(runner.input_batch.blank(4), None)) == 4
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([{"prompt_token_ids": [1, 2]}], _greedy(), use_tqdm=False, lora_request=adapters["alpha"][0])


def test_async_generate_takes_lora_request(llm, hf_model, adapters):
    """AsyncLLMEngine.generate(prompt, params, request_id, lora_request=...) as vLLM's AsyncLLM: three adapters over two
    slots and the base, concurrently, each equal to transformers + PEFT alone; the slots given back."""
    import asyncio

    from jaxpaged.engine.async_engine import AsyncLLMEngine

    names = ["alpha", "beta", None, "gamma", "alpha"]
    prompts = random_prompts(256, [5, 9, 4, 12, 7], seed=13)
    engine = AsyncLLMEngine(llm.engine)

    async def one(i, name):
        lora = None if name is None else adapters[name][0]
        outs = [out async for out in engine.generate({"prompt_token_ids": prompts[i]}, _greedy(), f"async-lora-{i}", lora_request=lora)]
        return outs[-1]

    async def main():
        return await asyncio.gather(*(one(i, name) for i, name in enumerate(names)))

    try:
        finals = asyncio.run(main())
    finally:
        engine.shutdown()
    for name, prompt, out in zip(names, prompts, finals):
        ref = hf_model if name is None else adapters[name][1]
        assert out.finished and list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, MAX_TOKENS), name
    assert llm.engine.lora.stats()["lora_slots_held"] == 0
    _assert_idle(llm)


def test_an_id_on_the_device_but_evicted_from_host_memory_still_names_its_adapter(llm, adapters):
    """alpha runs (its slot held) while two other adapters push it out of host memory (max_cpu_loras=2): another
    adapter under alpha's id is refused, as it is while alpha is in host memory, instead of running on alpha's slot."""
    engine = llm.engine
    alpha = adapters["alpha"][0]
    rid = engine.add_request(None, {"prompt_token_ids": [3, 4, 5]}, _greedy(20), lora_request=alpha)
    engine.step()
    engine.add_lora(adapters["beta"][0])
    engine.add_lora(adapters["gamma"][0])
    assert alpha.lora_int_id not in [r.lora_int_id for r in engine.list_loras()]  # evicted from the host, on the device
    impostor = LoRARequest("impostor", alpha.lora_int_id, adapters["beta"][0].lora_path)
    with pytest.raises(ValueError, match="already names adapter 'alpha'"):
        engine.add_request(None, {"prompt_token_ids": [3, 4]}, _greedy(), lora_request=impostor)
    engine.abort_request(rid)
    assert engine.lora.stats()["lora_slots_held"] == 0
    _assert_idle(llm)


def test_updated_adapter_survives_host_and_slot_eviction(llm, hf_model, adapters):
    """update_weights(lora_request=alpha) with alpha's lora_B all zeros makes alpha the base model; two other adapters
    then take both slots and the host memory (max_cpu_loras=2): alpha comes back updated, not read again from its
    folder (which gave PEFT's alpha)."""
    alpha, peft_alpha = adapters["alpha"]
    zeros = {name: np.zeros(tuple(t.shape), np.float32) for name, t in peft_alpha.state_dict().items() if "lora_B" in name}
    assert zeros
    prompt = random_prompts(256, [6], seed=17)[0]
    try:
        llm.update_weights(zeros, lora_request=alpha)
        others = [adapters["beta"][0], adapters["gamma"][0]]
        llm.generate([{"prompt_token_ids": prompt}] * 2, _greedy(), use_tqdm=False, lora_request=others)  # both slots
        assert alpha.lora_int_id not in llm.engine.lora._slot_ids
        out = llm.generate([{"prompt_token_ids": prompt}], _greedy(), use_tqdm=False, lora_request=alpha)[0]
        assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, prompt, MAX_TOKENS)
        _assert_idle(llm)
    finally:
        llm.engine.remove_lora(alpha.lora_int_id)  # the next use reads it from its folder again


def test_a_waiting_requests_adapter_removed_and_deleted_aborts_it_alone(model_dir, hf_model, tmp_path):
    """One device slot: B waits for A's adapter to let go; meanwhile B's adapter is removed and its folder deleted.
    When B's turn comes the adapter cannot be read again: B ends aborted, A finishes as PEFT's, and the engine
    (here stepped as the async engine steps it) keeps serving with every block and slot back."""
    import shutil

    from jaxpaged.sampling_params import SamplingParams as SP

    a_ref = write_peft_adapter(hf_model, tmp_path / "a", 4, 8, ["q_proj", "v_proj"], False, seed=31)
    write_peft_adapter(hf_model, tmp_path / "b", 4, 8, ["q_proj", "v_proj"], False, seed=32)
    llm = LLM(model_dir, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1,
              max_num_seqs=4, max_num_batched_tokens=32, block_size=8, log_level="WARNING")  # fmt: skip
    engine = llm.engine
    a, b = LoRARequest("a", 1, str(tmp_path / "a")), LoRARequest("b", 2, str(tmp_path / "b"))
    prompt = random_prompts(256, [7], seed=3)[0]
    engine.add_request("A", {"prompt_token_ids": prompt}, SP(temperature=0.0, max_tokens=6, ignore_eos=True), lora_request=a)
    engine.add_request("B", {"prompt_token_ids": prompt}, SP(temperature=0.0, max_tokens=6, ignore_eos=True), lora_request=b)
    llm.engine.remove_lora(2)
    shutil.rmtree(tmp_path / "b")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert list(finals["A"].outputs[0].token_ids) == hf_greedy(a_ref, prompt, 6)
    assert finals["B"].outputs[0].finish_reason == "abort" and list(finals["B"].outputs[0].token_ids) == []
    _assert_idle(llm)
    out = llm.generate([{"prompt_token_ids": prompt}], _greedy(6), use_tqdm=False, lora_request=a)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(a_ref, prompt, 6)

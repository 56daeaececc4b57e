"""update_weights (issue 47): a running engine's weights replaced in place from arrays on the device (by HF name, by
the port's parameter paths, through a trainer's mapping, some or all of them), or from a folder of safetensors;
greedy tokens then those of transformers with the new weights, nothing compiled by the steps, the prefix cache
dropped, requests in flight finished or aborted as asked, bad updates refused whole with the weights unchanged; the
CPU platform's layouts (packed panels, a tied 16-bit head's transposed copy, int8 weights) rebuilt on the device."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.weight_sync import ABORT_REASON
from jaxpaged.models.loader import load_model
from jaxpaged.utils import compile_monitor

from tests.hf_reference import hf_greedy, random_hf_model, random_prompts, save_hf_model, tiny_llama_config

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, block_size=8, num_kv_blocks=64, log_level="WARNING")
MAX_TOKENS = 6


def _greedy(max_tokens=MAX_TOKENS, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _tokens(llm, prompts, **kw):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(**kw), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def hf_arrays(model) -> dict[str, jax.Array]:
    """A transformers model's state dict as arrays on the device, by HF name (what a trainer would hold)."""
    return {name: jnp.asarray(t.detach().numpy()) for name, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def hf_model_b(hf_model):
    return random_hf_model(hf_model.config, seed=7)


@pytest.fixture(scope="module")
def model_dir_b(hf_model_b, tmp_path_factory):
    return str(save_hf_model(hf_model_b, tmp_path_factory.mktemp("tiny-llama-b")))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", **ENGINE)


@pytest.fixture
def restore(llm, hf_model):
    """Each test leaves the shared engine with the first model's weights."""
    yield
    llm.update_weights(hf_arrays(hf_model))


PROMPTS = random_prompts(256, [5, 19, 12], seed=11)


def test_hf_names_update_to_transformers_new_weights(llm, hf_model, hf_model_b, restore):
    assert _tokens(llm, PROMPTS) == [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
    assert llm.get_stats()["kv_blocks_cached"] > 0  # the prompts' full blocks, cached under the old weights
    result = llm.update_weights(hf_arrays(hf_model_b))
    assert result["tensors"] == len(hf_model_b.state_dict()) and result["prefix_blocks_dropped"] > 0
    assert llm.get_stats()["kv_blocks_cached"] == 0
    # the same prompts again: a stale prefix cache would have served the old weights' K/V
    assert _tokens(llm, PROMPTS) == [hf_greedy(hf_model_b, p, MAX_TOKENS) for p in PROMPTS]
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_port_state_and_trainer_mapping(llm, hf_model_b, model_dir_b, restore):
    """An NNX State of the port (as loaded, before the CPU packs it), then the same under a trainer's names."""
    state = nnx.state(load_model(model_dir_b).model, nnx.Param)
    llm.update_weights(state)
    expect = [hf_greedy(hf_model_b, p, MAX_TOKENS) for p in PROMPTS]
    assert _tokens(llm, PROMPTS) == expect
    llm.update_weights(hf_arrays(hf_model_b.__class__(hf_model_b.config)))  # something else in between
    flat = {"policy/" + name.replace(".", "/"): x for name, x in hf_arrays(hf_model_b).items()}
    flat["policy/step_counter"] = jnp.zeros(())  # not a weight: the mapping skips it
    llm.update_weights(flat, mapping=lambda name: None if name.endswith("step_counter") else
                       name.removeprefix("policy/").replace("/", "."))  # fmt: skip
    assert _tokens(llm, PROMPTS) == expect


def test_a_bad_update_names_every_problem_and_changes_nothing(llm, hf_model):
    before = jax.tree_util.tree_leaves(llm.engine.runner.state)
    weights = hf_arrays(hf_model)
    weights["model.layers.0.mlp.up_proj.weight"] = jnp.zeros((3, 4))
    weights["model.layers.9.self_attn.q_proj.weight"] = jnp.zeros((64, 64))
    weights["model.norm.weight"] = jnp.zeros(64, jnp.int32)
    with pytest.raises(ValueError) as info:
        llm.update_weights(weights)
    message = str(info.value)
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.9.self_attn.q_proj.weight", "model.norm.weight"):
        assert name in message
    assert "nothing was changed" in message
    after = jax.tree_util.tree_leaves(llm.engine.runner.state)
    assert all(a is b for a, b in zip(before, after))
    with pytest.raises(ValueError, match="in_flight"):
        llm.update_weights(hf_arrays(hf_model), in_flight="later")


def test_check_update_refuses_as_update_weights_does_and_changes_nothing(llm, hf_model, model_dir_b):
    """weight_sync.check_update (what AsyncLLMEngine runs before it waits for the requests in flight): update_weights'
    own ValueError for bad weights; a good folder read for its shapes only, nothing sent to the devices."""
    sync = llm.engine.weight_sync
    before = jax.tree_util.tree_leaves(llm.engine.runner.state)
    weights = hf_arrays(hf_model)
    weights["model.norm.weight"] = jnp.zeros(64, jnp.int32)
    with pytest.raises(ValueError) as checked:
        sync.check_update(weights)
    with pytest.raises(ValueError) as updated:
        llm.update_weights(weights)
    assert str(checked.value) == str(updated.value) and "model.norm.weight" in str(checked.value)
    with jax.transfer_guard("disallow"):
        sync.check_update(model_dir_b)
        sync.check_update(model_dir_b, mapping=lambda name: (name, lambda x: x * 2))
    with pytest.raises(ValueError, match="does not exist"):
        sync.check_update(model_dir_b + "-missing")
    assert all(a is b for a, b in zip(before, jax.tree_util.tree_leaves(llm.engine.runner.state)))


def test_a_subset_replaces_only_what_it_sets(llm, hf_model, hf_model_b, restore):
    names = ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"]
    before = dict(zip(_paths(llm), jax.tree_util.tree_leaves(llm.engine.runner.state)))
    new = hf_arrays(hf_model_b)
    result = llm.update_weights({name: new[name] for name in names})
    assert result["parameters"] == 3
    after = dict(zip(_paths(llm), jax.tree_util.tree_leaves(llm.engine.runner.state)))
    changed = {p for p in before if after[p] is not before[p]}
    assert changed == {"layers.1.mlp.down_proj.kernel", "layers.0.self_attn.k_proj.kernel", "norm.scale"}
    assert after["norm.scale"] is new["model.norm.weight"]  # taken as it is: a pointer swap
    mixed = copy.deepcopy(hf_model)
    mixed.load_state_dict({**hf_model.state_dict(), **{n: hf_model_b.state_dict()[n] for n in names}})
    assert _tokens(llm, PROMPTS) == [hf_greedy(mixed, p, MAX_TOKENS) for p in PROMPTS]


def _paths(llm):
    from jaxpaged.worker.weight_update import dotted

    return [dotted(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(llm.engine.runner.state)[0]]


def test_from_a_safetensors_folder(llm, hf_model_b, model_dir_b, restore):
    llm.update_weights(model_dir_b)
    assert _tokens(llm, PROMPTS) == [hf_greedy(hf_model_b, p, MAX_TOKENS) for p in PROMPTS]
    with pytest.raises(ValueError, match="does not exist"):
        llm.update_weights(model_dir_b + "-missing")


def test_again_compiles_nothing_and_needs_no_transfer(llm, hf_model, hf_model_b, restore):
    """The second update with the same names reuses the first's program; on the device, nothing moves (Tunix runs
    its weight sync under transfer_guard("disallow_explicit"))."""
    llm.update_weights(hf_arrays(hf_model_b))
    weights = hf_arrays(hf_model)
    before = compile_monitor.compile_count()
    with jax.transfer_guard("disallow_explicit"):
        llm.update_weights(weights)
    assert compile_monitor.compile_count() == before
    assert _tokens(llm, PROMPTS[:1]) == [hf_greedy(hf_model, PROMPTS[0], MAX_TOKENS)]


def test_requests_in_flight_finish_or_abort(llm, hf_model, hf_model_b, restore):
    engine = llm.engine
    params = _greedy(max_tokens=12)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"finish-{i}", {"prompt_token_ids": p}, params)
    engine.step()
    result = engine.update_weights(hf_arrays(hf_model_b), in_flight="finish")
    finished = {o.request_id: list(o.outputs[0].token_ids) for o in result["outputs"]}
    assert finished == {f"finish-{i}": hf_greedy(hf_model, p, 12) for i, p in enumerate(PROMPTS)}  # the old weights
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": p}, params)
    engine.step()
    engine.step()
    result = engine.update_weights(hf_arrays(hf_model), in_flight="abort")
    assert sorted(o.request_id for o in result["outputs"]) == [f"abort-{i}" for i in range(len(PROMPTS))]
    for out in result["outputs"]:
        assert out.finished and out.outputs[0].finish_reason == "abort" and out.outputs[0].stop_reason == ABORT_REASON
    stats = llm.get_stats()
    assert not engine.has_unfinished_requests() and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert _tokens(llm, PROMPTS) == [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("dtype, quantization", [("bfloat16", None), ("float32", "int8")])
def test_platform_layouts_rebuilt_as_at_load(tmp_path, dtype, quantization):
    """A tied head (the CPU packs it with the float32 weights; a 16-bit one gets a transposed copy) and int8 weights
    quantized from the new floats: the updated engine equals one started from the new weights, logprob for logprob."""
    config = tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               tie_word_embeddings=True)  # fmt: skip
    a, b = random_hf_model(config, seed=3), random_hf_model(config, seed=4)
    kwargs = dict(dtype=dtype, quantization=quantization, **ENGINE)
    updated = LLM(str(save_hf_model(a, tmp_path / "a")), **kwargs)
    updated.update_weights(hf_arrays(b))  # float32, as trained: cast or quantized on the device
    fresh = LLM(str(save_hf_model(b, tmp_path / "b")), **kwargs)
    params = _greedy(logprobs=0, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for x, y in zip(updated.generate(prompts, params, use_tqdm=False), fresh.generate(prompts, params, use_tqdm=False)):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert [list(d.values())[0].logprob for d in x.outputs[0].logprobs] == \
               [list(d.values())[0].logprob for d in y.outputs[0].logprobs]  # fmt: skip
        assert [d and list(d.values())[0].logprob for d in x.prompt_logprobs] == \
               [d and list(d.values())[0].logprob for d in y.prompt_logprobs]  # fmt: skip
    assert updated.get_stats()["num_compiles_after_warmup"] == 0


def test_lora_tensors_alone(model_dir, hf_model, tmp_path):
    """An adapter's tensors replaced (a LoRA trainer's sync): its requests then follow PEFT with the new tensors,
    the base model's do not move."""
    peft = pytest.importorskip("peft")
    from jaxpaged import LoRARequest
    from safetensors.numpy import load_file

    from tests.models.test_lora import write_peft_adapter

    del peft
    write_peft_adapter(hf_model, tmp_path / "one", 4, 8, ["q_proj", "v_proj"], False, seed=1)
    two = write_peft_adapter(hf_model, tmp_path / "two", 4, 8, ["q_proj", "v_proj"], False, seed=2)
    llm = LLM(model_dir, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE)
    request = LoRARequest("one", 1, str(tmp_path / "one"))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm.generate(prompts, _greedy(), use_tqdm=False, lora_request=request)
    tensors = {k: jnp.asarray(v) for k, v in load_file(tmp_path / "two" / "adapter_model.safetensors").items()}
    result = llm.update_weights(tensors, lora_request=request)
    assert result["tensors"] == len(tensors) and result["slot"] == 0
    outs = llm.generate(prompts, _greedy(), use_tqdm=False, lora_request=request)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(two, p, MAX_TOKENS) for p in PROMPTS]
    assert _tokens(llm, PROMPTS) == [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
    with pytest.raises(ValueError, match="lora_A"):
        llm.update_weights({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": jnp.zeros((3, 64))},
                           lora_request=request)  # fmt: skip

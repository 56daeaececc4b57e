"""fuse_projections: one q/k/v Linear and one gate/up Linear per layer, laid out at load, give the unfused model's
logits (within 1e-5 in float32) and greedy tokens: Llama GQA with biases, Qwen3 (q/k norm), Qwen2 (biases), a MoE
(experts stay as they are), on XLA's dot and the CPU's packed matmul, with int8/fp8/grouped weights and 8-bit
activations; tensor-parallel layouts split into each device's own heads and columns; a weight update writes into
the fused weights (and needs a layer's q/k/v given together), sleep mode keeps them; LoRA is refused."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from jaxpaged import LLM, SamplingParams
from jaxpaged.config import EngineConfig
from jaxpaged.models.fused_projections import fuse_projections
from jaxpaged.models.layers import GatedMLP
from jaxpaged.models.loader import load_model
from jaxpaged.models.quantization import GroupLinear

from tests.hf_reference import hf_greedy, random_hf_model, random_prompts, save_hf_model, tiny_llama_config
from tests.static_batch import StaticBatchRunner

VOCAB = 256
QWEN = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": 0, "eos_token_id": 1}  # fmt: skip
FAMILIES = {
    "llama-gqa4-bias": lambda: tiny_llama_config(num_attention_heads=8, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "qwen3-qknorm": lambda: transformers.Qwen3Config(**QWEN, head_dim=32),
    "qwen2-bias": lambda: transformers.Qwen2Config(**QWEN),
    # the dense layer and the shared expert fuse; the routed experts stay stacked as they are
    "qwen2moe-shared": lambda: transformers.Qwen2MoeConfig(
        **QWEN, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[0],
    ),
}
PROMPTS = random_prompts(VOCAB, [1, 6, 19, 40], seed=3)
ENGINE = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 8, "block_size": 8, "num_kv_blocks": 64,
          "log_level": "WARNING"}  # fmt: skip (8-token steps: two buckets, the longer prompts still in chunks)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            hf = random_hf_model(FAMILIES[name]())
            cache[name] = hf, str(save_hf_model(hf, tmp_path_factory.mktemp(name)))
        return cache[name]

    return get


def _paths(model) -> set[str]:
    return {".".join(map(str, p)) for p, _ in nnx.iter_modules(model)}


# Each family on one matmul backend, each backend with and without biases: the backend computes the fused Linear
# whatever layer it sits in (XLA's dot, or the CPU's packed kernel), and the family decides what is fused around it
# (GQA, biases, q/k norm, a MoE's shared expert). llama-gqa4-bias on the packed matmul is
# test_engine_fused_equals_unfused[float32]'s (the engine's default backend).
@pytest.mark.parametrize("name,matmul", [("llama-gqa4-bias", "xla"), ("qwen3-qknorm", "xla"), ("qwen2-bias", "auto"),
                                         ("qwen2moe-shared", "auto")],
                         ids=["llama-gqa4-bias-xla", "qwen3-qknorm-xla", "qwen2-bias-auto", "qwen2moe-shared-auto"])  # fmt: skip
def test_fused_logits_and_greedy_equal_unfused(saved, name, matmul):
    _, folder = saved(name)
    plain, fused = load_model(folder, dtype="float32"), load_model(folder, dtype="float32")
    attentions, mlps = fuse_projections(fused.model)
    assert attentions == 2 and mlps == 2  # qwen2moe: layer 0's MLP and layer 1's shared expert
    paths = _paths(fused.model)
    assert "layers.0.self_attn.qkv_proj" in paths and "layers.0.self_attn.q_proj" not in paths
    a, b = StaticBatchRunner(plain, matmul_backend=matmul), StaticBatchRunner(fused, matmul_backend=matmul)
    (want_tokens, want_logits), (got_tokens, got_logits) = (r.generate(PROMPTS, 16, return_prompt_logits=True) for r in (a, b))
    for want, got in zip(want_logits, got_logits):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert got_tokens == want_tokens


def test_unfit_layers_stay_unfused(tmp_path):
    """OLMoE's attention has its own __call__ (q/k norm over all heads): left as it is, and nothing changes."""
    hf = random_hf_model(transformers.OlmoeConfig(**{**QWEN, "num_key_value_heads": 4}, num_experts=4, num_experts_per_tok=2,
                                                  clip_qkv=1.5))  # fmt: skip
    loaded = load_model(str(save_hf_model(hf, tmp_path)), dtype="float32")
    assert fuse_projections(loaded.model) == (0, 0)
    assert "layers.0.self_attn.q_proj" in _paths(loaded.model)


def _engine_tokens(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [
        [max(lp.values(), key=lambda x: x.logprob).logprob for lp in o.outputs[0].logprobs] for o in outs
    ]


@pytest.fixture(scope="module")
def fused_float32(saved):
    """The float32 engine with fuse_projections, shared by test_engine_fused_equals_unfused[float32] and the weight
    update test (which puts the original weights back when it is done)."""
    _, folder = saved("llama-gqa4-bias")
    return LLM(folder, **ENGINE, fuse_projections=True)


@pytest.mark.parametrize("extra", [{}, {"quantization": "int8"}, {"quantization": "fp8", "matmul_backend": "xla"},
                                   {"quantization": "int8", "quantize_activations": True}],
                         ids=["float32", "int8", "fp8-xla", "w8a8-int8"])  # fmt: skip
def test_engine_fused_equals_unfused(saved, extra, request):
    hf, folder = saved("llama-gqa4-bias")
    plain = LLM(folder, **ENGINE, **extra)
    want, want_lp = _engine_tokens(plain)
    del plain
    fused = LLM(folder, **ENGINE, **extra, fuse_projections=True) if extra else request.getfixturevalue("fused_float32")
    runner = fused.engine.runner
    state = nnx.state(nnx.merge(runner.graphdef, runner.state))
    assert "qkv_proj" in state["layers"][0]["self_attn"] and "q_proj" not in state["layers"][0]["self_attn"]
    if runner.matmul_backend == "native" and not extra.get("quantize_activations"):  # packed too: [panels, in, 32]
        assert state["layers"][0]["self_attn"]["qkv_proj"]["kernel"][...].ndim == 3
    got, got_lp = _engine_tokens(fused)
    assert got == want
    np.testing.assert_allclose(np.concatenate(got_lp), np.concatenate(want_lp), atol=1e-5, rtol=0)
    if not extra:
        assert got == [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


def test_grouped_weights_fuse_by_columns():
    """Per-group (GGUF/GPTQ/AWQ-style, 4-bit packed along the input) gate/up: every array's columns concatenated."""
    rng = np.random.default_rng(0)
    d, f, group = 64, 96, 32

    def grouped(lin):
        lin.kernel = nnx.Param(jnp.asarray(rng.integers(0, 256, (lin.kernel.shape[0] // 2, lin.out_features)), jnp.uint8))
        lin.scale = nnx.Param(jnp.asarray(rng.normal(size=(lin.kernel.shape[0] * 2 // group, lin.out_features)), jnp.float32))
        lin.zero = nnx.Param(jnp.asarray(rng.normal(size=lin.scale.shape), jnp.float32))
        lin.method = GroupLinear(4, group)

    cfg = types.SimpleNamespace(hidden_size=d, intermediate_size=f, mlp_bias=False, hidden_act="silu")
    mlp = GatedMLP(cfg, dtype=jnp.float32)
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        grouped(lin)
    x = jnp.asarray(rng.normal(size=(5, d)), jnp.float32)
    want = mlp(x)
    assert fuse_projections(mlp, 2) == (0, 1) and mlp.gate_proj is None
    assert mlp.gate_up_proj.kernel.shape == (d // 2, 2 * f) and mlp.gate_up_proj.zero.shape == (d // group, 2 * f)
    np.testing.assert_allclose(mlp(x), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_layout_gives_each_device_its_heads(saved, tp):
    """The fused columns cut into tp equal blocks: block i is device i's q heads, its KV head (repeated where there are
    fewer KV heads than devices, as replicate_kv_heads does) and its gate and up columns."""
    _, folder = saved("llama-gqa4-bias")
    plain, fused = load_model(folder, dtype="float32"), load_model(folder, dtype="float32")
    fuse_projections(fused.model, tp)
    attn, ref = fused.model.layers[0].self_attn, plain.model.layers[0].self_attn
    (heads, hd), kv = ref.shape, 2
    q, k, v = (np.asarray(p.kernel[...]) for p in (ref.q_proj, ref.k_proj, ref.v_proj))
    blocks = np.split(np.asarray(attn.qkv_proj.kernel[...]), tp, axis=-1)
    for i, block in enumerate(blocks):
        qh = heads // tp
        head = i * kv // tp if tp <= kv else i // (tp // kv)
        per = max(kv // tp, 1)
        np.testing.assert_array_equal(block[:, : qh * hd], q[:, i * qh * hd : (i + 1) * qh * hd])
        np.testing.assert_array_equal(block[:, qh * hd : (qh + per) * hd], k[:, head * hd : (head + per) * hd])
        np.testing.assert_array_equal(block[:, (qh + per) * hd :], v[:, head * hd : (head + per) * hd])
    f = plain.model.layers[0].mlp.gate_proj.out_features
    gate, up = np.asarray(plain.model.layers[0].mlp.gate_proj.kernel[...]), np.asarray(plain.model.layers[0].mlp.up_proj.kernel[...])
    for i, block in enumerate(np.split(np.asarray(fused.model.layers[0].mlp.gate_up_proj.kernel[...]), tp, axis=-1)):
        w = f // tp
        np.testing.assert_array_equal(block, np.concatenate([gate[:, i * w : (i + 1) * w], up[:, i * w : (i + 1) * w]], -1))


def test_lora_is_refused():
    with pytest.raises(ValueError, match="fuse_projections"):
        EngineConfig(enable_lora=True, fuse_projections=True)
    with pytest.raises(ValueError, match="fuse_projections must be a bool"):
        EngineConfig(fuse_projections="yes")


def _hf_arrays(model):
    return {name: jnp.asarray(t.detach().numpy()) for name, t in model.state_dict().items()}


def test_weight_update_and_sleep_write_the_fused_weights(saved, fused_float32):
    hf, _ = saved("llama-gqa4-bias")
    other = random_hf_model(hf.config, seed=7)
    llm = fused_float32
    prompts = PROMPTS[1:3]
    try:
        _weight_update_and_sleep(llm, hf, other, prompts)
    finally:
        llm.update_weights(_hf_arrays(hf))  # the shared engine's own weights again


def _weight_update_and_sleep(llm, hf, other, prompts):
    assert _engine_tokens(llm, prompts)[0] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    llm.update_weights(_hf_arrays(other))
    assert _engine_tokens(llm, prompts)[0] == [hf_greedy(other, p, MAX_TOKENS) for p in prompts]
    new = _hf_arrays(hf)
    with pytest.raises(ValueError, match="fuse_projections.*q_proj"):  # k alone: the fused weight needs q and v too
        llm.update_weights({"model.layers.0.self_attn.k_proj.weight": new["model.layers.0.self_attn.k_proj.weight"]})
    layer = [n for n in new if n.startswith("model.layers.0.self_attn.") and n.split(".")[-2] in ("q_proj", "k_proj", "v_proj")]
    assert llm.update_weights({n: new[n] for n in layer})["parameters"] == 2  # the fused kernel and bias
    llm.update_weights(new)
    assert _engine_tokens(llm, prompts)[0] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    llm.sleep(1)
    llm.wake_up()
    assert _engine_tokens(llm, prompts)[0] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    llm.sleep(2)
    llm.wake_up()
    llm.update_weights(_hf_arrays(other))
    assert _engine_tokens(llm, prompts)[0] == [hf_greedy(other, p, MAX_TOKENS) for p in prompts]
    assert llm.get_stats()["num_compiles_after_warmup"] == 0

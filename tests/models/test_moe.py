"""Mixture-of-experts ports against transformers in float32 (logits within 1e-4, greedy tokens identical), the
checkpoint spellings experts come in, the grouped matmul against a per-token loop, the engine with chunked prefill
and preemption, experts quantized per expert and channel. Expert parallelism: test_moe_expert_parallel.py."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from jaxpaged.models.loader import load_model

from tests.hf_reference import hf_greedy, hf_logits, random_hf_model, random_prompts, save_hf_model
from tests.static_batch import StaticBatchRunner

VOCAB = 256
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-5,
    bos_token_id=0, eos_token_id=1, pad_token_id=0,
)  # fmt: skip

CASES = {
    "mixtral-8x-top2-gqa2": (
        transformers.MixtralConfig,
        dict(BASE, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
             num_experts_per_tok=2),
        "MixtralForCausalLM",
    ),
    # layer 0 dense (mlp_only_layers), layer 1 sparse with the shared expert; q/k/v bias; top-k not renormalized
    "qwen2moe-shared-dense-layer0": (
        transformers.Qwen2MoeConfig,
        dict(BASE, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6,
             num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, mlp_only_layers=[0],
             norm_topk_prob=False, tie_word_embeddings=True),
        "Qwen2MoeForCausalLM",
    ),
    "qwen3moe-8x-top2-normed-qknorm": (
        transformers.Qwen3MoeConfig,
        dict(BASE, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, norm_topk_prob=True),
        "Qwen3MoeForCausalLM",
    ),
    "olmoe-clip-qkv-bias": (
        transformers.OlmoeConfig,
        dict(BASE, intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
             num_key_value_heads=4, clip_qkv=1.5, attention_bias=True, norm_topk_prob=True),
        "OlmoeForCausalLM",
    ),
}

PROMPT_LENGTHS = [1, 9, 33, 77]
GREEDY_TOKENS = 32


def _hf_model(case: str):
    config_cls, kwargs, _ = CASES[case]
    return random_hf_model(config_cls(**kwargs))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (case, transformers model, its checkpoint folder), each built once."""
    cache = {}

    def get(case: str):
        if case not in cache:
            hf = _hf_model(case)
            cache[case] = case, hf, save_hf_model(hf, tmp_path_factory.mktemp(case))
        return cache[case]

    return get


@pytest.fixture(params=list(CASES), ids=list(CASES))
def family(request, saved):
    return saved(request.param)


def test_logits_and_greedy_match_transformers(family):
    case, hf, folder = family
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.config.architecture == CASES[case][2]
    prompts = random_prompts(VOCAB, PROMPT_LENGTHS, seed=7)
    greedy, logits = StaticBatchRunner(loaded, block_size=8).generate(prompts, GREEDY_TOKENS, return_prompt_logits=True)
    for prompt, got_logits, got_tokens in zip(prompts, logits, greedy):
        np.testing.assert_allclose(got_logits, hf_logits(hf, prompt), atol=1e-4, rtol=0)
        assert got_tokens == hf_greedy(hf, prompt, GREEDY_TOKENS)


# -- the grouped matmul ----------------------------------------------------------------------------


@pytest.mark.parametrize("static", [False, True], ids=["experts-in-use", "static-tiles"])
@pytest.mark.parametrize(
    "tokens,experts,top_k,first,held,valid",
    [(1, 8, 2, 0, 8, None), (37, 8, 2, 0, 8, None), (64, 4, 3, 0, 4, None), (37, 8, 2, 4, 4, None), (37, 8, 2, 0, 8, 5),
     (300, 4, 2, 0, 4, None)],  # the last: full 128-row tiles and every tail size
)
def test_grouped_expert_mlp_equals_a_loop_over_tokens(tokens, experts, top_k, first, held, valid, static):
    """Every (token, expert) pair computed once, whatever the routing; experts not held here add nothing; rows past
    num_valid (bucket padding) go to no expert: zero output, real rows unchanged. The same for the GPU's loop of a
    fixed count of tiles."""
    from jaxpaged.models.moe import grouped_expert_mlp, grouped_expert_mlp_static, route

    rng = np.random.default_rng(tokens + experts)
    d, f = 16, 24
    x = rng.standard_normal((tokens, d), dtype=np.float32)
    gate, up = (rng.standard_normal((held, d, f), dtype=np.float32) * 0.3 for _ in range(2))
    down = rng.standard_normal((held, f, d), dtype=np.float32) * 0.3
    weights, ids = route(jnp.asarray(rng.standard_normal((tokens, experts), dtype=np.float32)), top_k, True)
    mlp = jax.jit(grouped_expert_mlp_static if static else grouped_expert_mlp, static_argnames=("first_expert", "act"))
    num_valid = None if valid is None else jnp.int32(valid)
    got = mlp(jnp.asarray(x), ids, weights, (gate,), (up,), (down,), first_expert=first, act="silu", num_valid=num_valid)
    want, ids_np, weights_np = np.zeros_like(x), np.asarray(ids), np.asarray(weights)
    for t in range(tokens if valid is None else valid):
        for slot in range(top_k):
            e = int(ids_np[t, slot]) - first
            if 0 <= e < held:
                g = x[t] @ gate[e]
                h = g / (1 + np.exp(-g)) * (x[t] @ up[e])
                want[t] += weights_np[t, slot] * (h @ down[e])
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_static_tiles_hold_no_traced_trip_count_or_conditional():
    """All 48 assignments routed to one expert (the most tiles one expert can need) or spread: right either way, and
    the program's only loops have a fixed count (scans) and it has no conditional, so a GPU never reads a count or a
    predicate back."""
    from jaxpaged.models.moe import grouped_expert_mlp, grouped_expert_mlp_static

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((24, 16), dtype=np.float32))
    kernels = [(jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.3),) for s in ((8, 16, 24), (8, 16, 24), (8, 24, 16))]
    weights = jnp.full((24, 2), 0.5, jnp.float32)
    static = jax.jit(grouped_expert_mlp_static, static_argnames=("first_expert", "act"))
    for ids in (jnp.full((24, 2), 5, jnp.int32), jnp.asarray(rng.integers(0, 8, (24, 2)), jnp.int32)):
        want = grouped_expert_mlp(x, ids, weights, *kernels, first_expert=0, act="silu")
        np.testing.assert_allclose(static(x, ids, weights, *kernels, first_expert=0, act="silu"), want, atol=1e-5, rtol=1e-5)
    jaxpr = str(jax.make_jaxpr(functools.partial(grouped_expert_mlp_static, first_expert=0, act="silu"))(x, ids, weights, *kernels))
    assert "scan[" in jaxpr and "while[" not in jaxpr and "cond[" not in jaxpr  # a scan: XLA's loop of a known count


def test_a_gpu_platform_gives_moe_layers_the_static_tiles_and_transformers_tokens(saved, tmp_path):
    from flax import nnx

    from jaxpaged.models.moe import SparseMoeBlock, StaticExpertTiles
    from jaxpaged.platforms.gpu import GpuPlatform

    case, hf, folder = saved("qwen2moe-shared-dense-layer0")
    loaded = load_model(str(folder), dtype="float32")
    GpuPlatform().prepare_model(loaded.model, "auto", dtype="float32", tensor_parallel_size=1)
    blocks = [m for _, m in nnx.iter_modules(loaded.model) if isinstance(m, SparseMoeBlock)]
    assert blocks and all(isinstance(b.expert_loop, StaticExpertTiles) for b in blocks)
    prompts = random_prompts(VOCAB, [9, 33], seed=8)
    greedy = StaticBatchRunner(loaded, block_size=8).generate(prompts, 12)
    assert greedy == [hf_greedy(hf, p, 12) for p in prompts]


# -- checkpoint spellings --------------------------------------------------------------------------


def _resave(folder, convert):
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    save_file(convert(load_file(str(path))), str(path), metadata={"format": "pt"})


def _fuse_experts(tensors: dict) -> dict:
    """Per-expert tensors -> transformers 5's in-memory spelling: experts.gate_up_proj [E, 2I, D], experts.down_proj."""
    import re

    out, groups = {}, {}
    for name, w in tensors.items():
        m = re.match(r"(.*\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$", name)
        if m is None:
            out[name] = w
            continue
        proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(m[3], m[3])
        groups.setdefault((m[1], proj), {})[int(m[2])] = w
    for layer in {layer for layer, _ in groups}:
        stack = lambda proj: np.stack([groups[layer, proj][e] for e in sorted(groups[layer, proj])])  # noqa: E731
        out[f"{layer}.mlp.experts.gate_up_proj"] = np.concatenate([stack("gate_proj"), stack("up_proj")], axis=1)
        out[f"{layer}.mlp.experts.down_proj"] = stack("down_proj")
    return out


@pytest.mark.parametrize(
    "case,convert",
    [
        ("mixtral-8x-top2-gqa2", _fuse_experts),
        ("mixtral-8x-top2-gqa2", lambda t: {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in t.items()}),
        ("qwen3moe-8x-top2-normed-qknorm", _fuse_experts),
    ],
    ids=["mixtral-fused", "mixtral-mlp-prefix", "qwen3moe-fused"],
)
def test_expert_checkpoint_spellings_load(case, convert, tmp_path):
    hf = _hf_model(case)
    folder = save_hf_model(hf, tmp_path / case)
    _resave(folder, convert)
    prompt = random_prompts(VOCAB, [12])[0]
    got = StaticBatchRunner(load_model(str(folder), dtype="float32")).prompt_logits([prompt])[0]
    np.testing.assert_allclose(got, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_missing_expert_is_a_clear_error(tmp_path):
    hf = _hf_model("olmoe-clip-qkv-bias")
    folder = save_hf_model(hf, tmp_path / "olmoe")
    _resave(folder, lambda t: {k: v for k, v in t.items() if "layers.1.mlp.experts.3.up_proj" not in k})
    with pytest.raises(ValueError, match=r"1 tensor\(s\) the model needs are missing: model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight$"):
        load_model(str(folder), dtype="float32")


def test_an_expert_the_config_lacks_is_named(tmp_path):
    """A fifth expert for a 4-expert config is not stacked (or dropped): the loader names it."""
    hf = _hf_model("olmoe-clip-qkv-bias")
    folder = save_hf_model(hf, tmp_path / "olmoe")
    extra = "model.layers.0.mlp.experts.4.up_proj.weight"
    _resave(folder, lambda t: {**t, extra: t["model.layers.0.mlp.experts.3.up_proj.weight"]})
    with pytest.raises(ValueError, match=rf"no rule explains: {re.escape(extra)} \(model\.safetensors\)$"):
        load_model(str(folder), dtype="float32")


def test_bare_config_json_gets_random_experts(tmp_path):
    config_cls, kwargs, arch = CASES["qwen2moe-shared-dense-layer0"]
    config_cls(**kwargs).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path / "config.json"), dtype="float32")
    assert loaded.config.architecture == arch
    assert len(StaticBatchRunner(loaded).generate([[5, 6, 7]], 4)[0]) == 4


# -- the engine ------------------------------------------------------------------------------------


def test_engine_greedy_with_chunked_prefill_and_preemption(saved):
    """Through jaxpaged.LLM: small token budget (8-token steps: prompts split into chunks) and a small KV pool
    (preemptions), the tokens of transformers' one-at-a-time greedy, and no compile after warm-up."""
    from jaxpaged import LLM, SamplingParams

    _, hf, folder = saved("qwen2moe-shared-dense-layer0")  # one family: the MoE layer is shared
    rng = np.random.default_rng(3)
    prompts = random_prompts(VOCAB, rng.integers(1, 40, size=8).tolist(), seed=4)
    max_tokens = rng.integers(8, 24, size=8).tolist()
    llm = LLM(str(folder), dtype="float32", max_num_seqs=8, max_num_batched_tokens=8, block_size=8, num_kv_blocks=12,
              log_level="WARNING")  # fmt: skip
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


# -- quantized experts -----------------------------------------------------------------------------


# a covering set: each kind once, each expert layout once (Mixtral's experts alone; Qwen2-MoE's beside a shared
# expert and a dense layer 0); the kind and the layout take separate code paths
@pytest.mark.parametrize("kind,case", [("int8", "mixtral-8x-top2-gqa2"), ("fp8", "qwen2moe-shared-dense-layer0")])
def test_quantized_experts_per_expert_and_channel(saved, case, kind):
    """quantization= quantizes every expert kernel per expert and output channel (router gates stay float): the
    logits equal transformers run with those dequantized weights, and stay close to the float model's."""
    import torch

    from jaxpaged.models.quantization import quantize_channels

    _, hf, folder = saved(case)
    loaded = load_model(str(folder), dtype="float32", quantization=kind)
    layer = loaded.model.layers[1].mlp
    experts = layer.experts.gate_proj
    assert experts.kernel[...].dtype == (jnp.int8 if kind == "int8" else jnp.float8_e4m3fn)
    assert experts.scale[...].shape == experts.kernel[...].shape[::2]  # [E, out]
    assert layer.gate.kernel[...].dtype == jnp.float32
    prompt = random_prompts(VOCAB, [20], seed=9)[0]
    got = StaticBatchRunner(loaded).prompt_logits([prompt])[0]
    # transformers with every quantized weight replaced by its dequantized value (same round-trip, on the host)
    ref = __import__("copy").deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim == 3:  # fused experts [E, out, in]
                w = p.numpy()
                deq = [q.astype(np.float32) * s for q, s in (quantize_channels(e.T, kind) for e in w)]
                p.copy_(torch.from_numpy(np.stack([d.T for d in deq])))
            elif p.ndim == 2 and "embed" not in name and "lm_head" not in name and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                q, s = quantize_channels(p.numpy().T, kind)
                p.copy_(torch.from_numpy((q.astype(np.float32) * s).T))
    np.testing.assert_allclose(got, hf_logits(ref, prompt), atol=1e-4, rtol=0)
    float_logits = hf_logits(hf, prompt)
    assert np.max(np.abs(got - float_logits)) < (0.1 if kind == "int8" else 0.5) * np.max(np.abs(float_logits))



# -- the grouped-GEMM kernel (moe_kernel="triton") ---------------------------------------------------


def test_moe_kernel_is_a_platform_choice():
    """GPU: the compiled kernel for "triton", the static tiles for "loop"; CPU: the kernel interpreted (tests), the
    loop over the experts in use kept for "loop"; TPU: "triton" refused; an unknown name refused by EngineConfig."""
    from jaxpaged import platforms
    from jaxpaged.config import EngineConfig
    from jaxpaged.models.moe import GroupedGemmExperts, StaticExpertTiles

    gpu, cpu, tpu = (platforms.get(name) for name in ("gpu", "cpu", "tpu"))
    assert gpu.expert_loop("triton") == GroupedGemmExperts(interpret=False)  # no GPU here: the kernel's defaults
    assert gpu.expert_loop("loop") == StaticExpertTiles()
    assert cpu.expert_loop("triton") == GroupedGemmExperts(interpret=True)
    assert cpu.expert_loop("loop") is None and tpu.expert_loop("loop") is None
    with pytest.raises(ValueError, match="moe_kernel='triton'"):
        tpu.expert_loop("triton")
    with pytest.raises(ValueError, match="moe_kernel must be one of"):
        EngineConfig(moe_kernel="cutlass")


def test_engine_with_the_grouped_gemm_kernel_interpreted(saved):
    """moe_kernel="triton" on the CPU runs the GPU's kernel in Pallas' interpret mode in every MoE layer: through the
    engine (8-token prefill chunks and decode) the greedy tokens are transformers' (which the loop's equal: the
    static-batch and engine tests above), with no compile after warm-up."""
    from flax import nnx

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.models.moe import GroupedGemmExperts, SparseMoeBlock

    _, hf, folder = saved("qwen3moe-8x-top2-normed-qknorm")
    prompts = random_prompts(VOCAB, [5, 23, 40], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, block_size=8, moe_kernel="triton",
              log_level="WARNING")  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    model = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.state)
    loops = [m.expert_loop for _, m in nnx.iter_modules(model) if isinstance(m, SparseMoeBlock)]
    assert len(loops) == 2 and all(loop == GroupedGemmExperts(interpret=True) for loop in loops)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in prompts]

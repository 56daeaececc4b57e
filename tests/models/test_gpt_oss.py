"""GPT-OSS against transformers in float32: logits within 1e-4 and greedy tokens identical (attention sinks, alternating
sliding/full layers, the biased router and experts with the clamped SwiGLU engaged); through the engine with chunked
prefill, preemption and KV cache groups; MXFP4 experts dequantized as transformers does, and kept 4-bit for the
grouped-GEMM kernel (moe_kernel "triton", interpreted on this CPU) with the same logits and greedy tokens and the
smaller weight bytes in the engine's memory plan."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers
from flax import nnx
from jaxpaged.models.loader import load_model

from tests.hf_reference import hf_greedy, hf_logits, random_hf_model, random_prompts, save_hf_model
from tests.static_batch import StaticBatchRunner

torch = pytest.importorskip("torch")

VOCAB = 256
WINDOW = 16
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
    max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=0,
    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 64, "rope_theta": 150000.0},
)  # fmt: skip


def _hf_model(**overrides):
    """Random weights; gate_up scaled 8x so the SwiGLU's clamps at +-7 bite on some features."""
    hf = random_hf_model(transformers.GptOssConfig(**{**CONFIG, **overrides}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                p.mul_(8.0)
    return hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    hf = _hf_model()
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("gpt_oss"))


def test_logits_and_greedy_match_transformers(saved):
    hf, folder = saved
    loaded = load_model(str(folder), dtype="float32")
    cfg = loaded.config
    assert cfg.architecture == "GptOssForCausalLM" and cfg.sliding_windows == (WINDOW, None)
    gate_up = hf.model.layers[0].mlp.experts.gate_up_proj.detach().numpy()
    x = np.random.default_rng(0).standard_normal((50, 64)).astype(np.float32)
    assert np.abs(x @ gate_up[0][:, ::2]).max() > 7.0  # the clamp is in play
    prompts = random_prompts(VOCAB, [1, 9, 40, 77], seed=7)  # past the window and YaRN's original length
    greedy, logits = StaticBatchRunner(loaded, block_size=8).generate(prompts, 24, return_prompt_logits=True)
    for prompt, got_logits, got_tokens in zip(prompts, logits, greedy):
        np.testing.assert_allclose(got_logits, hf_logits(hf, prompt), atol=1e-4, rtol=0)
        assert got_tokens == hf_greedy(hf, prompt, 24)


def test_engine_chunked_prefill_preemption_and_kv_groups(saved):
    """Through jaxpaged.LLM (on this CPU the native kernel, sinks included): 16-token chunks, a pool small enough to
    preempt; the sliding layer's group gives back what its window left, so it holds fewer blocks than the full one."""
    from jaxpaged import LLM, SamplingParams

    hf, folder = saved
    rng = np.random.default_rng(3)
    prompts = random_prompts(VOCAB, [45, 5, 30, 23, 38, 12], seed=4)
    max_tokens = rng.integers(10, 30, size=len(prompts)).tolist()
    llm = LLM(str(folder), dtype="float32", max_num_seqs=6, max_num_batched_tokens=16, block_size=4, num_kv_blocks=40,
              log_level="WARNING")  # fmt: skip
    runner = llm.engine.runner
    assert len(runner.kv_groups.layers) == 2  # the sliding layer's group and the full layer's
    from jaxpaged.platforms.cpu import attention as cpu_attention

    if cpu_attention.available():  # the CPU platform's choice where it builds: the C++ kernel runs the sinks
        assert llm.engine.loaded.model.layers[0].self_attn.backend.name == "native"
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    # one 90-token sequence: the full layer holds its 23 blocks, the sliding one about its window's
    scheduler, most = llm.engine.scheduler, [0]
    original = scheduler.schedule

    def spy():
        out = original()
        most[0] = max(most[0], scheduler.kv.pool.num_used)
        return out

    scheduler.schedule = spy
    long_prompt = random_prompts(VOCAB, [30], seed=9)[0]
    out = llm.generate([{"prompt_token_ids": long_prompt}], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
                       use_tqdm=False)  # fmt: skip
    del scheduler.schedule
    assert out[0].outputs[0].token_ids == hf_greedy(hf, long_prompt, 60)
    history, window_blocks = 90 // 4 + 1, -(-(WINDOW - 1 + 16) // 4) + 1
    assert most[0] <= history + window_blocks < 2 * history


# -- MXFP4 -----------------------------------------------------------------------------------------


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from jaxpaged.models.mxfp4 import dequantize_mxfp4

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 10, 4, 16), dtype=np.uint8)  # every code, both nibbles
    scales = rng.integers(100, 150, size=(3, 10, 4), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == want.shape == (3, 128, 10) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def write_mxfp4_checkpoint(hf, folder, out, seed: int = 1):
    """hf's checkpoint in `folder` rewritten into `out` as an MXFP4 one (its experts random _blocks/_scales: every
    code; scales 2^-6 .. 2^-2; the rest as floats) -> transformers' model holding the experts transformers'
    dequantization gives."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(str(folder / "model.safetensors"))
    ref = __import__("copy").deepcopy(hf)
    rng = np.random.default_rng(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows_in, rows = tensors.pop(name).shape  # [E, in, out]: stored as out rows of in / 32 blocks
        blocks = rng.integers(0, 256, size=(experts, rows, rows_in // 32, 16), dtype=np.uint8)
        scales = rng.integers(121, 126, size=(experts, rows, rows_in // 32), dtype=np.uint8)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        deq = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
        with torch.no_grad():
            ref.get_parameter(name).copy_(deq)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return ref


@pytest.fixture(scope="module")
def mxfp4_checkpoint(saved, tmp_path_factory):
    """The saved model as an MXFP4 checkpoint, and transformers' model with its experts dequantized."""
    hf, folder = saved
    out = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return write_mxfp4_checkpoint(hf, folder, out), out


def test_mxfp4_checkpoint_loads_dequantized(mxfp4_checkpoint):
    """A checkpoint with quant_method mxfp4 (experts as _blocks/_scales, the rest as floats), loaded for the loop over
    the experts (moe_kernel "loop", the default): dequantized once; the logits equal transformers' with the experts
    transformers' dequantization gives, in float32 and (loosely) bfloat16."""
    ref, folder = mxfp4_checkpoint
    prompt = random_prompts(VOCAB, [30], seed=5)[0]
    want = hf_logits(ref, prompt)
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.model.layers[0].mlp.experts.gate_proj.kernel[...].dtype == np.dtype("float32")
    got = StaticBatchRunner(loaded).prompt_logits([prompt])[0]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    half = load_model(str(folder), dtype="bfloat16")
    assert half.model.layers[0].mlp.experts.gate_proj.kernel[...].dtype == np.dtype("bfloat16")


def _expert_bytes(model) -> int:
    from jaxpaged.models.moe import ExpertLinear
    from jaxpaged.models.weights import param_bytes

    return sum(param_bytes(nnx.state(m, nnx.Param)) for _, m in nnx.iter_modules(model) if isinstance(m, ExpertLinear))


def test_mxfp4_experts_stay_4bit_for_the_grouped_gemm(mxfp4_checkpoint):
    """Loaded for the grouped-GEMM kernel (moe_kernel "triton"; on this CPU the kernel interpreted), the experts stay
    MXFP4: uint8 codes and scales in the kernel's layout, 4.25 bits a value (down's 32 inner values padded to one
    64-row block), and the logits equal those of the same checkpoint dequantized once (float32: the decoded values are
    the dequantized ones exactly, so only the sums' order differs, two 32-row dots a block instead of one) and
    transformers'."""
    from jaxpaged import platforms
    from jaxpaged.models.moe import GroupedGemmExperts, use_expert_loop

    ref, folder = mxfp4_checkpoint
    assert platforms.get().keeps_mxfp4("triton") and not platforms.get().keeps_mxfp4("loop")
    packed = load_model(str(folder), dtype="float32", moe_kernel="triton")
    floats = load_model(str(folder), dtype="float32")
    e, d, f = CONFIG["num_local_experts"], CONFIG["hidden_size"], CONFIG["intermediate_size"]
    for layer in packed.model.layers:
        ex = layer.mlp.experts
        for proj, (k, n) in (("gate_proj", (d, f)), ("up_proj", (d, f)), ("down_proj", (f, d))):
            codes, scales = getattr(ex, proj).kernel[...], getattr(ex, proj).mx_scale[...]
            padded = -(-k // 64) * 64
            assert codes.dtype == scales.dtype == np.uint8
            assert codes.shape == (e, padded // 2, n) and scales.shape == (e, padded // 32, n)
            if k % 64 == 0:
                assert (codes.nbytes + scales.nbytes) * 8 / (e * k * n) == 4.25
    float_bytes = _expert_bytes(floats.model)
    assert _expert_bytes(packed.model) < float_bytes / 5  # float32 experts: 32 bits a value (biases aside)
    use_expert_loop(packed.model, GroupedGemmExperts(interpret=True))  # what the engine's CPU platform picks for triton
    prompt = random_prompts(VOCAB, [30], seed=5)[0]
    got = StaticBatchRunner(packed).prompt_logits([prompt])[0]
    want = StaticBatchRunner(floats).prompt_logits([prompt])[0]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(got, hf_logits(ref, prompt), atol=1e-4, rtol=0)
    # quantization="none" dequantizes them whatever the loop
    none = load_model(str(folder), dtype="float32", moe_kernel="triton", quantization="none")
    assert none.model.layers[0].mlp.experts.down_proj.kernel[...].dtype == np.dtype("float32")


def test_mxfp4_engine_greedy_and_memory_plan(mxfp4_checkpoint):
    """Through jaxpaged.LLM with moe_kernel="triton" (the interpreted kernel): the greedy tokens of the engine that
    kept the experts 4-bit equal those of the engine that dequantized them (moe_kernel "loop") and transformers'; its
    memory plan counts the 4-bit bytes (the float32 experts' bytes less the codes and scales) and says so."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.models.weights import param_bytes

    ref, folder = mxfp4_checkpoint
    prompts = random_prompts(VOCAB, [7, 19], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = {}
    for kernel in ("triton", "loop"):
        llm = LLM(str(folder), dtype="float32", moe_kernel=kernel, max_num_seqs=2, max_num_batched_tokens=32,
                  block_size=8, num_kv_blocks=16, log_level="WARNING")  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runner = llm.engine.runner
        runs[kernel] = ([o.outputs[0].token_ids for o in outs], param_bytes(runner.state), runner.memory_plan(),
                        _expert_bytes(llm.engine.loaded.model))  # fmt: skip
    (tokens, weights, plan, experts), (tokens_f, weights_f, plan_f, experts_f) = runs["triton"], runs["loop"]
    assert tokens == tokens_f == [hf_greedy(ref, p, 8) for p in prompts]
    assert weights_f - weights == experts_f - experts > 0
    assert f"weights {weights / 1e6:.1f} MB" in plan and f"weights {weights_f / 1e6:.1f} MB" in plan_f
    assert "MXFP4 experts kept 4-bit" in plan and "MXFP4" not in plan_f


def test_mxfp4_experts_kept_4bit_refuse_an_update_and_the_rest_updates(mxfp4_checkpoint):
    """update_weights on an engine that kept the experts 4-bit (moe_kernel="triton"): the expert weights (by HF name,
    as floats a trainer holds, or by the port's paths, as uint8 codes or scales) are refused by name with the way out
    (moe_kernel="loop" or quantization="none"), the whole update with them and the engine unchanged; an update of the
    other weights (attention, router, norms, embeddings, the experts' biases) goes through, and the greedy tokens are
    then transformers' with those weights and the checkpoint's dequantized experts."""
    import copy

    import jax.numpy as jnp

    from jaxpaged import LLM, SamplingParams

    ref, folder = mxfp4_checkpoint
    llm = LLM(str(folder), dtype="float32", moe_kernel="triton", max_num_seqs=2, max_num_batched_tokens=32, block_size=8,
              num_kv_blocks=16, log_level="WARNING")  # fmt: skip
    prompts = random_prompts(VOCAB, [7, 19], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def greedy():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    before = greedy()
    assert before == [hf_greedy(ref, p, 8) for p in prompts]
    new = copy.deepcopy(ref)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    arrays = {name: jnp.asarray(t.detach().numpy()) for name, t in new.state_dict().items()}
    experts = [n for n in arrays if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 2 * CONFIG["num_hidden_layers"]

    with pytest.raises(ValueError) as err:
        llm.update_weights(arrays)
    message = str(err.value)
    assert f"{len(experts)} problem(s), nothing was changed" in message
    assert "tensor model.layers.0.mlp.experts.gate_up_proj sets layers.0.mlp.experts.gate_proj.kernel, " \
           "layers.0.mlp.experts.up_proj.kernel: MXFP4 expert weights this engine keeps 4-bit" in message  # fmt: skip
    assert "moe_kernel='loop' or quantization='none'" in message
    layout = llm.engine.runner.loaded_layout
    for path in ("layers.1.mlp.experts.down_proj.kernel", "layers.1.mlp.experts.down_proj.mx_scale"):
        aval = layout.avals[layout.index[path]]
        with pytest.raises(ValueError, match=f"tensor {path} sets {path}: MXFP4 expert weights"):
            llm.update_weights({path: jnp.zeros(aval.shape, aval.dtype)})  # packed uint8, the right shape: refused too
    assert greedy() == before  # nothing changed

    result = llm.update_weights({n: a for n, a in arrays.items() if n not in experts})
    assert result["tensors"] == len(arrays) - len(experts)
    after = greedy()
    assert after == [hf_greedy(new, p, 8) for p in prompts] and after != before
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    # level 2 drops the weights for an update to bring back, and no update sets 4-bit experts: refused, still serving
    with pytest.raises(ValueError, match=r"level: sleep\(level=2\).*MXFP4 experts 4-bit.*use level=1"):
        llm.sleep(level=2)
    assert greedy() == after
    llm.sleep(level=1)  # to host memory and back whole
    llm.wake_up()
    assert greedy() == after

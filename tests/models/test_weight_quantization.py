"""Quantized weights: int8/fp8 quantized at load, GGUF's Q8_0/Q4_0/Q4_1/Q4_K kept quantized on the device.

Each scheme is checked twice: its matmuls against the same dequantized weights in float (the arithmetic is right,
to float32 rounding), and its logits against the float model (what quantization costs, bounded per scheme).
"""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jaxpaged.models.gguf_io import group_quantized
from jaxpaged.models.loader import load_model
from jaxpaged.models.quantization import (
    ChannelLinear, GroupEmbedding, GroupLinear, dequantize_groups, pack_int4, quantize_activations, quantize_channels,
    quantize_rows, unpack_int4,
)  # fmt: skip
from jaxpaged.models.weights import param_bytes

from tests.gguf_writer import quantize_q4_k, write_llama_gguf
from tests.hf_reference import (
    dequantized_hf, device_weight, hf_logits, port_module, random_hf_model, random_prompts, save_hf_model, tiny_llama_config,
    with_quantized_inputs,
)  # fmt: skip
from tests.static_batch import StaticBatchRunner

# Max |logit error| against the float model on `hf` below (logits reach about 2.5): measured 0.071 (int8), 0.25 (fp8),
# 0.064 (Q8_0, whose embedding and head are 8-bit too), 1.09 / 0.90 / 0.85 (Q4_0 / Q4_1 / Q4_K), then doubled: the
# bound catches a broken scheme (errors of the logits' own size), not run-to-run noise.
FLOAT_ERROR_BOUND = {"int8": 0.15, "fp8": 0.5, "Q8_0": 0.15, "Q4_0": 2.0, "Q4_1": 2.0, "Q4_K": 2.0}
# The same with quantize_activations (W8A8, each matmul's input quantized per token too): measured 0.097 and 0.35.
W8A8_ERROR_BOUND = {"int8": 0.2, "fp8": 0.7}
ARITHMETIC_BOUND = 1e-4  # against the dequantized weights in float32


@pytest.fixture(scope="module")
def hf():
    """Wide enough for Q4_K's 256-value super-blocks; GQA so k/v rows un-permute with their own head count."""
    config = tiny_llama_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    return random_hf_model(config, std=0.05)


@pytest.fixture(scope="module")
def prompts(hf):
    return random_prompts(hf.config.vocab_size, (4, 19))


def _max_error(loaded, reference, prompts) -> float:
    ours = StaticBatchRunner(loaded).prompt_logits(prompts)
    return max(float(np.abs(o - r).max()) for o, r in zip(ours, reference))


def _hf_logits(model, prompts):
    return [hf_logits(model, p) for p in prompts]


def _with_device_weights(hf, loaded):
    """HF computing with exactly the weights the device holds in every Linear but the head."""
    names = [n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    return dequantized_hf(hf, {n: device_weight(port_module(loaded.model, n)) for n in names})


def _weight_bytes(loaded) -> int:
    return param_bytes(nnx.state(loaded.model, nnx.Param))


def test_int4_packing_round_trips():
    codes = np.random.default_rng(0).integers(0, 16, size=(64, 6)).astype(np.uint8)
    packed = pack_int4(codes, axis=0)
    assert packed.shape == (32, 6) and packed.dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed), axis=0)), codes)
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(pack_int4(codes.T, axis=1)), axis=1)), codes.T)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_channel_quantization_error_is_within_half_a_step(kind):
    w = np.random.default_rng(1).normal(size=(96, 40)).astype(np.float32)
    q, scale = quantize_channels(w, kind)
    assert q.dtype == (np.int8 if kind == "int8" else jnp.float8_e4m3fn) and scale.shape == (40,)
    error = np.abs(q.astype(np.float32) * scale - w)
    if kind == "int8":
        assert (error <= scale / 2 + 1e-7).all()
    else:  # e4m3: 3 mantissa bits, so half a unit in the last place is 1/16 of the value's power of two
        assert (error <= np.abs(w) / 16 + scale * 2.0**-9).all()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_activations_quantize_per_token_within_half_a_step(kind):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 96)).astype(np.float32) * np.array([[1e-3], [1.0], [50.0], [1.0], [0.0], [7.0]], np.float32)
    dtype = jnp.int8 if kind == "int8" else jnp.float8_e4m3fn
    q, scale = quantize_rows(jnp.asarray(x), dtype)
    q, scale = np.asarray(q), np.asarray(scale)
    assert q.dtype == dtype and scale.shape == (6, 1)
    error = np.abs(q.astype(np.float32) * scale - x)
    if kind == "int8":
        assert (error <= scale / 2 * (1 + 1e-6)).all()
    else:
        assert (error <= np.abs(x) / 16 + scale * 2.0**-9).all()
    assert (q[4].astype(np.float32) == 0).all() and np.isfinite(scale).all()  # a zero row (padding) stays zero


@pytest.mark.parametrize("kind,fp8_operands", [("int8", "bfloat16"), ("fp8", "bfloat16"), ("fp8", "float8")])
def test_8bit_dot_is_the_product_of_its_quantized_operands(kind, fp8_operands):
    """ChannelLinear(activations=True): exactly (dequantized x) @ (dequantized w), the dot itself in 8 bits, with
    fp8 operands widened to bfloat16 or taken as they are."""
    rng = np.random.default_rng(4)
    w, x = rng.normal(size=(128, 48)).astype(np.float32), rng.normal(size=(5, 128)).astype(np.float32)
    q, scale = quantize_channels(w, kind)
    layer = SimpleNamespace(kernel=jnp.asarray(q), scale=jnp.asarray(scale))

    xq, x_scale = quantize_rows(jnp.asarray(x), q.dtype)
    expected = (np.asarray(xq).astype(np.float64) * np.asarray(x_scale)) @ (q.astype(np.float64) * scale)
    got = np.asarray(ChannelLinear(activations=True, fp8_operands=fp8_operands).apply(layer, jnp.asarray(x)))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert np.abs(got - x @ w).max() > 0  # the activations did lose precision: this is not the weight-only path


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_gguf_blocks_decode_exactly_as_gguf_does(kind):
    import gguf
    from gguf.quants import dequantize

    rows = np.random.default_rng(2).normal(size=(6, 512)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = quantize_q4_k(rows) if kind == "Q4_K" else gguf.quants.quantize(rows, qtype)

    class Tensor:
        tensor_type, shape, data = qtype, np.array([512, 6]), raw

    kept = group_quantized(Tensor, "test.gguf")
    expected = dequantize(raw, qtype).reshape(6, 512)
    np.testing.assert_array_equal(kept.dequantize(), expected)
    codes, scale, zero = kept.transposed()  # the device path: a Linear kernel [in, out]
    on_device = dequantize_groups(jnp.asarray(codes), jnp.asarray(scale), None if zero is None else jnp.asarray(zero),
                                  bits=kept.bits, axis=0, dtype=jnp.float32)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(on_device), expected.T)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_at_load(hf, prompts, tmp_path, kind):
    folder = save_hf_model(hf, tmp_path / "m")
    loaded = load_model(str(folder), quantization=kind)
    q_proj = loaded.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.method, ChannelLinear)
    assert q_proj.kernel[...].dtype == (jnp.int8 if kind == "int8" else jnp.float8_e4m3fn)
    assert loaded.model.lm_head.kernel[...].dtype == jnp.float32  # the head keeps full precision
    assert _weight_bytes(loaded) < 0.4 * _weight_bytes(load_model(str(folder)))

    assert _max_error(loaded, _hf_logits(_with_device_weights(hf, loaded), prompts), prompts) <= ARITHMETIC_BOUND
    assert _max_error(loaded, _hf_logits(hf, prompts), prompts) <= FLOAT_ERROR_BOUND[kind]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_activations_logits(hf, prompts, tmp_path, kind):
    folder = save_hf_model(hf, tmp_path / "m")
    weight_only, loaded = load_model(str(folder), quantization=kind), load_model(str(folder), quantization=kind)
    assert quantize_activations(loaded.model) == 7 * hf.config.num_hidden_layers  # q k v o gate up down
    assert loaded.model.layers[0].mlp.down_proj.method == ChannelLinear(activations=True)
    # the arithmetic: HF with the device's weights and each Linear's input quantized per token, to float32 rounding
    # (fp8: an activation within float32 rounding of a midpoint between two e4m3 values may round the other way in
    # HF, a step of 1/16 of its size, and the sequence drifts from there: measured 0.09 here)
    dequantized = _with_device_weights(hf, weight_only)
    arithmetic = ARITHMETIC_BOUND if kind == "int8" else 0.15
    assert _max_error(loaded, _hf_logits(with_quantized_inputs(dequantized, kind), prompts), prompts) <= arithmetic
    # the cost: against the float model, bounded, and more than weight-only's
    reference = _hf_logits(hf, prompts)
    error = _max_error(loaded, reference, prompts)
    assert _max_error(weight_only, reference, prompts) < error <= W8A8_ERROR_BOUND[kind]


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_gguf_stays_quantized_on_device(hf, prompts, tmp_path, kind):
    path = write_llama_gguf(hf, tmp_path / f"{kind}.gguf", quant=kind)
    kept = load_model(str(path), quantization="gguf")
    floats = load_model(str(path), quantization="none", cache_dir=str(tmp_path / "cache"))
    layer = kept.model.layers[1]
    bits = 8 if kind == "Q8_0" else 4
    for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.down_proj):
        assert proj.method == GroupLinear(bits, 32)
        assert proj.kernel[...].dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    assert isinstance(kept.model.embed_tokens.method, GroupEmbedding)
    assert _weight_bytes(kept) < (0.3 if bits == 8 else 0.2) * _weight_bytes(floats)

    # q/k rows un-permuted with their scales, and every matmul, lookup and head right: the same logits as the
    # dequantized floats
    assert _max_error(kept, StaticBatchRunner(floats).prompt_logits(prompts), prompts) <= ARITHMETIC_BOUND
    assert _max_error(kept, _hf_logits(hf, prompts), prompts) <= FLOAT_ERROR_BOUND[kind]


def test_gguf_with_other_types_dequantizes_them(hf, prompts, tmp_path):
    """A Q5_0 matrix is not kept quantized: it loads as floats beside the kept Q4_0 ones."""
    path = write_llama_gguf(hf, tmp_path / "mixed.gguf", quant={"mlp": "Q5_0", "self_attn": "Q4_0"})
    loaded = load_model(str(path), quantization="gguf")
    assert loaded.model.layers[0].mlp.up_proj.kernel[...].dtype == jnp.float32
    assert isinstance(loaded.model.layers[0].self_attn.v_proj.method, GroupLinear)
    floats = load_model(str(path), quantization="none", cache_dir=str(tmp_path / "cache"))
    assert _max_error(loaded, StaticBatchRunner(floats).prompt_logits(prompts), prompts) <= ARITHMETIC_BOUND


def test_gguf_default_is_the_platforms_and_int8_requantizes_a_gguf(hf, tmp_path):
    """On CPU a GGUF loads as floats by default (the packed float matmul is faster there); int8 gives int8 weights
    from any source, a GGUF's dequantized floats included."""
    path = write_llama_gguf(hf, tmp_path / "q.gguf", quant="Q4_0")
    default = load_model(str(path), cache_dir=str(tmp_path / "cache"))
    assert default.model.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.float32
    int8 = load_model(str(path), quantization="int8", cache_dir=str(tmp_path / "cache"))
    assert isinstance(int8.model.layers[0].self_attn.q_proj.method, ChannelLinear)


def test_unknown_quantization_is_refused(tmp_path, hf):
    from jaxpaged.config import EngineConfig

    folder = save_hf_model(hf, tmp_path / "m")
    with pytest.raises(ValueError, match="quantization"):
        load_model(str(folder), quantization="int3")
    with pytest.raises(ValueError, match="quantization='gguf'.*not a .gguf"):
        load_model(str(folder), quantization="gguf")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")

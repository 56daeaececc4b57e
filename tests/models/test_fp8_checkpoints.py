"""Block-wise FP8 checkpoints (quant_method "fp8", DeepSeek-V3's format): a tiny random DeepSeek-V3 written by
transformers, every Linear but the head and the router quantized here to float8_e4m3fn in [32, 32] blocks (edge
blocks partial: q_a_proj and kv_a_proj_with_mqa have 48 outputs, q_b_proj 48 inputs) with float32
`weight_scale_inv`, the routed experts per expert as the released checkpoints store them, plus a
multi-token-prediction layer (`model.layers.2.*`). Loading dequantizes to exactly weight * scale_inv of each block,
the logits and greedy tokens are transformers' on those weights, and the MTP layer is the only thing skipped.
The dequantization is bit-equal to transformers' own (`_dequantize_fp8_weight`; `Fp8Dequantize` where every
dimension is a multiple of its block), and transformers loading the FP8 checkpoint itself on the CPU (which it
dequantizes) gives the same logits.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from jaxpaged.models.fp8_blocks import ACTIVATIONS, dequantize_fp8_blocks
from jaxpaged.models.loader import load_model
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from tests.hf_reference import hf_greedy, hf_logits, port_module, random_prompts
from tests.models.test_deepseek import VOCAB, deepseek_hf
from tests.static_batch import StaticBatchRunner

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FP8 = ml_dtypes.float8_e4m3fn
BLOCK = (32, 32)
LAYERS = 2  # the tiny model's; its MTP layer is model.layers.2


def quantize_blocks(w: np.ndarray, block, rng) -> tuple[np.ndarray, np.ndarray]:
    """W [out, in] float32 -> (q float8_e4m3fn [out, in], scale_inv float32 [ceil(out / bn), ceil(in / bk)]):
    each block's max |w| at 448 times a random factor in [0.5, 1], so scales are not powers of two and some values
    clip."""
    bn, bk = block
    out, cols = w.shape
    grid = (-(-out // bn), -(-cols // bk))
    pad = np.zeros((grid[0] * bn, grid[1] * bk), np.float32)
    pad[:out, :cols] = w
    amax = np.abs(pad.reshape(grid[0], bn, grid[1], bk)).max(axis=(1, 3))
    scale_inv = (amax / 448.0 * rng.uniform(0.5, 1.0, grid)).astype(np.float32)
    q = np.clip(w / reference_scales(scale_inv, w.shape, block), -448, 448).astype(FP8)
    return q, scale_inv


def reference_scales(scale_inv: np.ndarray, shape, block) -> np.ndarray:
    """Each element's block scale, by index: scale_inv[i // bn, j // bk]."""
    rows, cols = np.arange(shape[-2]) // block[0], np.arange(shape[-1]) // block[1]
    return scale_inv[..., rows[:, None], cols[None, :]]


def reference(q: np.ndarray, scale_inv: np.ndarray, block) -> np.ndarray:
    """The format's definition, float32: weight * scale_inv broadcast per block."""
    return q.astype(np.float32) * reference_scales(scale_inv, q.shape, block)


def _quantized(name: str) -> bool:
    """What DeepSeek-V3's release quantizes: every Linear's weight but the LM head and the router (`mlp.gate`)."""
    return name.endswith(".weight") and name.count(".") > 2 and "norm" not in name and "embed" not in name \
        and not name.endswith("mlp.gate.weight") and not name.startswith("lm_head")  # fmt: skip


def mtp_tensors(floats: dict, rng) -> dict:
    """A multi-token-prediction layer as DeepSeek-V3 stores it after the last layer: a decoder layer (layer 1's
    shapes, experts included) and enorm, hnorm, eh_proj [hidden, 2 hidden], shared_head.{norm,head}, embed_tokens."""
    hidden = floats["model.norm.weight"].shape[0]
    mtp = {
        n.replace("model.layers.1.", f"model.layers.{LAYERS}."): a
        for n, a in floats.items()
        if n.startswith("model.layers.1.")
    }
    p = f"model.layers.{LAYERS}"
    mtp |= {f"{p}.enorm.weight": np.ones(hidden, np.float32), f"{p}.hnorm.weight": np.ones(hidden, np.float32),
            f"{p}.eh_proj.weight": rng.normal(0, 0.15, (hidden, 2 * hidden)).astype(np.float32),
            f"{p}.shared_head.norm.weight": np.ones(hidden, np.float32),
            f"{p}.shared_head.head.weight": floats["lm_head.weight"], f"{p}.embed_tokens.weight": floats["model.embed_tokens.weight"]}  # fmt: skip
    return mtp


def write_fp8(hf, folder, block=BLOCK, qcfg=None, extra=None) -> dict:
    """The FP8 checkpoint of `hf` in `folder` (an MTP layer added) -> {Linear weight name: its exact float32
    dequantization}; `folder / "float"` holds those floats as a plain checkpoint (no MTP layer) for transformers."""
    rng = np.random.default_rng(0)
    hf.save_pretrained(folder / "float")
    floats = load_file(str(folder / "float" / "model.safetensors"))
    tensors, deq = {}, {}
    for name, w in {**floats, **mtp_tensors(floats, rng)}.items():
        if _quantized(name):
            q, s = quantize_blocks(w, block, rng)
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = q, s
            deq[name] = reference(q, s, block)
        else:
            tensors[name] = w
    save_file(tensors | (extra or {}), str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "float" / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    config["quantization_config"] = qcfg or {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": list(block)}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    save_file(
        {n: deq.get(n, a) for n, a in floats.items()},
        str(folder / "float" / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return {n: a for n, a in deq.items() if not n.startswith(f"model.layers.{LAYERS}.")}


@pytest.fixture(scope="module")
def fp8_v3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8-v3")
    deq = write_fp8(deepseek_hf("v3"), folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder / "float"), dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    return folder, deq, ref


def _loaded_weight(model, name: str, expert: int | None = None) -> np.ndarray:
    """The [out, in] float weight the port holds for an HF Linear weight name (a routed expert: its stack's row)."""
    if expert is not None:
        layer, proj = name.split(".mlp.experts.")[0], name.rsplit(".", 2)[-2]
        return np.asarray(port_module(model, f"{layer}.mlp.experts.{proj}").kernel[...])[expert].T
    return np.asarray(port_module(model, name.removesuffix(".weight")).kernel[...]).T


def _expert(name: str) -> int | None:
    return int(name.split(".mlp.experts.")[1].split(".")[0]) if ".mlp.experts." in name else None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_dequantize_exactly(fp8_v3, dtype):
    """Every quantized Linear, routed experts included, is weight * scale_inv of its block, bit for bit (bfloat16:
    that float32 product rounded once)."""
    folder, deq, _ = fp8_v3
    loaded = load_model(str(folder), dtype=dtype)
    assert any(".mlp.experts.7." in n for n in deq) and "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in deq
    for name, want in deq.items():
        got = _loaded_weight(loaded.model, name, _expert(name))
        np.testing.assert_array_equal(
            got, want.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else want, err_msg=name
        )


def test_logits_and_greedy_match_transformers_and_mtp_is_skipped(fp8_v3):
    folder, _, ref = fp8_v3
    loaded = load_model(str(folder), dtype="float32")
    from jaxpaged.models.deepseek import MTP_LAYERS

    assert set(loaded.skipped_tensors) == {MTP_LAYERS}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = list(f.keys())
    assert set(loaded.skipped_tensors[MTP_LAYERS]) == {n for n in stored if n.startswith(f"model.layers.{LAYERS}.")}
    prompts = random_prompts(VOCAB, [1, 9, 40], seed=5)
    greedy, logits = StaticBatchRunner(loaded, block_size=8).generate(prompts, 12, return_prompt_logits=True)
    for prompt, got_logits, got_tokens in zip(prompts, logits, greedy):
        np.testing.assert_allclose(got_logits, hf_logits(ref, prompt), atol=1e-4, rtol=0)
        assert got_tokens == hf_greedy(ref, prompt, 12)


def test_transformers_loading_the_fp8_checkpoint_agrees(tmp_path):
    """Blocks of 16 divide every dimension, where transformers' own load-time dequantization (on the CPU it
    dequantizes FP8 checkpoints) reads the format as jaxpaged does: the same logits."""
    block = (16, 16)
    write_fp8(deepseek_hf("v3"), tmp_path, block)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    loaded = load_model(str(tmp_path), dtype="float32")
    prompt = random_prompts(VOCAB, [17], seed=2)[0]
    logits = StaticBatchRunner(loaded, block_size=8).prompt_logits([prompt])[0]
    np.testing.assert_allclose(logits, hf_logits(theirs, prompt), atol=1e-4, rtol=0)


# -- the dequantization against transformers' own ------------------------------------------------


def _fp8(rng, shape):
    return rng.normal(0, 40, shape).clip(-448, 448).astype(FP8)


@pytest.mark.parametrize("shape", [(48, 64), (576, 320), (3, 40, 72)])
def test_dequantization_equals_transformers(shape):
    """Bit-equal to finegrained_fp8._dequantize_fp8_weight (the config's block, partial edge blocks) for 2-D and
    stacked weights, and to Fp8Dequantize (the block from the scale grid) where the blocks divide the weight."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    rng = np.random.default_rng(1)
    for block in ((32, 32), (128, 128), (16, 8)):
        q = _fp8(rng, shape)
        grid = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
        s = rng.uniform(1e-4, 1e-2, grid).astype(np.float32)
        ours = dequantize_fp8_blocks(q, s, block)
        np.testing.assert_array_equal(ours, reference(q, s, block))
        tq = torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        theirs = _dequantize_fp8_weight(tq, torch.from_numpy(s), list(block), torch.float32).numpy()
        np.testing.assert_array_equal(ours, theirs)
        if shape[-2] % block[0] == 0 and shape[-1] % block[1] == 0:
            one = Fp8Dequantize(None)._dequantize_one(tq, torch.from_numpy(s), torch.float32).numpy()
            np.testing.assert_array_equal(ours, one)
        bf16 = dequantize_fp8_blocks(q, s, block, ml_dtypes.bfloat16)
        np.testing.assert_array_equal(bf16, theirs.astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("dtype", [FP8, ml_dtypes.float8_e5m2])
def test_fp8_decoding_is_the_cast(dtype):
    """The two-at-a-time table decodes every pair of codes as ml_dtypes' cast does (NaNs too), odd widths and
    strided views included."""
    from jaxpaged.models.fp8_blocks import fp8_to_float32

    every = np.arange(65536, dtype=np.uint16).view(np.uint8).view(dtype).reshape(512, 256)
    for view in (every, every[:, :255], every[:, 1:201], every[::3, 2:]):
        np.testing.assert_array_equal(fp8_to_float32(view), view.astype(np.float32))


def test_scale_forms():
    """ue8m0 bytes are 2 ** (b - 127); a per-tensor scale without blocks; a grid that does not fit is named."""
    rng = np.random.default_rng(2)
    q = _fp8(rng, (40, 64))
    b = rng.integers(110, 130, (2, 2)).astype(np.uint8)
    np.testing.assert_array_equal(
        dequantize_fp8_blocks(q, b, (32, 32)),
        reference(q, np.ldexp(1.0, b.astype(int) - 127).astype(np.float32), (32, 32)),
    )
    np.testing.assert_array_equal(
        dequantize_fp8_blocks(q, np.float32([0.01]), None), q.astype(np.float32) * np.float32(0.01)
    )
    with pytest.raises(
        ValueError, match=r"weight_scale_inv is \(2, 3\), but a \(40, 64\) weight in \[32, 32\] blocks needs \(2, 2\)"
    ):
        dequantize_fp8_blocks(q, np.ones((2, 3), np.float32), (32, 32))


# -- what loading refuses or skips ---------------------------------------------------------------


def test_static_activation_scales_are_skipped_and_strays_are_named(fp8_v3, tmp_path):
    hf = deepseek_hf("v3")
    extra = {"model.layers.0.self_attn.o_proj.activation_scale": np.float32([0.5])}
    qcfg = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [32, 32]}
    write_fp8(hf, tmp_path / "static", qcfg=qcfg, extra=extra)
    loaded = load_model(str(tmp_path / "static"), dtype="float32")
    assert loaded.skipped_tensors[ACTIVATIONS] == ("model.layers.0.self_attn.o_proj.activation_scale",)
    stray = "model.layers.0.self_attn.extra_proj.weight_scale_inv"
    write_fp8(hf, tmp_path / "stray", extra={stray: np.ones((2, 2), np.float32)})
    with pytest.raises(ValueError, match=rf"no parameter of the model reads and no rule explains: {stray}"):
        load_model(str(tmp_path / "stray"), dtype="float32")
    lone = "model.layers.0.self_attn.extra_proj.weight"
    write_fp8(hf, tmp_path / "lone", extra={lone: np.ones((4, 4), FP8)})
    with pytest.raises(ValueError, match=rf"{lone} .* is float8_e4m3fn without its {lone}_scale_inv"):
        load_model(str(tmp_path / "lone"), dtype="float32")


@pytest.mark.parametrize(("qcfg", "pattern"), [
    ({"weight_block_size": [128]}, r"weight_block_size \[128\]"),
    ({"expert_dtype": "fp4"}, r"expert_dtype 'fp4'"),
    ({"modules_to_convert": ["embed_tokens"]}, r"fp8 embeddings"),
])  # fmt: skip
def test_unsupported_fp8_configs_are_refused(tmp_path, qcfg, pattern):
    from jaxpaged.models.checkpoint_quant import checkpoint_format

    with pytest.raises(ValueError, match=pattern):
        checkpoint_format({"quant_method": "fp8", "weight_block_size": [128, 128], **qcfg}, str(tmp_path))


def test_quantization_fp8_requantizes_the_dequantized_weights(fp8_v3):
    """quantization="fp8" quantizes the dequantized floats per output channel (as a float checkpoint), experts
    per expert; kv_b_proj stays float, as the port keeps it."""
    from jaxpaged.models.quantization import ChannelLinear

    folder, deq, _ = fp8_v3
    loaded = load_model(str(folder), dtype="float32", quantization="fp8")
    layer = port_module(loaded.model, "model.layers.0.self_attn.q_a_proj")
    assert isinstance(layer.method, ChannelLinear)
    got = np.asarray(layer.kernel[...]).astype(np.float32).T * np.asarray(layer.scale[...])[:, None]
    want = deq["model.layers.0.self_attn.q_a_proj.weight"]
    assert np.max(np.abs(got - want)) <= np.max(np.abs(want)) / 8

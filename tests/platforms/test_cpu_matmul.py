"""The native CPU matmul over packed weights (float32, and int8 / fp8 decoded in the kernel): its packing, its
arithmetic, and its use by the engine.

The model-family parity tests (test_model_families.py) run on it too: StaticBatchRunner packs as the engine does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models.quantization import quantize_channels
from jaxpaged.platforms.cpu import matmul as cpu_matmul
from jaxpaged.platforms.cpu import native_build

pytestmark = pytest.mark.skipif(native_build.compiler() is None, reason="no C++ compiler to build the native kernel")


def _rand(rng, *shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


def _quantized(rng, k, n, kind):
    """A random [k, n] weight quantized per output channel as the loader does: (q, scale, q * scale in float64)."""
    q, scale = quantize_channels(rng.normal(size=(k, n)), kind)
    return jnp.asarray(q), jnp.asarray(scale), q.astype(np.float64) * scale.astype(np.float64)


def _assert_float32_product(got, x, w64):
    """got is x @ w64 to float32 rounding: each output one float32 sum of k products."""
    want = np.asarray(x, np.float64) @ w64
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(x.shape[-1]) * np.abs(want).max())


def test_packing_round_trips_and_rows_read_back():
    rng = np.random.default_rng(0)
    w = _rand(rng, 7, 70)  # 70 columns: two full panels and a partial one
    packed = cpu_matmul.pack(w)
    assert packed.shape == (3, 7, 32)
    np.testing.assert_array_equal(cpu_matmul.unpack(packed, 70), w)
    assert float(jnp.abs(packed[2, :, 6:]).max()) == 0.0  # zero past column N
    table = _rand(rng, 70, 7)  # a tied head's [vocab, hidden] table
    np.testing.assert_array_equal(cpu_matmul.pack_rows(table), cpu_matmul.pack(table.T))
    ids = jnp.asarray([0, 31, 32, 69, 5, 5])
    np.testing.assert_array_equal(cpu_matmul.packed_rows(cpu_matmul.pack_rows(table), ids), table[ids])


@pytest.mark.parametrize("m", [1, 3, 12, 13, 64, 257])
@pytest.mark.parametrize("k,n", [(5, 1), (64, 33), (576, 96), (100, 31)])
def test_equals_the_float64_product(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x, w = _rand(rng, m, k), _rand(rng, k, n)
    got = np.asarray(jax.jit(cpu_matmul.packed_matmul, static_argnums=2)(x, cpu_matmul.pack(w), n))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(k) * np.abs(want).max())


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 2, 5, 12, 13, 14, 64])
@pytest.mark.parametrize("k,n", [(5, 1), (64, 33), (100, 31), (576, 96), (300, 257)])
def test_8bit_weights_equal_the_float64_product_of_the_dequantized_weight(kind, m, k, n):
    """int8 / fp8 panels decoded in the kernel, times the scale of each column (the last panel's short too)."""
    rng = np.random.default_rng(m * 1000 + k + n)
    q, scale, w64 = _quantized(rng, k, n, kind)
    x = _rand(rng, m, k)
    got = jax.jit(cpu_matmul.packed_matmul, static_argnums=2)(x, cpu_matmul.pack(q), n, scale)
    _assert_float32_product(np.asarray(got), x, w64)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_every_8bit_value_decodes_exactly(kind):
    """Identity rows read back each of the 254 finite e4m3fn values (signs, subnormals, 448) or -128..127, each
    in every column position of a panel."""
    if kind == "int8":
        values = np.arange(-128, 128).astype(np.int8)
    else:
        bits = np.arange(256, dtype=np.uint8)
        values = bits[(bits & 0x7F) != 0x7F].view(jnp.float8_e4m3fn)  # S.1111.111 is NaN, never stored
    q = np.stack([np.roll(values, j) for j in range(40)], axis=1)  # [len, 40]: two panels, a value in every lane
    scale = np.full(40, 0.5, np.float32)
    got = cpu_matmul.packed_matmul(jnp.eye(len(values)), cpu_matmul.pack(jnp.asarray(q)), 40, jnp.asarray(scale))
    np.testing.assert_array_equal(np.asarray(got), q.astype(np.float32) * 0.5)


def test_leading_dims_are_kept():
    rng = np.random.default_rng(1)
    x, w = _rand(rng, 2, 3, 40), _rand(rng, 40, 50)
    got = cpu_matmul.packed_matmul(x, cpu_matmul.pack(w), 50)
    assert got.shape == (2, 3, 50)
    np.testing.assert_allclose(got, np.einsum("abk,kn->abn", x, w), rtol=1e-5, atol=1e-5)
    q, scale, w64 = _quantized(rng, 40, 50, "int8")
    got = cpu_matmul.packed_matmul(x, cpu_matmul.pack(q), 50, scale)
    assert got.shape == (2, 3, 50)
    _assert_float32_product(np.asarray(got).reshape(6, 50), x.reshape(6, 40), w64)


def test_a_row_comes_out_bit_identical_whatever_the_rows_beside_it():
    """Each output is one float32 sum over k in order, whatever the row count or the row's strip."""
    rng = np.random.default_rng(2)
    x, w = _rand(rng, 100, 576), _rand(rng, 576, 200)
    packed = cpu_matmul.pack(w)
    full = np.asarray(cpu_matmul.packed_matmul(x, packed, 200))
    for rows in (slice(0, 1), slice(37, 38), slice(5, 29), slice(90, 100)):
        np.testing.assert_array_equal(np.asarray(cpu_matmul.packed_matmul(x[rows], packed, 200)), full[rows])


@pytest.mark.parametrize("march,lanes", [("haswell", 8), ("x86-64", 4)])
def test_narrower_vector_builds_compute_the_same_products(march, lanes):
    """The AVX2 (6 x 16 tiles) and 4-float (SSE/NEON-shaped) code paths, built here and checked like the default."""
    import platform

    if platform.machine() != "x86_64" or (march == "haswell" and not {"avx2", "fma"} <= native_build.cpu_flags()):
        pytest.skip(f"this CPU cannot run a -march={march} build")
    target = f"jaxpaged_packed_matmul_cpu_test_{march.replace('-', '_')}"
    assert cpu_matmul.register(target, native_build.march_flags(march)) == lanes
    rng = np.random.default_rng(4)
    for m, k, n in [(1, 5, 1), (7, 64, 33), (13, 100, 70), (64, 576, 96)]:
        x, w = _rand(rng, m, k), _rand(rng, k, n)
        got = np.asarray(cpu_matmul.packed_matmul(x, cpu_matmul.pack(w), n, target=target))
        _assert_float32_product(got, x, np.asarray(w, np.float64))
        for kind in ("int8", "fp8"):  # the 8-bit decoders of this width (fp8: float16 conversion, or float32 bits)
            q, scale, w64 = _quantized(rng, k, n, kind)
            got = np.asarray(cpu_matmul.packed_matmul(x, cpu_matmul.pack(q), n, scale, target=target))
            _assert_float32_product(got, x, w64)


def test_a_mismatched_weight_is_refused():
    rng = np.random.default_rng(3)
    call = jax.ffi.ffi_call(cpu_matmul.TARGET, jax.ShapeDtypeStruct((4, 200), jnp.float32))
    assert cpu_matmul.available()
    with pytest.raises(Exception, match="packed matmul"):
        call(_rand(rng, 4, 10), cpu_matmul.pack(_rand(rng, 10, 50)))  # 50 columns packed, 200 asked for


def test_a_mismatched_scale_or_weight_type_is_refused():
    rng = np.random.default_rng(5)
    x, (q, scale, _) = _rand(rng, 4, 10), _quantized(rng, 10, 50, "int8")
    call = jax.ffi.ffi_call(cpu_matmul.scaled_target(cpu_matmul.TARGET), jax.ShapeDtypeStruct((4, 50), jnp.float32))
    assert cpu_matmul.available()
    with pytest.raises(Exception, match="packed scaled matmul"):
        call(x, cpu_matmul.pack(q), scale[:40])  # 40 scales for 50 columns
    with pytest.raises(Exception, match="int8 or float8_e4m3fn"):
        call(x, cpu_matmul.pack(q).view(jnp.uint8), scale)
    with pytest.raises(TypeError, match="int8 or float8_e4m3fn"):
        cpu_matmul.packed_matmul(x, cpu_matmul.pack(_rand(rng, 10, 50)), 50, scale)  # a float32 weight and a scale


def test_backend_resolution():
    resolve = cpu_matmul.resolve_matmul_backend
    wide = cpu_matmul.lanes() >= 16  # auto takes the native matmul with AVX-512 only
    assert resolve("auto", platform="cpu", dtype=jnp.float32, tensor_parallel_size=1) == ("native" if wide else "xla")
    assert resolve("auto", platform="cpu", dtype=jnp.bfloat16, tensor_parallel_size=1) == "xla"
    assert resolve("auto", platform="cpu", dtype=jnp.float32, tensor_parallel_size=2) == "xla"
    assert resolve("auto", platform="gpu", dtype=jnp.float32, tensor_parallel_size=1) == "xla"
    assert resolve("xla", platform="cpu", dtype=jnp.float32, tensor_parallel_size=1) == "xla"
    with pytest.raises(ValueError, match="matmul_backend"):
        resolve("native", platform="cpu", dtype=jnp.bfloat16, tensor_parallel_size=1)
    with pytest.raises(ValueError, match="matmul_backend"):
        resolve("blas", platform="cpu", dtype=jnp.float32, tensor_parallel_size=1)


def test_auto_takes_the_native_matmul_with_avx512_builds_only(monkeypatch):
    resolve = cpu_matmul.resolve_matmul_backend
    monkeypatch.setattr(cpu_matmul.native_build, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(cpu_matmul, "lanes", lambda: pytest.fail("built the kernel on a CPU without AVX-512"))
    assert resolve("auto", platform="cpu", dtype=jnp.float32, tensor_parallel_size=1) == "xla"
    monkeypatch.setattr(cpu_matmul.native_build, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    for lanes, want in ((16, "native"), (8, "xla"), (4, "xla"), (0, "xla")):
        monkeypatch.setattr(cpu_matmul, "lanes", lambda lanes=lanes: lanes)
        assert resolve("auto", platform="cpu", dtype=jnp.float32, tensor_parallel_size=1) == want
    monkeypatch.setattr(cpu_matmul, "lanes", lambda: 8)  # an explicit "native" runs a narrower build
    assert resolve("native", platform="cpu", dtype=jnp.float32, tensor_parallel_size=1) == "native"


def test_the_engine_packs_its_float32_weights_and_greedy_output_is_unchanged(tmp_path):
    from jaxpaged import LLM, SamplingParams
    from tests.hf_reference import random_hf_model, save_hf_model, tiny_llama_config

    assert cpu_matmul.available()

    folder = save_hf_model(random_hf_model(tiny_llama_config(tie_word_embeddings=True, vocab_size=300)), tmp_path)
    prompts = [{"prompt_token_ids": list(range(2, 2 + n))} for n in (1, 7, 40)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("native", "xla"):  # 4 sequences and 64 tokens a step: 5 step sizes to compile, not 64 and 256's 10
        llm = LLM(str(folder), matmul_backend=backend, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                  log_level="WARNING")  # fmt: skip
        runner = llm.engine.runner
        assert runner.matmul_backend == backend
        kernels = [
            v for p, v in jax.tree_util.tree_leaves_with_path(runner.state) if "kernel" in jax.tree_util.keystr(p)
        ]
        embedding = runner.state["embed_tokens"]["embedding"][...]
        if backend == "native":  # every Linear and the tied head's table in panels
            assert kernels and all(k.ndim == 3 for k in kernels) and embedding.shape == (10, 64, 32)
        else:
            assert all(k.ndim == 2 for k in kernels) and embedding.shape == (300, 64)
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["native"] == outputs["xla"]


def test_explicit_native_matmul_for_bfloat16_is_refused_naming_the_field(tmp_path):
    from jaxpaged import LLM
    from tests.hf_reference import tiny_llama_config

    tiny_llama_config().to_json_file(tmp_path / "config.json")  # random weights: the built-in model took 8x as long
    with pytest.raises(ValueError, match="matmul_backend"):
        LLM(str(tmp_path / "config.json"), dtype="bfloat16", matmul_backend="native", log_level="WARNING")


def _packed_methods(model) -> dict[str, list[str]]:
    """Each Linear method's type name -> the kernels' dtypes (3-d: packed), over the model."""
    from flax import nnx

    from jaxpaged.models.layers import Linear

    found: dict[str, list[str]] = {}
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Linear):
            kernel = module.kernel[...]
            found.setdefault(type(module.method).__name__, []).append(f"{kernel.dtype}/{kernel.ndim}d")
    return found


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_8bit_models_pack_their_kernels_and_logits_equal_xlas(kind, tmp_path):
    """quantization="int8"/"fp8" on the native backend: every quantized Linear packed (PackedChannelLinear, the
    float32 head PackedLinear), and every prompt position's logits those of XLA's dequantizing dot."""
    from jaxpaged.models.loader import load_model
    from tests.hf_reference import random_hf_model, random_prompts, save_hf_model, tiny_llama_config
    from tests.static_batch import StaticBatchRunner

    hf = random_hf_model(tiny_llama_config(intermediate_size=200, num_key_value_heads=2))  # 200: a short last panel
    folder = save_hf_model(hf, tmp_path / "m")
    prompts = random_prompts(hf.config.vocab_size, (1, 9, 30))
    logits = {}
    for backend in ("native", "xla"):
        loaded = load_model(str(folder), quantization=kind)
        runner = StaticBatchRunner(loaded, matmul_backend=backend)
        methods = _packed_methods(loaded.model)
        stored = str(jnp.dtype(jnp.int8 if kind == "int8" else jnp.float8_e4m3fn))
        if backend == "native":
            assert methods == {"PackedChannelLinear": [f"{stored}/3d"] * 14, "PackedLinear": ["float32/3d"]}
        else:
            assert methods == {"ChannelLinear": [f"{stored}/2d"] * 14, "DenseLinear": ["float32/2d"]}
        logits[backend] = runner.prompt_logits(prompts)
    for native, xla in zip(logits["native"], logits["xla"]):
        np.testing.assert_allclose(native, xla, rtol=0, atol=1e-4)


def test_an_int8_engine_packs_its_kernels_and_greedy_output_is_xlas(tmp_path):
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.platforms.cpu.matmul import PackedChannelLinear
    from tests.hf_reference import random_hf_model, save_hf_model, tiny_llama_config

    folder = save_hf_model(random_hf_model(tiny_llama_config(num_key_value_heads=2)), tmp_path)
    prompts = [{"prompt_token_ids": list(range(2, 2 + n))} for n in (1, 7, 40)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    outputs = {}
    for backend in ("native", "xla"):
        llm = LLM(str(folder), quantization="int8", matmul_backend=backend, max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=128, log_level="WARNING")  # fmt: skip
        q_proj = llm.engine.loaded.model.layers[0].self_attn.q_proj
        assert llm.engine.runner.matmul_backend == backend
        assert isinstance(q_proj.method, PackedChannelLinear) == (backend == "native")
        assert q_proj.kernel[...].dtype == jnp.int8 and q_proj.kernel[...].ndim == (3 if backend == "native" else 2)
        outputs[backend] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.get_stats()["num_compiles_after_warmup"] == 0
    for native, xla in zip(outputs["native"], outputs["xla"]):
        assert native.token_ids == xla.token_ids
        for a, b in zip(native.logprobs, xla.logprobs):
            assert a.keys() == b.keys()
            np.testing.assert_allclose([v.logprob for v in a.values()], [v.logprob for v in b.values()], atol=1e-4)

"""The native float32 CPU matmul over packed weights: its packing, its arithmetic, and its use by the engine.

The model-family parity tests (test_model_families.py) run on it too: StaticBatchRunner packs as the engine does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.platforms.cpu import matmul as cpu_matmul
from jaxpaged.platforms.cpu import native_build

pytestmark = pytest.mark.skipif(native_build.compiler() is None, reason="no C++ compiler to build the native kernel")


def _rand(rng, *shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


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


def test_leading_dims_are_kept():
    rng = np.random.default_rng(1)
    x, w = _rand(rng, 2, 3, 40), _rand(rng, 40, 50)
    got = cpu_matmul.packed_matmul(x, cpu_matmul.pack(w), 50)
    assert got.shape == (2, 3, 50)
    np.testing.assert_allclose(got, np.einsum("abk,kn->abn", x, w), rtol=1e-5, atol=1e-5)


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
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(k) * np.abs(want).max())


def test_a_mismatched_weight_is_refused():
    rng = np.random.default_rng(3)
    call = jax.ffi.ffi_call(cpu_matmul.TARGET, jax.ShapeDtypeStruct((4, 200), jnp.float32))
    assert cpu_matmul.available()
    with pytest.raises(Exception, match="packed matmul"):
        call(_rand(rng, 4, 10), cpu_matmul.pack(_rand(rng, 10, 50)))  # 50 columns packed, 200 asked for


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
    for backend in ("native", "xla"):
        llm = LLM(str(folder), matmul_backend=backend, log_level="WARNING")
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


def test_explicit_native_matmul_for_bfloat16_is_refused_naming_the_field():
    from jaxpaged import LLM

    with pytest.raises(ValueError, match="matmul_backend"):
        LLM(dtype="bfloat16", matmul_backend="native", log_level="WARNING")

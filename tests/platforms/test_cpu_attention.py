"""The native CPU kernel's plumbing: built once per machine, and reading the KV cache where it lies.

Its arithmetic is checked against the definition with the other kernels in test_pallas_attention.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpaged.pallas_kernels import AttentionMetadata, AttentionSpec, kv_cache_shape, paged_attention
from jaxpaged.pallas_kernels.reference import reference_paged_attention

from jaxpaged.platforms.cpu import attention as cpu_attention

pytestmark = pytest.mark.skipif(cpu_attention.compiler() is None, reason="no C++ compiler to build the native kernel")


def test_built_once_and_cached_by_source_jax_and_cpu(tmp_path, monkeypatch):
    """The caching around the compiler, on a one-line source: attention.cc itself takes half a minute to compile,
    and is built by every test here that runs it (its default build, and the narrower ones below)."""
    monkeypatch.setenv("JAXPAGED_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "kernel.cc"
    source.write_text('extern "C" int jaxpaged_test_kernel() { return 1; }\n')
    monkeypatch.setattr(cpu_attention, "SOURCE", source)
    path = cpu_attention.build()
    assert path.exists() and path.parent == tmp_path / "cache" / "native"
    stamp = path.stat().st_mtime_ns
    assert cpu_attention.build() == path and path.stat().st_mtime_ns == stamp  # not rebuilt
    # other flags, or another source, would be another library, next to this one
    flags = cpu_attention.CXXFLAGS
    monkeypatch.setattr(cpu_attention, "CXXFLAGS", (*flags, "-DJAXPAGED_TEST_VARIANT"))
    assert cpu_attention.library_path() != path
    monkeypatch.setattr(cpu_attention, "CXXFLAGS", flags)
    assert cpu_attention.library_path() == path
    source.write_text('extern "C" int jaxpaged_test_kernel() { return 2; }\n')
    assert cpu_attention.library_path() != path


def test_a_build_failure_names_the_compiler_error(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAGED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        cpu_attention, "CXXFLAGS", (*cpu_attention.CXXFLAGS, "-DJAXPAGED_TEST_VARIANT", "-include", "no_such_header.h")
    )
    with pytest.raises(RuntimeError, match="no_such_header"):
        cpu_attention.build()
    assert not list((tmp_path / "native").glob("*.so"))  # no half-written library left to load


def test_the_cache_is_read_in_place():
    """The kernel takes the whole cache as an operand: the compiled layers must not copy or convert it, and
    attention is all in the kernel (no matmul in XLA)."""
    shape = kv_cache_shape(4, 2, 512, 16, 64)
    tokens, seqs, width = 64, 64, 32
    attn_metadata = AttentionMetadata(
        *(jax.ShapeDtypeStruct(s, jnp.int32) for s in ((tokens,), (seqs, width), (seqs,), (seqs + 1,)))
    )
    q = jax.ShapeDtypeStruct((tokens, 4, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((tokens, 2, 64), jnp.float32)

    def layers(q, k, v, cache, attn_metadata):
        for layer in range(shape[0]):
            q = paged_attention(q, k, v, cache, layer, attn_metadata, AttentionSpec(0.125), backend=cpu_attention.NativeCpuAttention())
        return q

    cache = jax.ShapeDtypeStruct(shape, jnp.float32)
    hlo = jax.jit(layers).lower(q, kv, kv, cache, attn_metadata).compile().as_text()
    full = "f32[" + ",".join(map(str, shape)) + "]"
    assert hlo.count(cpu_attention.TARGET) >= shape[0]
    made = [line for line in hlo.splitlines() if "=" in line and line.split("=", 1)[1].strip().startswith(full)]
    assert all("parameter(" in line for line in made), made
    # this step's own keys are attended inside the kernel too: no [T, T] product left to XLA
    assert " dot(" not in hlo and "dot_general" not in hlo


reference = jax.jit(reference_paged_attention, static_argnames=("layer", "spec"))


def _decode_batch_against_the_reference(monkeypatch=None, target=None):
    """Many sequences, long contexts, blocks scattered over the pool: the shape of a real decode step."""
    if target is not None:
        monkeypatch.setattr(cpu_attention, "TARGET", target)
    rng = np.random.default_rng(0)
    layers, kv_heads, heads, num_blocks, bs, dim, seqs = 3, 3, 9, 1200, 16, 64, 40
    cache = jnp.asarray(rng.normal(size=kv_cache_shape(layers, kv_heads, num_blocks, bs, dim)), jnp.float32)
    lens = rng.integers(1, 400, seqs).astype(np.int32)
    width = int(-(-lens.max() // bs))
    tables = rng.permutation(num_blocks)[: seqs * width].reshape(seqs, width).astype(np.int32)
    attn_metadata = AttentionMetadata(
        jnp.zeros(seqs, jnp.int32), jnp.asarray(tables), jnp.asarray(lens), jnp.arange(seqs + 1, dtype=jnp.int32)
    )
    q = jnp.asarray(rng.normal(size=(seqs, heads, dim)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(seqs, kv_heads, dim)), jnp.float32) for _ in range(2))
    for layer in range(layers):
        got = cpu_attention.cpu_paged_attention(q, k, v, cache, layer, attn_metadata, AttentionSpec(0.125))
        want = reference(q, k, v, cache, layer, attn_metadata, AttentionSpec(0.125))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=0)


def test_decode_batch_equals_the_reference_through_paged_attention():
    _decode_batch_against_the_reference()


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_narrower_vector_builds_equal_the_reference(march, monkeypatch):
    """The AVX2 (8-float) and 4-float builds of the kernel, built here and checked like the default one."""
    import platform

    from jaxpaged.platforms.cpu import native_build

    if platform.machine() != "x86_64" or (march == "haswell" and not {"avx2", "fma"} <= native_build.cpu_flags()):
        pytest.skip(f"this CPU cannot run a -march={march} build")
    target = f"jaxpaged_paged_attention_cpu_test_{march.replace('-', '_')}"
    assert cpu_attention.available()
    cpu_attention.register(target, native_build.march_flags(march, cpu_attention.CXXFLAGS))
    _decode_batch_against_the_reference(monkeypatch, target)

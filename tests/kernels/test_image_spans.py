"""Attention where an image's tokens see each other both ways (AttentionMetadata.key_ends, Gemma 3 in prefill): every
backend equals the definition, text rows stay causal, and a window keeps its lower bound."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jaxpaged.pallas_kernels import AttentionMetadata, AttentionSpec, MosaicAttention, ReferenceAttention, TritonAttention, paged_attention
from jaxpaged.pallas_kernels.gpu_attention import gpu_paged_attention
from jaxpaged.pallas_kernels.tpu_attention import tpu_paged_attention
from jaxpaged.platforms.cpu import attention as cpu_attention

from tests.attention_cases import expected_output, random_case
from tests.exporting import MOSAIC_CALL, TRITON_CALLS, export_checks, kernel_calls, lowering_for

BACKENDS = {
    "reference": ReferenceAttention(),
    "reference-invariant": ReferenceAttention(batch_invariant=True),
    "native": cpu_attention.NativeCpuAttention(),
    "pallas-gpu-interpret": TritonAttention(interpret=True),
    "pallas-tpu-interpret": MosaicAttention(interpret=True),
}


def _case(window):
    """Three sequences: a prompt chunk on cached context with two image spans, a fresh prompt with one at its start,
    and a decode row; spans of 5 and 9 tokens (longer than the window of 4 where one is set)."""
    rng = np.random.default_rng(7)
    case = random_case(rng, seq_lens=[60, 24, 33], q_lens=[30, 24, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    qsl = np.asarray(case.attn_metadata.query_start_loc)
    seq_lens = np.asarray(case.attn_metadata.seq_lens)
    ends = np.zeros(case.q.shape[0], np.int32)
    for s in range(3):
        cached = seq_lens[s] - (qsl[s + 1] - qsl[s])
        ends[qsl[s] : qsl[s + 1]] = cached + np.arange(qsl[s + 1] - qsl[s])
    for row, length in ((qsl[0] + 3, 5), (qsl[0] + 12, 9), (qsl[1], 6)):  # (first row of a span, its length)
        ends[row : row + length] = ends[row + length - 1]
    return dataclasses.replace(case, attn_metadata=dataclasses.replace(case.attn_metadata, key_ends=jnp.asarray(ends))), ends


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_image_spans_equal_the_definition(backend, window):
    if backend == "native" and not cpu_attention.available():
        pytest.skip("no C++ compiler to build the native kernel")
    case, ends = _case(window)
    spec = AttentionSpec(0.3, window)
    got = jax.jit(lambda q, k, v, c, md: paged_attention(q, k, v, c, 0, md, spec, backend=BACKENDS[backend]))(
        case.q, case.k, case.v, case.kv_cache, case.attn_metadata)  # fmt: skip
    want = expected_output(case, scale=0.3, sliding_window=window)
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(got[:n]), want[:n], atol=1e-5, rtol=0)
    causal = expected_output(dataclasses.replace(case, attn_metadata=dataclasses.replace(case.attn_metadata, key_ends=None)),
                             scale=0.3, sliding_window=window)  # fmt: skip
    spans = np.flatnonzero(ends[:n] > _positions(case)[:n])
    text = np.setdiff1d(np.arange(n), spans)
    np.testing.assert_allclose(np.asarray(got)[text], causal[text], atol=1e-5, rtol=0)  # text rows: causal
    assert np.abs(np.asarray(got)[spans] - causal[spans]).max() > 1e-3  # image rows see past themselves


def _positions(case):
    md = case.attn_metadata
    qsl, seq_lens = np.asarray(md.query_start_loc), np.asarray(md.seq_lens)
    pos = np.zeros(case.q.shape[0], np.int32)
    for s in range(len(seq_lens)):
        n = qsl[s + 1] - qsl[s]
        pos[qsl[s] : qsl[s + 1]] = seq_lens[s] - n + np.arange(n)
    return pos


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernels_with_image_spans_lower_for_their_device(platform):
    """The Triton and Mosaic kernels with key_ends lower for a GPU and a TPU (compiled, not interpreted)."""
    sd = jax.ShapeDtypeStruct
    tokens, seqs, width, blocks, heads, kv_heads, head_dim, block_size = 64, 8, 16, 64, 8, 2, 64, 16
    md = AttentionMetadata(sd((tokens,), jnp.int32), sd((seqs, width), jnp.int32), sd((seqs,), jnp.int32),
                           sd((seqs + 1,), jnp.int32), key_ends=sd((tokens,), jnp.int32))  # fmt: skip
    kernel = gpu_paged_attention if platform == "cuda" else tpu_paged_attention
    fn = jax.jit(lambda q, k, v, c, layer, md: kernel(q, k, v, c, layer, md, AttentionSpec(0.1, 32)))
    with lowering_for(platform):
        module = export.export(fn, platforms=[platform], **export_checks(platform))(
            sd((tokens, heads, head_dim), jnp.bfloat16), sd((tokens, kv_heads, head_dim), jnp.bfloat16),
            sd((tokens, kv_heads, head_dim), jnp.bfloat16), sd((2, 2, blocks, kv_heads, block_size, head_dim), jnp.bfloat16),
            sd((), jnp.int32), md,
        ).mlir_module()  # fmt: skip
    assert len(kernel_calls(module, TRITON_CALLS if platform == "cuda" else (MOSAIC_CALL,))) == 1

"""The TPU kernel reads only what it needs, and one compiled kernel serves every layer.

Its grid is (query tiles, KV heads) whatever the block-table width; each program DMAs the pages
from the first one its sliding window (or chunk) reaches to its sequence's last cached page, so table
entries outside that span are never read: the runs below fill them with garbage (wrong and
out-of-range block ids) and still equal the definition computed from the clean table. The layer
is a traced operand, so a model's layers share one Mosaic kernel (checked on the "tpu" export).
Runs are in Pallas' interpret mode on CPU.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu
from jaxpaged.pallas_kernels import AttentionMetadata, AttentionSpec
from jaxpaged.pallas_kernels.tpu_attention import tpu_paged_attention
from tests.attention_cases import attention_args, definition, random_case

_sd = jax.ShapeDtypeStruct


def _expected(case, kv_cache=None, layer=0, **kw):
    """The definition over `kv_cache` (default: the case's) with this step's K/V written into `layer`."""
    cache = case.kv_cache if kv_cache is None else kv_cache
    return np.asarray(definition(case.q, case.k, case.v, cache, case.attn_metadata, *attention_args(**kw), layer=layer))


def _run(case, block_tables=None, kv_cache=None, layer=0, interpret=True, table_chunk=128, **kw):
    md = case.attn_metadata
    if block_tables is not None:
        md = AttentionMetadata(md.slot_mapping, jnp.asarray(block_tables), md.seq_lens, md.query_start_loc)
    cache = case.kv_cache if kv_cache is None else kv_cache
    got = tpu_paged_attention(case.q, case.k, case.v, cache, layer, md, *attention_args(**kw), interpret=interpret,
                              table_chunk=table_chunk)  # fmt: skip
    assert got.shape == case.q.shape and got.dtype == case.q.dtype
    return np.asarray(got.astype(jnp.float32))


def _check(got, case, expected, atol):
    n = case.num_real_tokens
    np.testing.assert_allclose(got[:n], expected[:n], atol=atol, rtol=0)
    assert np.all(got[n:] == 0)  # padding rows are covered by no tile


def _garbage_tables(rng, case, seq_lens, q_lens, block_size, width, window=None, chunk=None):
    """The case's block tables widened to `width`, every entry the kernel must not read replaced by garbage:
    past each sequence's last page, every entry of padded slots, and (with a window or a chunk) the pages before
    the first one the sequence's earliest query can see. Half the garbage is out-of-range ids, half wrong blocks."""
    clean = np.asarray(case.attn_metadata.block_tables)
    num_blocks = case.kv_cache.shape[2]
    tables = np.where(
        rng.random((clean.shape[0], width)) < 0.5,
        rng.integers(-(2**31), 2**31 - 1, (clean.shape[0], width)),
        rng.integers(0, num_blocks, (clean.shape[0], width)),
    ).astype(np.int32)
    skipped = 0
    for i, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        first = 0 if window is None else max(0, n - ql - window + 1) // block_size
        first = first if chunk is None else (n - ql) // chunk * chunk // block_size
        last = -(-n // block_size)
        tables[i, first:last] = clean[i, first:last]
        skipped += first
    return tables, skipped


def _pallas_calls(jaxpr):
    """Every pallas_call equation in a (closed) jaxpr, nested calls included."""
    calls = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            calls.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    calls += _pallas_calls(sub)
    return calls


def _kernel_call(width, seqs=8, tokens=64, heads=8, kv_heads=2, head_dim=128, block_size=16):
    """The kernel's pallas_call equation for a batch of `seqs` sequence slots and a table `width` wide."""
    md = AttentionMetadata(_sd((tokens,), jnp.int32), _sd((seqs, width), jnp.int32), _sd((seqs,), jnp.int32),
                           _sd((seqs + 1,), jnp.int32))  # fmt: skip
    jaxpr = jax.make_jaxpr(
        lambda q, k, v, c, md: tpu_paged_attention(q, k, v, c, 0, md, AttentionSpec(0.1, 128))
    )(_sd((tokens, heads, head_dim), jnp.bfloat16), _sd((tokens, kv_heads, head_dim), jnp.bfloat16),
      _sd((tokens, kv_heads, head_dim), jnp.bfloat16),
      _sd((1, 2, 1024, kv_heads, block_size, head_dim), jnp.bfloat16), md)  # fmt: skip
    (eqn,) = _pallas_calls(jaxpr.jaxpr)
    return eqn


def test_grid_does_not_grow_with_block_table_width():
    """max_model_len 131072 at block 16 is a table 8192 wide: the grid is the same as for width 16."""

    def grid(width):
        return tuple(_kernel_call(width).params["grid_mapping"].grid)

    assert grid(16) == grid(8192) == (64 // 4 + 8, 2)  # (query tiles, KV heads); 4 tokens x G'=4 rows


def test_smem_does_not_grow_with_block_tables():
    """256 slots x 8192 columns (max_model_len 131072 at block 16) is 8 MiB of block table, far beyond SMEM:
    the tables stay in HBM. The scalar-prefetched operands (per-tile and per-sequence metadata) are the same
    for widths 16 and 8192, and all SMEM (those plus the table chunks and carried state) is a few KiB, the
    same for widths 512 and 8192 (a table narrower than a chunk is fetched whole, so it takes less)."""

    def smem(width):
        eqn = _kernel_call(width, seqs=256)
        prefetched = [v.aval.shape for v in eqn.invars[: eqn.params["grid_mapping"].num_index_operands]]
        refs = eqn.params["jaxpr"].invars
        assert all(str(r.aval.memory_space) == "any" for r in refs if r.aval.shape == (256, width))  # in HBM
        words = sum(int(np.prod(r.aval.shape)) for r in refs if str(r.aval.memory_space) == "smem")
        return prefetched, words

    (pre16, words16), (pre512, words512), (pre8192, words8192) = smem(16), smem(512), smem(8192)
    assert pre16 == pre512 == pre8192 and all(256 * 16 not in shape for shape in pre16)
    assert words16 <= words512 == words8192 <= 1024  # 4 KiB of int32, vs the 8 MiB table


# (no window, one 128-entry chunk) is test_dmas_fetch_only_live_pages' first case: an 8,192-wide garbage table,
# its output checked as here
@pytest.mark.parametrize("window,chunk,table_chunk", [(40, None, 128), (None, None, 8), (200, None, 8), (None, 100, 8)])
def test_entries_outside_the_live_span_are_never_read(window, chunk, table_chunk):
    """A 2,048-wide table (max_model_len 32768 at block 16) full of garbage outside each sequence's live pages.
    With table chunks of 8 entries the long sequence's row is fetched in many refills (from the window's or the
    attention chunk's first page, too)."""
    rng = np.random.default_rng(20)
    seq_lens, q_lens, block_size = [1500, 9, 300, 70], [1, 9, 40, 3], 16
    case = random_case(rng, seq_lens=seq_lens, q_lens=q_lens, num_heads=4, num_kv_heads=2, head_dim=32,
                       block_size=block_size)  # fmt: skip
    tables, skipped = _garbage_tables(rng, case, seq_lens, q_lens, block_size, 2048, window, chunk)
    assert (window or chunk) is None or skipped > 80  # the window (or chunk) skips most of the long context
    kw = dict(scale=32**-0.5, sliding_window=window, chunk_size=chunk)
    _check(_run(case, tables, table_chunk=table_chunk, **kw), case, _expected(case, **kw), 1e-5)


def _tpu_interpret_state():
    """TPU interpret mode's record of the last kernel it ran: (DMAs issued, races found). Private JAX state."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as state

    counter, races = getattr(state, "dma_id_counter", None), getattr(state, "races", None)
    if counter is None or races is None:
        pytest.skip("this JAX's TPU interpret mode keeps no DMA counter / race state")
    return counter.value - 100, races.races_found  # DMA ids count up from 100


@pytest.mark.parametrize(
    "window,table_chunk,width,dmas_per_head",
    [(None, 128, 8192, 52 + 2), (40, 128, 8192, 20 + 2), (None, 8, 19, 52 + 3 + 1), (40, 8, 19, 20 + 1 + 1)],
)
def test_dmas_fetch_only_live_pages(window, table_chunk, width, dmas_per_head):
    """TPU interpret mode simulates each DMA and semaphore: count the kernel's DMAs and check the double
    buffering (within a program and into the next one, pages and table chunks) for races. Per KV head, K and V
    of: a fresh 24-token prompt's three tiles, one 32-row chunk of this step's keys each; a decode at 300,
    19 pages (16-18 with a window of 40) and a chunk; a 5-token chunk at 37, 2 pages and a chunk. Plus the
    table chunks of the two programs that read pages: one each, or with 8-entry chunks 3 for the decode's 19
    pages (the last moved left to end at the row's end: the table is exactly 19 wide). Nothing else, from a
    table of garbage (8,192 wide is max_model_len 131072)."""
    rng = np.random.default_rng(3)
    seq_lens, q_lens, block_size = [24, 300, 37], [24, 1, 5], 16
    case = random_case(rng, seq_lens=seq_lens, q_lens=q_lens, num_heads=4, num_kv_heads=2, head_dim=32,
                       block_size=block_size)  # fmt: skip
    tables, _ = _garbage_tables(rng, case, seq_lens, q_lens, block_size, width, window)
    kw = dict(scale=32**-0.5, sliding_window=window)
    try:
        got = _run(case, tables, interpret=pltpu.InterpretParams(detect_races=True), table_chunk=table_chunk, **kw)
        dmas, races = _tpu_interpret_state()
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    assert dmas == 2 * dmas_per_head and not races  # two KV heads
    _check(got, case, _expected(case, **kw), 1e-5)


def _tpu_custom_call_configs(module: str) -> list[str]:
    return re.findall(r"stablehlo\.custom_call @tpu_custom_call\(.*?backend_config = \"(.*?)\"", module)


def test_one_kernel_serves_every_layer():
    """The layer is a runtime operand: four layers' calls lower to one Mosaic kernel body."""
    tokens, seqs, width, heads, kv_heads, head_dim, block_size = 64, 8, 16, 8, 2, 64, 16
    md = AttentionMetadata(_sd((tokens,), jnp.int32), _sd((seqs, width), jnp.int32), _sd((seqs,), jnp.int32),
                           _sd((seqs + 1,), jnp.int32))  # fmt: skip

    def model(q, k, v, cache, md):
        return sum(tpu_paged_attention(q, k, v, cache, layer, md, AttentionSpec(0.125)) for layer in range(4))

    module = export.export(jax.jit(model), platforms=["tpu"])(
        _sd((tokens, heads, head_dim), jnp.bfloat16), _sd((tokens, kv_heads, head_dim), jnp.bfloat16),
        _sd((tokens, kv_heads, head_dim), jnp.bfloat16),
        _sd((4, 2, 256, kv_heads, block_size, head_dim), jnp.bfloat16), md,
    ).mlir_module()  # fmt: skip
    configs = _tpu_custom_call_configs(module)
    assert configs and len(set(configs)) == 1


def test_layer_operand_reads_that_layer():
    """Each layer of a 4-layer cache holds different values; layer 2, passed as a traced int32, reads layer 2."""
    rng = np.random.default_rng(2)
    case = random_case(rng, seq_lens=[130, 7, 64], q_lens=[5, 7, 1], num_heads=4, num_kv_heads=2, head_dim=32,
                       block_size=16)  # fmt: skip
    cache = jnp.asarray(rng.normal(size=(4,) + case.kv_cache.shape[1:]), case.kv_cache.dtype)
    expected = _expected(case, cache, layer=2, scale=32**-0.5)
    _check(_run(case, kv_cache=cache, layer=jnp.int32(2), scale=32**-0.5), case, expected, 1e-5)
    assert not np.allclose(expected, _expected(case, cache, layer=1, scale=32**-0.5), atol=1e-2)  # the layers differ
    _check(_run(case, kv_cache=cache, layer=2, scale=32**-0.5), case, expected, 1e-5)  # a Python int, too


@pytest.mark.parametrize("block_size", [16, 128])  # 4 pages a step, or part of one (8, 32, 64: other TPU tests)
def test_long_context_window_soft_cap_gqa8_bfloat16(block_size):
    """GQA 8:1 in bfloat16 with a window that skips most of a 2,000-token context and a soft cap; a long
    prefill chunk whose later tiles see only this step's keys. Tables are wide and garbage outside the span."""
    rng = np.random.default_rng(block_size)
    seq_lens, q_lens, window = [2000, 1400, 33, 200], [1, 70, 33, 2], 48
    case = random_case(rng, seq_lens=seq_lens, q_lens=q_lens, num_heads=8, num_kv_heads=1, head_dim=64,
                       block_size=block_size, dtype=jnp.bfloat16)  # fmt: skip
    width = 32768 // block_size  # max_model_len 32768
    tables, _ = _garbage_tables(rng, case, seq_lens, q_lens, block_size, width, window)
    kw = dict(scale=0.125, sliding_window=window, soft_cap=20.0)
    _check(_run(case, tables, **kw), case, _expected(case, **kw), 2e-2)

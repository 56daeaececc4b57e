"""What the Mosaic TPU kernels (tpu_attention.py, mla_tpu.py) share: the paged-cache DMA pipeline and the online softmax.

The grid runs in order (every axis "arbitrary"), so a program can start the next one's DMAs. A program folds its
tile's cached pages first_page .. first_page + num_pages - 1 in groups of pages_per_iter, DMA'd from the cache in HBM
into the two slots of a VMEM buffer: group g + 1's pages are started before group g is folded, and while it folds its
last group a program starts the next program's first (state_ref carries the slot and whether it was started), so no
program waits for its first pages from scratch.

The block tables stay in HBM too (S x W int32 is 8 MiB at 256 slots and max_model_len 131072, far beyond SMEM): a
program DMAs the span of its row it walks into SMEM in chunks of `table_chunk` columns (the whole row if it is
narrower), into the two slots of table_buf. A tile's chunk k holds the entries of its pages k * table_chunk ..
(k + 1) * table_chunk - 1 (a multiple of pages_per_iter, so a group lies in one chunk) and starts at column
chunk_col(t, k), moved left at the row's end so the DMA stays inside the row. A program's table "units" 0 .. n_table - 1
are its own chunks and unit n_table the next program's chunk 0 (for the first group this program starts for it); unit u
goes to slot (tbase + u) % 2.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxpaged.pallas_kernels.tiles import MASK_VALUE


def div(a, b: int):
    """a // b for a >= 0. Mosaic lowers floor division through sign(), which needs a TPU to lower."""
    return jax.lax.div(a, jnp.int32(b))


def start(copies):
    """Starts each (needed, copy) that is needed."""
    for needed, copy in copies:
        pl.when(needed)(copy.start)


def wait(copies):
    for needed, copy in copies:
        pl.when(needed)(copy.wait)


def softmax_init(acc_ref, peak_ref, denom_ref, sink_ref=None):
    """An empty online softmax; with sink_ref ([rows, 1], each row's sink logit) one key of that score and value 0,
    so it joins only the denominator."""
    acc_ref[...] = jnp.zeros_like(acc_ref)
    if sink_ref is not None:
        peak_ref[...] = sink_ref[...]
        denom_ref[...] = jnp.ones_like(denom_ref)
    else:
        peak_ref[...] = jnp.full_like(peak_ref, MASK_VALUE)
        denom_ref[...] = jnp.zeros_like(denom_ref)


def softmax_fold(acc_ref, peak_ref, denom_ref, s, mask, v, *, precision, p_scale=None):
    """Folds one block of keys into the online softmax (peak_ref, denom_ref [rows, 1], acc_ref [rows, width], float32):
    s [rows, keys] the float32 scores, MASK_VALUE where `mask` is false; v [keys, width]; p_scale [1, keys] (a quantized
    page's per-key V scales) multiplies the probabilities' columns before p . v."""
    peak = peak_ref[...]
    new_peak = jnp.maximum(peak, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - new_peak), 0.0)
    correction = jnp.exp(peak - new_peak)
    pv = jnp.dot((p if p_scale is None else p * p_scale).astype(v.dtype), v, precision=precision,
                 preferred_element_type=jnp.float32)  # fmt: skip
    acc_ref[...] = acc_ref[...] * correction + pv
    denom_ref[...] = denom_ref[...] * correction + jnp.sum(p, axis=1, keepdims=True)
    peak_ref[...] = new_peak


class PagePipeline:
    """One program's page and table-chunk DMAs (the module's docstring). `cur` and `nxt`, this program's and the next
    one's work, have fields seq (the table row), first_page, num_pages and num_groups (of pages_per_iter pages), and
    whatever the kernel's callbacks read; prefetch_next: whether there is a next program and it reads a page.

    page_copies(t, slot, p, block) -> the DMAs of t's page into position p of buffer `slot` from cache block `block`;
    page_waits(slot, p) -> DMAs of the same sizes and semaphores, to wait on (no table entry read). table_buf:
    SMEM [2, table_chunk] int32 with table_sems its two DMA semaphores; state_ref: SMEM [3] int32, carried from
    program to program: [slot of this program's first group, whether the previous program started that group (having
    fetched this program's table chunk 0 for it), table_buf slot of this program's chunk 0]."""

    def __init__(self, cur, nxt, prefetch_next, first_program, *, tables_hbm, table_buf, table_sems, state_ref,
                 width: int, pages_per_iter: int, num_blocks: int,
                 page_copies: Callable, page_waits: Callable):  # fmt: skip
        self.cur, self.nxt, self.prefetch_next = cur, nxt, prefetch_next
        self.tables_hbm, self.table_buf, self.table_sems, self.state_ref = tables_hbm, table_buf, table_sems, state_ref
        self.width, self.pages_per_iter, self.num_blocks = width, pages_per_iter, num_blocks
        self.page_copies, self.page_waits = page_copies, page_waits
        self.table_chunk = table_chunk = table_buf.shape[1]
        self.base = jnp.where(first_program, 0, state_ref[0])
        self.started = jnp.where(first_program, 0, state_ref[1]) == 1
        self.tbase = jnp.where(first_program, 0, state_ref[2])
        self.n_table = div(cur.num_pages + table_chunk - 1, table_chunk)
        self.tbase_next = jax.lax.rem(self.tbase + self.n_table, 2)

    def chunk_col(self, t, k):
        return jnp.minimum(t.first_page + k * self.table_chunk, self.width - self.table_chunk)

    def table_copy(self, t, k, tslot):
        src = self.tables_hbm.at[t.seq, pl.ds(self.chunk_col(t, k), self.table_chunk)]
        return pltpu.make_async_copy(src, self.table_buf.at[tslot], self.table_sems.at[tslot])

    def group_copies(self, t, group, slot, tbase):
        """(needed, copy) for each page of a group; pages past the tile's last are neither fetched nor folded. The
        group's table chunk must be in table_buf (slot (tbase + its chunk) % 2)."""
        copies = []
        for p in range(self.pages_per_iter):
            i = group * self.pages_per_iter + p
            page = jnp.minimum(i, jnp.maximum(t.num_pages - 1, 0))
            k = div(page, self.table_chunk)
            entry = jnp.clip(t.first_page + page - self.chunk_col(t, k), 0, self.table_chunk - 1)
            block = jnp.clip(self.table_buf[jax.lax.rem(tbase + k, 2), entry], 0, self.num_blocks - 1)
            copies += [(i < t.num_pages, copy) for copy in self.page_copies(t, slot, p, block)]
        return copies

    def group_waits(self, group, slot):
        return [(group * self.pages_per_iter + p < self.cur.num_pages, copy)
                for p in range(self.pages_per_iter) for copy in self.page_waits(slot, p)]  # fmt: skip

    def start_table_unit(self, u):
        """Starts table unit u's DMA (own chunk u, or the next program's chunk 0 for u == n_table)."""
        tslot = jax.lax.rem(self.tbase + u, 2)
        pl.when(u < self.n_table)(lambda: self.table_copy(self.cur, u, tslot).start())
        pl.when((u == self.n_table) & self.prefetch_next)(lambda: self.table_copy(self.nxt, 0, tslot).start())

    def wait_table_unit(self, u):
        tslot = jax.lax.rem(self.tbase + u, 2)
        self.table_copy(self.cur, 0, tslot).wait()  # the size and semaphore are the same for every unit

    def start_first(self):
        """Table chunk 0 and the first group's pages (unless the previous program started them), then unit 1: chunk 1,
        or the next program's chunk 0 when this program reads at most one chunk; with no page to read, the next
        program's first group. Units 0 and 1 use different slots, and neither holds entries still to be read (the
        previous program's last chunk was read when it started its last group)."""
        cur, nxt, tbase = self.cur, self.nxt, self.tbase

        @pl.when((cur.num_groups > 0) & ~self.started)
        def _():
            self.table_copy(cur, 0, tbase).start()
            self.table_copy(cur, 0, tbase).wait()
            start(self.group_copies(cur, 0, self.base, tbase))

        pl.when(self.n_table > 0)(lambda: self.start_table_unit(1))

        @pl.when((cur.num_groups == 0) & self.prefetch_next)
        def _():
            self.start_table_unit(0)
            self.wait_table_unit(0)
            start(self.group_copies(nxt, 0, self.base, self.tbase_next))

    def fold_groups(self, fold_group):
        """Walks this program's groups, calling fold_group(group, slot) once the group's pages are in buffer `slot`
        (after starting the next group's DMAs, or the next program's first), then leaves state_ref to the next."""
        cur, pages_per_iter, table_chunk = self.cur, self.pages_per_iter, self.table_chunk

        def context_group(group, carry):
            slot = jax.lax.rem(self.base + group, 2)
            last = group + 1 == cur.num_groups
            # The next group's table chunk k: if it is a new one (k >= 1), wait for it; once that group's DMAs are
            # started, chunk k - 1 is done with, so its slot takes unit k + 1.
            k = div((group + 1) * pages_per_iter, table_chunk)
            new_chunk = jax.lax.rem((group + 1) * pages_per_iter, table_chunk) == 0

            @pl.when(~last)
            def _():
                pl.when(new_chunk)(lambda: self.wait_table_unit(k))
                start(self.group_copies(cur, group + 1, 1 - slot, self.tbase))
                pl.when(new_chunk)(lambda: self.start_table_unit(k + 1))

            @pl.when(last & self.prefetch_next)
            def _():
                self.wait_table_unit(self.n_table)
                start(self.group_copies(self.nxt, 0, 1 - slot, self.tbase_next))

            wait(self.group_waits(group, slot))
            fold_group(group, slot)
            return carry

        jax.lax.fori_loop(0, cur.num_groups, context_group, 0)
        self.state_ref[0] = jax.lax.rem(self.base + cur.num_groups, 2)
        self.state_ref[1] = self.prefetch_next.astype(jnp.int32)
        self.state_ref[2] = self.tbase_next

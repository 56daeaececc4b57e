"""The encoder cache's bookkeeping and the encoder part of scheduling, without a model: rows found by an image's
hash, least recently used entries evicted only when rows are needed and never the ones the step being formed reads,
the per-step patch budget, and rows cut before an image they cannot have (before a bidirectional span they would
split)."""

from __future__ import annotations

import types

import numpy as np
from jaxpaged.models.vision.common import EncoderItem
from jaxpaged.multimodal.encoder_cache import EncoderCache, EncoderScheduler
from jaxpaged.multimodal.inputs import MultimodalInputs, PlacedImage, place_images


def _item(seed: int, rows: int = 4, patches: int = 16) -> EncoderItem:
    return EncoderItem({"pixels": np.full(3, seed, np.float32)}, patches, rows)


def _request(*images: tuple[int, EncoderItem]):
    """A request whose prompt holds these (offset, item) images."""
    mm = MultimodalInputs([PlacedImage(item, offset) for offset, item in images])
    return types.SimpleNamespace(parent=types.SimpleNamespace(mm=mm))


def test_items_are_known_by_their_arrays():
    assert _item(1).key == _item(1).key != _item(2).key
    assert EncoderItem({"x": np.zeros(2, np.float32)}, 1, 1).key != EncoderItem({"x": np.zeros((1, 2), np.float32)}, 1, 1).key


def test_least_recently_used_unpinned_entries_are_evicted():
    cache = EncoderCache(8)
    a, b = cache.allocate(b"a", 4), cache.allocate(b"b", 4)
    assert cache.num_used == 8
    c = cache.allocate(b"c", 4)  # evicts a, the oldest, and takes its rows
    assert b"a" not in cache and b"b" in cache and set(c) == set(a)
    cache.touch(b"b")  # now c is the older one
    cache.pinned.add(b"b")  # and b is read by the step being formed
    d = cache.allocate(b"d", 4)
    assert b"c" not in cache and b"b" in cache and set(d) == set(c) and set(cache.rows(b"b")) == set(b)
    cache.pinned.add(b"d")
    assert cache.allocate(b"e", 1) is None  # everything left is pinned
    assert cache.allocate(b"f", 9) is None  # more than the cache


def test_budget_cache_and_spans_cut_rows():
    cache = EncoderCache(8)
    sched = EncoderScheduler(cache, budget=32, bidirectional=False)
    one, two, three = _item(1), _item(2), _item(3)
    req = _request((2, one), (10, two), (20, three))
    sched.begin()
    assert sched.fit(req, 0, 30) == 20  # two images fit the budget (32 patches); the third waits
    work = sched.end(True)
    assert [w.item.key for w in work] == [one.key, two.key]
    sched.begin()  # next step: one and two are no longer read, three evicts one
    assert sched.fit(req, 20, 10) == 10
    assert [w.item.key for w in sched.end(True)] == [three.key] and one.key not in cache and two.key in cache
    # a row that starts inside an image it has: fine; one whose image cannot get rows stops before it
    sched.begin()
    assert sched.fit(_request((0, two)), 1, 5) == 5  # cached: its rows are read again, nothing encoded
    assert sched.end(True) == []
    sched.begin()
    cache.pinned.update({two.key, three.key})
    assert sched.fit(_request((3, _item(4))), 0, 10) == 3  # no rows left unpinned in this step
    assert sched.end(False) == []  # an empty step encodes nothing and gives its entries back


def test_a_bidirectional_span_is_never_cut():
    cache = EncoderCache(16)
    sched = EncoderScheduler(cache, budget=64, bidirectional=True)
    req = _request((4, _item(5)))  # tokens 4..7
    sched.begin()
    assert sched.fit(req, 0, 6) == 4  # would end inside the span: stops before it, encodes nothing
    assert sched.end(True) == []
    sched.begin()
    assert sched.fit(req, 4, 2) == 0  # starts at it with too little budget: waits
    sched.begin()
    assert sched.fit(req, 4, 4) == 4 and len(sched.end(True)) == 1


def test_placeholders_are_assigned_in_order_and_must_be_contiguous():
    items = [_item(1, rows=2), _item(2, rows=3)]
    placed = place_images([0, 9, 9, 1, 9, 9, 9, 2], 9, items)
    assert [(p.offset, p.end) for p in placed] == [(1, 3), (4, 7)]
    mm = MultimodalInputs(placed)
    assert mm.block_salt(0, 2) != mm.block_salt(4, 2) and mm.block_salt(7, 1) == b""
    for bad, why in (([9, 9, 9, 9], "placeholder tokens"), ([9, 9, 1, 9, 1, 9, 9, 0], "contiguous")):
        try:
            place_images(bad, 9, items)
        except ValueError as exc:
            assert why in str(exc)
        else:
            raise AssertionError(bad)

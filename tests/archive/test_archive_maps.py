"""MAP-Elites archives: binning, the add rule, QD statistics, sampling and layouts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from archive_testlib import ArchiveFactory
from hypothesis import given
from hypothesis import strategies as st

from archive import AddStatus, Archive, CVTArchive, Elite, GridArchive


def test_grid_binning_at_edges_and_clipping() -> None:
    a = GridArchive(names=["x", "y"], bins=[4, 2], ranges=[(0.0, 1.0), (10.0, 20.0)])
    assert a.cells == 8
    assert a.cell_of([0.0, 10.0]) == 0
    assert a.cell_of([0.2499, 14.99]) == 0
    assert a.cell_of([0.25, 15.0]) == 1 * 2 + 1  # an interior boundary belongs to the upper bin
    assert a.cell_of([1.0, 20.0]) == 7  # the top of a range is in the last bin
    assert a.cell_of([-5.0, 1e9]) == a.cell_of([0.0, 20.0]) == 1  # clipped into the edge bins
    assert a.cell_of([math.inf, -math.inf]) == 6
    assert a.cell_of({"y": 12.0, "x": 0.6, "extra": 3.0}) == 2 * 2 + 0  # by name, extras ignored
    assert a.grid_index(5) == (2, 1)
    assert [b.tolist() for b in a.boundaries()] == [[0.0, 0.25, 0.5, 0.75, 1.0], [10.0, 15.0, 20.0]]


def test_grid_ranges_never_shift() -> None:
    a = GridArchive(names=["x"], bins=[10], ranges=[(0.0, 1.0)])
    before = a.cell_of([0.55])
    a.add("far", 1.0, [50.0])
    assert a.ranges == ((0.0, 1.0),) and a.cell_of([0.55]) == before and a.elites()[0].cell == 9


@given(
    bins=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    data=st.data(),
)
def test_grid_cell_of_is_always_a_cell(bins: list[int], data: st.DataObject) -> None:
    ranges = []
    for _ in bins:
        lo = data.draw(st.floats(-1e6, 1e6))
        ranges.append((lo, lo + data.draw(st.floats(1e-3, 1e6))))
    a = GridArchive(names=[f"d{i}" for i in range(len(bins))], bins=bins, ranges=ranges)
    x = data.draw(st.lists(st.floats(allow_nan=False), min_size=len(bins), max_size=len(bins)))
    assert 0 <= a.cell_of(x) < a.cells


def test_add_status_semantics(make_archive: ArchiveFactory) -> None:
    a = make_archive()
    assert a.add("a", 1.0, [0.1, 0.1]) is AddStatus.NEW_CELL
    assert a.add("b", 2.0, [0.1, 0.1]) is AddStatus.IMPROVED
    assert a.add("tie", 2.0, [0.1, 0.1]) is AddStatus.NOT_ADDED  # a tie keeps the incumbent
    assert a.add("worse", 1.5, [0.1, 0.1]) is AddStatus.NOT_ADDED
    assert a.add("nofit", None, [0.9, 0.9]) is AddStatus.NOT_ADDED
    assert a.add("nan", math.nan, [0.9, 0.9]) is AddStatus.NOT_ADDED
    assert a.add("inf", math.inf, [0.9, 0.9]) is AddStatus.NOT_ADDED
    assert a.add("nodesc", 5.0, {"x": None, "y": 0.0}) is AddStatus.NOT_ADDED
    assert len(a) == 1
    (e,) = a.elites()
    assert e == Elite(id="b", fitness=2.0, descriptors=(0.1, 0.1), cell=a.cell_of([0.1, 0.1]))
    assert a.elite(e.cell) == e
    assert AddStatus.IMPROVED.added and not AddStatus.NOT_ADDED.added and AddStatus.NEW_CELL == "new_cell"


def test_descriptor_errors(make_archive: ArchiveFactory) -> None:
    a = make_archive()
    with pytest.raises(ValueError, match="lack 'y'"):
        a.add("a", 1.0, {"x": 0.5})
    with pytest.raises(ValueError, match="expected 2"):
        a.cell_of([0.5])
    with pytest.raises(ValueError, match="no value"):
        a.cell_of([math.nan, 0.0])
    with pytest.raises(IndexError):
        a.elite(a.cells)


def test_qd_stats_with_offset(make_archive: ArchiveFactory) -> None:
    a = make_archive()
    empty = a.stats()
    assert (empty.filled, empty.coverage, empty.qd_score, empty.best, empty.mean) == (0, 0.0, 0.0, None, None)
    a.add("a", 3.0, [0.0, -1.0])
    a.add("b", 5.0, [1.0, 1.0])
    s = a.stats(qd_offset=1.0)
    assert (s.cells, s.filled, s.coverage) == (a.cells, 2, 2 / a.cells)
    assert (s.qd_score, s.qd_offset, s.best, s.mean) == ((3 - 1) + (5 - 1), 1.0, 5.0, 4.0)
    assert a.stats().qd_score == 8.0


def test_sample_is_reproducible(make_archive: ArchiveFactory) -> None:
    a = make_archive()
    with pytest.raises(ValueError, match="empty"):
        a.sample(np.random.default_rng(0), 1)
    for i, (x, y) in enumerate([(0.0, -1.0), (1.0, 1.0), (0.5, 0.0)]):
        a.add(f"e{i}", float(i + 1), [x, y])
    picks = [e.id for e in a.sample(np.random.default_rng(3), 50)]
    assert picks == [e.id for e in a.sample(np.random.default_rng(3), 50)]
    assert set(picks) == {e.id for e in a.elites()}


def test_layout_round_trip(make_archive: ArchiveFactory) -> None:
    a = make_archive()
    layout = json.loads(json.dumps(a.layout()))  # survives JSON, as in the store's meta
    b = Archive.from_layout(layout)
    assert type(b) is type(a) and b.layout() == a.layout() and len(b) == 0
    rng = np.random.default_rng(1)
    pts = rng.uniform([-0.2, -1.2], [1.2, 1.2], size=(200, 2))
    assert [a.cell_of(p) for p in pts] == [b.cell_of(p) for p in pts]
    assert type(a).from_layout(layout).cells == a.cells
    with pytest.raises(ValueError, match="unknown archive kind"):
        Archive.from_layout({**layout, "kind": "hex"})
    with pytest.raises(ValueError, match="bad"):
        Archive.from_layout({**layout, "colour": "red"})


def test_from_layout_checks_the_class() -> None:
    g = GridArchive(names=["x"], bins=[3], ranges=[(0.0, 1.0)])
    with pytest.raises(ValueError, match="not a CVTArchive"):
        CVTArchive.from_layout(g.layout())


def test_cvt_is_deterministic_and_restorable() -> None:
    kw = {"names": ["a", "b", "c"], "ranges": [(0.0, 1.0), (0.0, 100.0), (-5.0, 5.0)], "cells": 32, "samples": 3000}
    a, b = CVTArchive(**kw, seed=11), CVTArchive(**kw, seed=11)
    assert np.array_equal(a.centroids, b.centroids)
    assert not np.array_equal(a.centroids, CVTArchive(**kw, seed=12).centroids)
    lo, hi = np.array([0.0, 0.0, -5.0]), np.array([1.0, 100.0, 5.0])
    assert a.centroids.shape == (32, 3) and ((a.centroids >= lo) & (a.centroids <= hi)).all()
    restored = CVTArchive(**kw, seed=0, centroids=a.centroids.tolist())
    pts = np.random.default_rng(2).uniform(lo, hi, size=(300, 3))
    cells = [a.cell_of(p) for p in pts]
    assert cells == [restored.cell_of(p) for p in pts]
    assert len(set(cells)) > 16  # the cells spread over the space
    assert a.cell_of(a.centroids[5]) == 5
    with pytest.raises(ValueError, match="shape"):
        CVTArchive(**kw, seed=0, centroids=a.centroids[:5])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"names": ["x", "x"], "bins": [2, 2], "ranges": [(0, 1), (0, 1)]},
        {"names": ["x"], "bins": [2, 2], "ranges": [(0, 1)]},
        {"names": ["x"], "bins": [0], "ranges": [(0, 1)]},
        {"names": ["x"], "bins": [2], "ranges": [(1, 1)]},
        {"names": ["x"], "bins": [2], "ranges": [(0, math.inf)]},
        {"names": [], "bins": [], "ranges": []},
    ],
)
def test_grid_rejects_bad_definitions(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        GridArchive(**kwargs)

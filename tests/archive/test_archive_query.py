"""Queries over a store and an archive: layout persistence, rebuilding on resume, best per cell."""

from __future__ import annotations

import numpy as np
import pytest
from archive_testlib import genome, ok

from archive import (
    LAYOUT_KEY,
    CVTArchive,
    Store,
    StoreError,
    best_per_cell,
    load_archive,
    rebuild_archive,
    save_layout,
)
from runtime.result import EvalResult, Status


def test_rebuild_gives_the_live_archive(store: Store) -> None:
    live = CVTArchive(names=["x", "y"], ranges=[(0.0, 1.0), (0.0, 1.0)], cells=10, samples=1000, seed=3)
    save_layout(store, live)
    assert store.get_meta(LAYOUT_KEY) is not None
    rng = np.random.default_rng(0)
    for i in range(120):
        store.add_pending(genome=genome(i), operator="random")
        d = {"x": float(rng.random()), "y": float(rng.random())}
        if i % 7 == 0:
            store.record_result(genome(i).id, EvalResult(status=Status.TIMEOUT), descriptors={})
            continue
        fitness = float(rng.integers(5))  # many ties: the earlier evaluation must stay the elite
        store.record_result(genome(i).id, ok(fitness), descriptors=d)
        live.add(genome(i).id, fitness, d)
    rebuilt = rebuild_archive(store)
    assert rebuilt.elites() == live.elites()
    assert rebuilt.stats() == live.stats()

    pairs = best_per_cell(store, rebuilt, k=3)
    assert [e.fitness for e, _ in pairs] == sorted((e.fitness for e in live.elites()), reverse=True)[:3]
    assert all(e.id == c.id and e.fitness == c.fitness for e, c in pairs)
    assert len(best_per_cell(store, rebuilt)) == len(rebuilt)


def test_load_archive_needs_a_layout(store: Store) -> None:
    with pytest.raises(StoreError, match="no archive layout"):
        load_archive(store)

"""Queries that need both the store and an archive: persisting the layout, rebuilding, best per cell.

Everything else the CLI asks (best k, by status, by operator, lineage, counts) is a :class:`Store`
method.
"""

from __future__ import annotations

import json

from archive._base import Archive, Elite
from archive._candidate import Candidate
from archive._errors import StoreError
from archive._store import Store
from runtime.result import Status

__all__ = ["LAYOUT_KEY", "best_per_cell", "load_archive", "operator_stats", "rebuild_archive", "save_layout"]

LAYOUT_KEY = "archive_layout"
"""The ``meta`` key holding the archive's :meth:`Archive.layout` as JSON (CVT centroids included)."""


def save_layout(store: Store, archive: Archive) -> None:
    """Persists the archive's definition so a resumed run or the CLI rebuilds the very same cells."""
    store.set_meta(LAYOUT_KEY, json.dumps(archive.layout()))


def load_archive(store: Store) -> Archive:
    """An empty archive with the layout saved in the store."""
    text = store.get_meta(LAYOUT_KEY)
    if text is None:
        raise StoreError(f"{store.path}: no archive layout saved (meta key {LAYOUT_KEY!r})")
    return Archive.from_layout(json.loads(text))


def rebuild_archive(store: Store, archive: Archive | None = None) -> Archive:
    """Replays every ok candidate, in evaluation order, into ``archive`` (default: :func:`load_archive`).

    Because ties keep the incumbent, this gives the archive the run had after its last evaluation.
    """
    archive = load_archive(store) if archive is None else archive
    for c in store.evaluated():
        if c.status == Status.OK:
            archive.add(c.id, c.fitness, c.descriptors)
    return archive


def best_per_cell(store: Store, archive: Archive, k: int | None = None) -> list[tuple[Elite, Candidate]]:
    """Each cell's elite with its stored candidate, fittest first (the ``k`` fittest if given)."""
    elites = sorted(archive.elites(), key=lambda e: -e.fitness)[:k]
    found = {c.id: c for c in store.get_many([e.id for e in elites])}
    return [(e, found[e.id]) for e in elites if e.id in found]


def operator_stats(store: Store) -> dict[str, dict[str, int]]:
    """Per operator: proposals, applied, compiled, correct, improved (entered the archive), tokens.

    Classical operators propose what they store; a model-backed operator's proposals also count the
    answers that were rejected or failed (from ``llm_calls``). ``improved`` replays the archive.
    """
    archive = load_archive(store)
    out: dict[str, dict[str, int]] = {}
    for c in store.evaluated():
        row = out.setdefault(c.operator, dict.fromkeys(("proposals", "applied", "compiled", "correct", "improved",
                                                        "tokens"), 0))
        row["proposals"] += 1
        row["applied"] += 1
        row["compiled"] += c.status != Status.COMPILE_ERROR
        row["correct"] += c.status == Status.OK
        row["improved"] += c.status == Status.OK and archive.add(c.id, c.fitness, c.descriptors).added
    for name, llm in store.llm_stats("operator").items():
        row = out.setdefault(name, dict.fromkeys(("proposals", "applied", "compiled", "correct", "improved",
                                                  "tokens"), 0))
        row["proposals"] = max(row["proposals"], llm["proposals"])
        row["tokens"] = llm["tokens_in"] + llm["tokens_out"]
    return out

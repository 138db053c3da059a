"""The memory's SQLite file (``memory.db``): the schema, and rows to and from :class:`MemoryEntry`.

The rows are the truth: each holds its entry and its embedding (float32 blob), so the vector index can
be rebuilt or caught up without embedding anything again. ``row`` is the id the index knows an entry by
(AUTOINCREMENT: never reused after a prune). ``meta`` holds the schema version, the embedder that made
the vectors, and ``generation``, bumped whenever rows are deleted so every index built before is stale.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from archive._candidate import dumps
from archive._errors import StoreError
from archive._sqlite import use_wal
from archive.memory._entry import MemoryEntry
from genome import Genome, canonical_json

__all__ = ["ENTRY_COLUMNS", "MemoryStoreError", "connect", "entry_from_row", "entry_row", "iter_vectors"]

SCHEMA_VERSION = 1

_DDL = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS entries (
        row          INTEGER PRIMARY KEY AUTOINCREMENT,  -- the vector index's id of this entry
        id           TEXT NOT NULL UNIQUE,      -- hash of (task, task_args, genome id, hardware id)
        kind         TEXT NOT NULL,             -- 'improvement' or 'failure'
        task         TEXT NOT NULL,
        task_args    TEXT NOT NULL,             -- JSON object
        backend      TEXT NOT NULL,
        signature    TEXT,                      -- the task's C prototype
        hardware_id  TEXT NOT NULL,
        hardware     TEXT NOT NULL,             -- JSON fingerprint
        genome_id    TEXT NOT NULL,
        params       TEXT NOT NULL,             -- JSON object
        source       TEXT,                      -- NULL: the task's template filled with params
        fitness      REAL,
        unit         TEXT NOT NULL DEFAULT '',
        vs_reference REAL,
        note         TEXT NOT NULL DEFAULT '',
        summary      TEXT NOT NULL,             -- the text that was embedded
        run          TEXT NOT NULL DEFAULT '',
        created_at   REAL NOT NULL,
        vector       BLOB NOT NULL              -- float32, unit length
    )""",
    "CREATE INDEX IF NOT EXISTS entries_task ON entries(task, kind, vs_reference DESC)",
    "CREATE INDEX IF NOT EXISTS entries_kind ON entries(kind)",
)

ENTRY_COLUMNS = (
    "row, id, kind, task, task_args, backend, signature, hardware, params, source, fitness, unit, vs_reference,"
    " note, summary, run, created_at"
)


class MemoryStoreError(StoreError):
    """A memory directory that cannot be used as asked (another embedder, a newer schema, a bad file)."""


def connect(path: Path) -> sqlite3.Connection:
    """Opens (creating if needed) ``memory.db`` in WAL mode with the current schema."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA busy_timeout = 30000")
        use_wal(conn, timeout_s=30)
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("BEGIN IMMEDIATE")
        for stmt in _DDL:
            conn.execute(stmt)
        conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        conn.execute("INSERT OR IGNORE INTO meta VALUES ('generation', '0')")
        conn.execute("COMMIT")
        version = int(conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise MemoryStoreError(f"{path}: {exc}") from exc
    if version > SCHEMA_VERSION:
        conn.close()
        raise MemoryStoreError(f"{path}: schema version {version} is newer than this evoforge's; upgrade evoforge")
    return conn


def entry_row(e: MemoryEntry, vector: np.ndarray) -> tuple[Any, ...]:
    """The values inserted for an entry (in the order of the INSERT in ``Memory.add``)."""
    return (
        e.id, e.kind, e.task, canonical_json(e.task_args), e.backend, e.signature, e.hardware_id, dumps(e.hardware),
        e.genome.id, canonical_json(dict(e.genome.params)), e.genome.source, e.fitness, e.unit, e.vs_reference,
        e.note, e.summary, e.run, e.created_at, np.ascontiguousarray(vector, dtype=np.float32).tobytes(),
    )  # fmt: skip


INSERT = (
    "INSERT INTO entries (id, kind, task, task_args, backend, signature, hardware_id, hardware, genome_id, params,"
    " source, fitness, unit, vs_reference, note, summary, run, created_at, vector)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO NOTHING"
)


def entry_from_row(r: tuple[Any, ...]) -> tuple[int, MemoryEntry]:
    """``(row, entry)`` from a row selected as :data:`ENTRY_COLUMNS`."""
    (row, eid, kind, task, args, backend, signature, hardware, params, source, fitness, unit, vs_ref,
     note, summary, run, created_at) = r  # fmt: skip
    entry = MemoryEntry(
        id=eid, kind=kind, task=task, task_args=json.loads(args), backend=backend, signature=signature,
        hardware=json.loads(hardware), genome=Genome(params=json.loads(params), source=source), fitness=fitness,
        unit=unit, vs_reference=vs_ref, note=note, summary=summary, run=run, created_at=created_at,
    )  # fmt: skip
    return row, entry


def iter_vectors(conn: sqlite3.Connection, dim: int, *, after: int = 0, page: int = 20_000
                 ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(rows, vectors)`` pages of every entry with ``row > after``, in row order."""
    while True:
        got = conn.execute("SELECT row, vector FROM entries WHERE row > ? ORDER BY row LIMIT ?", (after, page))
        batch = got.fetchall()
        if not batch:
            return
        rows = np.fromiter((r for r, _ in batch), dtype=np.int64, count=len(batch))
        vecs = np.frombuffer(b"".join(v for _, v in batch), dtype=np.float32).reshape(len(batch), dim)
        yield rows, vecs
        after = int(rows[-1])

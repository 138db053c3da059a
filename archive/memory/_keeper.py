"""Keeping a process's copy of the vector index in step with the memory's rows, and the index file with it.

The rows are the truth; the index file is a cache of them that records the rows it covers. Writers hold
:class:`FileLock`; readers never wait: they add the rows their index lacks from the stored vectors.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from archive.memory._db import iter_vectors
from archive.memory._index import IndexFileError, IndexKind, VectorIndex
from archive.memory._settings import MemorySettings

__all__ = ["FileLock", "IndexKeeper"]

log = logging.getLogger(__name__)

SAVE_AFTER = 1000  # rows (or 5%) the index file may lag behind a writer's; a reader adds them from the rows


class FileLock:
    """An exclusive ``flock`` on a file, reentrant within this process (its threads take turns)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mutex = threading.RLock()
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._depth = 0

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self.mutex:
            if self._fd is None:
                raise ValueError(f"{self.path}: lock closed")
            if self._depth == 0:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with self.mutex:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class IndexKeeper:
    """One process's vector index over the rows of ``conn``, persisted to ``file`` under ``lock``."""

    def __init__(self, conn: sqlite3.Connection, file: Path, dim: int, settings: MemorySettings,
                 lock: FileLock) -> None:
        self.conn, self.file, self.dim, self.settings, self.lock = conn, file, dim, settings, lock
        self.index: VectorIndex | None = None
        self._saved = (-1, -1)  # (generation, max_row) of the index file as this process last wrote or read it

    def _generation(self) -> int:
        return int(self.conn.execute("SELECT value FROM meta WHERE key = 'generation'").fetchone()[0])

    def want_kind(self, count: int) -> IndexKind:
        """The configured index kind, or for ``auto``: flat up to ``approximate_after`` entries, then HNSW."""
        if self.settings.index != "auto":
            return self.settings.index
        return "hnsw" if count > self.settings.approximate_after else "flat"

    def build(self, kind: IndexKind | None = None) -> VectorIndex:
        """A new index of every row (no embedding: the rows hold the vectors)."""
        if kind is None:
            kind = self.want_kind(self.conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0])
        index = VectorIndex(self.dim, kind, generation=self._generation())
        for rows, vecs in iter_vectors(self.conn, self.dim):
            index.add(rows, vecs)
        self.index = index
        return index

    def sync(self) -> VectorIndex:
        """The index brought up to date with the rows: loaded, rebuilt or caught up as needed."""
        with self.lock.mutex:
            generation = self._generation()
            index = self.index
            if index is None or index.generation != generation:
                index = self._load(generation)
            missing = self.conn.execute("SELECT COUNT(*) FROM entries WHERE row > ?", (index.max_row,)).fetchone()[0]
            count = index.ntotal + missing
            kind = self.want_kind(count)
            if index.kind != kind:
                log.info("memory index: switching from %s to %s at %d entries", index.kind, kind, count)
                index = self.build(kind)
            for rows, vecs in iter_vectors(self.conn, self.dim, after=index.max_row):
                index.add(rows, vecs)
            self.index = index
            return index

    def _load(self, generation: int) -> VectorIndex:
        n_rows, max_row = self.conn.execute("SELECT COUNT(*), COALESCE(MAX(row), 0) FROM entries").fetchone()
        try:
            index = VectorIndex.load(self.file)
            if index.dim == self.dim and index.generation == generation and index.max_row <= max_row:
                self._saved = (index.generation, index.max_row)
                return index
            log.info("memory index %s is stale (entries were deleted): rebuilding it", self.file)
        except IndexFileError as exc:
            if n_rows or self.file.exists():
                warnings.warn(f"memory index {exc}: rebuilding it from the {n_rows} entries in the database",
                              RuntimeWarning, stacklevel=5)
        index = self.build()
        if n_rows:
            with self.lock():
                self.save()
        return index

    def save(self) -> None:
        """Writes the index file (atomically). Call under the lock."""
        if self.index is not None:
            self.index.save(self.file)
            self._saved = (self.index.generation, self.index.max_row)

    def save_if_behind(self, *, force: bool = False) -> None:
        """Saves when the file lags by :data:`SAVE_AFTER` rows and 5% (readers catch up on fewer), or on ``force``."""
        index = self.index
        if index is None or self._saved == (index.generation, index.max_row):
            return
        gen, saved_max = self._saved
        behind = self.conn.execute("SELECT COUNT(*) FROM entries WHERE row > ?", (saved_max,)).fetchone()[0]
        if force or gen != index.generation or behind >= max(SAVE_AFTER, index.ntotal // 20):
            self.save()

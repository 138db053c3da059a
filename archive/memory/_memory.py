"""The memory of discoveries: entries in SQLite (the truth) and a FAISS index beside them, shared by runs.

Layout of a memory directory: ``memory.db`` (SQLite, WAL: entries with their vectors), ``index.bin`` (the
vector index and which rows it covers), ``memory.lock`` (the writers' lock).

Concurrency: every write takes an exclusive ``flock`` on ``memory.lock``, inserts its rows in one
transaction, brings its in-memory index up to date from the rows it has not indexed yet, and saves the
index file atomically (rename) when the file lags far enough behind. Readers never lock: before each
query they add the rows the index lacks, from the vectors stored in the rows (no re-embedding). A
missing or damaged index file is rebuilt from the rows with a warning.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from archive.memory import _db
from archive.memory._db import ENTRY_COLUMNS, MemoryStoreError, entry_from_row, entry_row
from archive.memory._embed import Embedder, make_embedder
from archive.memory._entry import EntryKind, MemoryEntry, MemoryHit
from archive.memory._keeper import FileLock, IndexKeeper
from archive.memory._seeding import quality_ranks, seed_score
from archive.memory._settings import MemorySettings

__all__ = ["Memory"]

_EXACT_BELOW = 4096  # a filtered search over fewer matching entries scores them all exactly
_ADD_CHUNK = 10_000  # entries embedded and inserted per transaction


class Memory:
    """A memory directory opened for reading and writing (safe with other processes doing the same).

    ``path`` defaults to ``settings.resolved_path()``; ``embedder`` to ``make_embedder(settings.embedder)``.
    The embedder must be the one the memory was created with (its vectors are only comparable to its own).
    """

    DB, INDEX, LOCK = "memory.db", "index.bin", "memory.lock"

    def __init__(self, path: str | os.PathLike[str] | None = None, *, settings: MemorySettings | None = None,
                 embedder: Embedder | None = None) -> None:
        self.settings = settings or MemorySettings()
        self.path = Path(path) if path is not None else self.settings.resolved_path()
        self.path.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # every run's discoveries: not for the sandbox user to read
            if self.path.stat().st_uid == os.geteuid():
                self.path.chmod(0o700)
        self.embedder = embedder or make_embedder(self.settings.embedder)
        self._lock = FileLock(self.path / self.LOCK)
        self._conn = _db.connect(self.path / self.DB)
        with self._lock():  # the first writer records the embedder; later ones must match it
            self._conn.execute("INSERT OR IGNORE INTO meta VALUES ('embedder', ?)", (self.embedder.name,))
            self._conn.execute("INSERT OR IGNORE INTO meta VALUES ('dim', ?)", (str(self.embedder.dim),))
        name, dim = (self._conn.execute("SELECT value FROM meta WHERE key = ?", (k,)).fetchone()[0]
                     for k in ("embedder", "dim"))
        self.dim = int(dim)
        self._wrote = False  # close() saves the index file if this process added entries it lacks
        self._keeper = IndexKeeper(self._conn, self.path / self.INDEX, self.dim, self.settings, self._lock)
        if (name, self.dim) != (self.embedder.name, self.embedder.dim):
            self.close()
            raise MemoryStoreError(
                f"{self.path}: made with embedder {name!r} (dim {dim}), not {self.embedder.name!r} "
                f"(dim {self.embedder.dim}): use that embedder, or another memory path")

    @staticmethod
    def stored_embedder(path: str | os.PathLike[str]) -> str | None:
        """The embedder a memory directory was made with (``None`` if there is no memory there)."""
        db = Path(path) / Memory.DB
        if not db.is_file():
            return None
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            row = conn.execute("SELECT value FROM meta WHERE key = 'embedder'").fetchone()
        except sqlite3.DatabaseError:
            return None
        finally:
            conn.close()
        return None if row is None else row[0]

    # -- writes ------------------------------------------------------------------------------------

    def add(self, entries: Iterable[MemoryEntry]) -> int:
        """Stores new entries (embedded in batches); returns how many were new. Duplicates (same task, task
        args, genome and hardware) are skipped."""
        added = 0
        batch: list[MemoryEntry] = []
        for e in entries:
            batch.append(e)
            if len(batch) >= _ADD_CHUNK:
                added += self._add_chunk(batch)
                batch = []
        if batch:
            added += self._add_chunk(batch)
        if added:
            self._wrote = True
            with self._lock():
                self._keeper.sync()
                self._keeper.save_if_behind()
        return added

    def _add_chunk(self, batch: list[MemoryEntry]) -> int:
        unique = list({e.id: e for e in batch}.values())
        known: set[str] = set()
        for i in range(0, len(unique), 500):
            ids = [e.id for e in unique[i : i + 500]]
            known.update(r[0] for r in self._conn.execute(
                f"SELECT id FROM entries WHERE id IN ({','.join('?' * len(ids))})", ids))
        new = [e for e in unique if e.id not in known]
        if not new:
            return 0
        vectors = self.embedder.embed([e.summary for e in new])  # outside the lock: the slow part
        with self._lock():
            if self._keeper.index is None:
                self._keeper.sync()  # before inserting: a memory without its index file yet is not "damaged"
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                before = self._conn.total_changes
                self._conn.executemany(_db.INSERT, (entry_row(e, v) for e, v in zip(new, vectors, strict=True)))
                n = self._conn.total_changes - before
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        return n

    def prune(self, keep_best_per_task: int) -> int:
        """Keeps, per (task, task args, hardware), the ``keep_best_per_task`` best improvements (by vs_reference,
        then fitness) and as many most recent failures; deletes the rest and rebuilds the index. Returns the
        number deleted."""
        if keep_best_per_task < 0:
            raise ValueError("keep_best_per_task must be >= 0")
        with self._lock():
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                cur = self._conn.execute(
                    "DELETE FROM entries WHERE row IN (SELECT row FROM (SELECT row, ROW_NUMBER() OVER ("
                    " PARTITION BY task, task_args, hardware_id, kind ORDER BY"
                    " CASE WHEN kind = 'failure' THEN -created_at ELSE 0 END,"
                    " vs_reference IS NULL, vs_reference DESC, fitness IS NULL, fitness DESC, row) AS rank"
                    " FROM entries) WHERE rank > ?)", (keep_best_per_task,))
                deleted = cur.rowcount
                if deleted:
                    self._conn.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'generation'")
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            if deleted:
                self._keeper.build()
                self._keeper.save()
        return deleted

    # -- reads -------------------------------------------------------------------------------------

    def _entries(self, rows: Iterable[int]) -> dict[int, MemoryEntry]:
        rows = [int(r) for r in rows]
        out: dict[int, MemoryEntry] = {}
        for i in range(0, len(rows), 500):
            chunk = rows[i : i + 500]
            q = f"SELECT {ENTRY_COLUMNS} FROM entries WHERE row IN ({','.join('?' * len(chunk))})"
            out.update(entry_from_row(r) for r in self._conn.execute(q, chunk))
        return out

    def _vectors(self, where: str, params: tuple[Any, ...]) -> tuple[np.ndarray, np.ndarray]:
        got = self._conn.execute(f"SELECT row, vector FROM entries WHERE {where}", params).fetchall()
        rows = np.array([r for r, _ in got], dtype=np.int64)
        vecs = np.frombuffer(b"".join(v for _, v in got), dtype=np.float32).reshape(len(got), self.dim)
        return rows, vecs

    def search(self, text: str, *, k: int = 10, task: str | None = None, kind: EntryKind | None = None
               ) -> list[MemoryHit]:
        """The ``k`` entries whose text is nearest to ``text`` (cosine), optionally of one task and/or kind."""
        with self._lock.mutex:
            return self._search_vector(self.embedder.embed([text])[0], k=k, task=task, kind=kind)

    def _search_vector(self, q: np.ndarray, *, k: int, task: str | None, kind: str | None) -> list[MemoryHit]:
        index = self._keeper.sync()
        conds = [c for c, v in (("task = ?", task), ("kind = ?", kind)) if v is not None]
        params = tuple(v for v in (task, kind) if v is not None)
        where = " AND ".join(conds) or "1"
        scored: list[tuple[float, int]] = []
        if conds and self._conn.execute(f"SELECT COUNT(*) FROM entries WHERE {where}", params).fetchone()[0] \
                <= _EXACT_BELOW:
            rows, vecs = self._vectors(where, params)
            scored = sorted(zip((vecs @ q).tolist(), rows.tolist(), strict=True), reverse=True)[:k]
        else:
            fetch = k if not conds else 4 * k
            while True:
                scores, rows = index.search(q[None, :], fetch)
                pairs = [(float(s), int(r)) for s, r in zip(scores[0], rows[0], strict=True) if r >= 0]
                if conds:
                    ok = {r for (r,) in self._conn.execute(
                        f"SELECT row FROM entries WHERE {where} AND row IN ({','.join('?' * len(pairs))})",
                        params + tuple(r for _, r in pairs))} if pairs else set()
                    pairs = [p for p in pairs if p[1] in ok]
                if len(pairs) >= k or fetch >= index.ntotal:
                    scored = pairs[:k]
                    break
                fetch *= 4
        found = self._entries(r for _, r in scored)
        return [MemoryHit(found[r], s, s) for s, r in scored if r in found]

    def nearest_for_task(self, task_name: str, task_args: Mapping[str, Any], hardware: Mapping[str, Any] | None,
                         *, k: int) -> list[MemoryHit]:
        """The ``k`` improvements best suited to seed a run of this task on this hardware, one per genome,
        ranked by :func:`archive.memory.seed_score` (similarity, task, hardware and fitness blended)."""
        if k <= 0:
            return []
        args = " ".join(f"{a}={v}" for a, v in sorted(task_args.items()))
        cpu = (hardware or {}).get("cpu_model")
        q = self.embedder.embed([f"{task_name} {args}" + (f" on {cpu}" if cpu else "")])[0]
        with self._lock.mutex:
            pool = {h.entry.id: h for h in self._search_vector(q, k=max(64, 16 * k), task=None, kind="improvement")}
            rows, vecs = self._vectors("row IN (SELECT row FROM entries WHERE task = ? AND kind = 'improvement'"
                                       " ORDER BY vs_reference IS NULL, vs_reference DESC, fitness DESC LIMIT ?)",
                                       (task_name, max(64, 16 * k)))
            sims = dict(zip(rows.tolist(), (vecs @ q).tolist(), strict=True))
            for row, entry in self._entries(sims).items():
                pool.setdefault(entry.id, MemoryHit(entry, sims[row], sims[row]))
        hits = list(pool.values())
        quality = quality_ranks([h.entry for h in hits])
        ranked = sorted(((seed_score(h.entry, h.similarity, qual, task=task_name, task_args=task_args,
                                     hardware=hardware), h) for h, qual in zip(hits, quality, strict=True)),
                        key=lambda t: -t[0])
        out, genomes = [], set()
        for score, h in ranked:
            if h.entry.genome.id not in genomes:
                genomes.add(h.entry.genome.id)
                out.append(MemoryHit(h.entry, score, h.similarity))
        return out[:k]

    def stats(self) -> dict[str, Any]:
        """Counts (total, per task, per kind), the index kind, the size on disk and the embedder."""
        index = self._keeper.sync()
        c = self._conn
        size = sum(p.stat().st_size for p in self.path.iterdir() if p.is_file())
        return {
            "path": str(self.path),
            "entries": c.execute("SELECT COUNT(*) FROM entries").fetchone()[0],
            "per_task": dict(c.execute("SELECT task, COUNT(*) FROM entries GROUP BY task ORDER BY task").fetchall()),
            "per_kind": dict(c.execute("SELECT kind, COUNT(*) FROM entries GROUP BY kind ORDER BY kind").fetchall()),
            "index": index.kind,
            "size_bytes": size,
            "embedder": self.embedder.name,
            "dim": self.dim,
        }

    def entries(self) -> Iterator[MemoryEntry]:
        """Every entry, oldest first."""
        last = 0
        while True:
            page = self._conn.execute(f"SELECT {ENTRY_COLUMNS} FROM entries WHERE row > ? ORDER BY row LIMIT 1000",
                                      (last,)).fetchall()
            for r in page:
                last, entry = entry_from_row(r)
                yield entry
            if len(page) < 1000:
                return

    # -- sharing -----------------------------------------------------------------------------------

    def export(self, file: str | os.PathLike[str]) -> int:
        """Writes every entry as one JSON line (no vectors); returns how many."""
        n = 0
        with open(file, "w") as f:
            for e in self.entries():
                f.write(json.dumps(e.to_dict(), allow_nan=False) + "\n")
                n += 1
        return n

    def import_(self, file: str | os.PathLike[str]) -> int:
        """Adds the entries of an :meth:`export` file (embedded again here); returns how many were new."""
        def read() -> Iterator[MemoryEntry]:
            with open(file) as f:
                for i, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield MemoryEntry.from_dict(json.loads(line))
                        except (ValueError, TypeError, KeyError) as exc:
                            raise MemoryStoreError(f"{file}:{i}: not a memory entry ({exc})") from None
        return self.add(read())

    def import_run(self, run_dir: str | os.PathLike[str]) -> int:
        """Adds the elites of a run directory; returns how many were new."""
        from archive.memory._run_elites import entries_from_run

        return self.add(entries_from_run(run_dir))

    def close(self) -> None:
        """Saves the index file if this process added entries it lacks, and closes the files."""
        with self._lock.mutex:
            if self._conn is None:
                return
            try:
                if self._wrote and self._keeper.index is not None:
                    with self._lock():
                        self._keeper.sync()
                        self._keeper.save_if_behind(force=True)
            finally:
                self._conn.close()
                self._conn = None  # type: ignore[assignment]
                self._lock.close()

    def __enter__(self) -> Memory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Memory({str(self.path)!r}, embedder={self.embedder.name!r})"

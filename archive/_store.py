"""The store of one run: every candidate, its lineage and its result, in one SQLite file.

Every write is its own committed transaction in WAL mode, so a candidate or result that a call has
returned for survives ``kill -9`` of the process (``synchronous=NORMAL`` can only lose the last
transactions on a power cut or OS crash, never on a process crash).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

from archive._base import QDSnapshot
from archive._candidate import COLUMNS, Candidate, dumps, from_row
from archive._errors import AmbiguousIdError, CandidateNotFoundError, StoreError
from archive._llm import LLMRecords
from archive._schema import ensure_schema
from archive._sqlite import use_wal
from genome import Genome, canonical_json
from runtime.result import EvalResult, Status

__all__ = ["PendingEntry", "Store", "is_run", "run_db"]

PendingEntry = tuple[Genome, Sequence[str], str]
"""``(genome, parent ids, operator name)``: one candidate for :meth:`Store.add_pending_many`."""

_BATCH = 500  # ids per ``IN (...)`` and rows per page when iterating
CONFIRMED_KEY = "confirmed"  # meta: JSON list of the confirmed candidates' ids, best first


class Store(LLMRecords):
    """The SQLite store of one run (``archive.db``). Use one writer process; readers may be many.

    ``path`` is the database file, or a run directory holding ``archive.db``. A new file gets the
    current schema; an existing one must have a schema this version knows
    (:class:`SchemaVersionError` otherwise). ``readonly`` opens without ever writing.
    Model calls and their cached answers: see :class:`archive._llm.LLMRecords`.
    """

    FILENAME = "archive.db"

    def __init__(self, path: str | os.PathLike[str], *, readonly: bool = False) -> None:
        p = Path(path)
        if p.is_dir():
            p = run_db(p)
        self.path = p
        self.readonly = readonly
        if readonly:
            if not p.is_file():
                raise StoreError(f"{p}: no such store")
            conn = sqlite3.connect(f"file:{quote(str(p.resolve()))}?mode=ro", uri=True, isolation_level=None)
        else:
            conn = sqlite3.connect(p, isolation_level=None)  # autocommit: transactions are explicit
        try:
            conn.execute("PRAGMA busy_timeout = 10000")
            if not readonly:
                use_wal(conn, timeout_s=10)
                conn.execute("PRAGMA synchronous = NORMAL")
            self.schema_version = ensure_schema(conn, path=str(p), readonly=readonly)
        except sqlite3.DatabaseError as exc:  # e.g. "file is not a database"
            conn.close()
            raise StoreError(f"{p}: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._hardware_ids: set[str] = set()  # fingerprints known to be stored (rows are never deleted)

    # -- lifecycle ---------------------------------------------------------------------------------

    def checkpoint(self) -> None:
        """Moves every committed write from the WAL into the database file, and empties the WAL."""
        busy, _, _ = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            raise StoreError(f"{self.path}: its WAL could not be checkpointed (another connection reads it)")

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}{', readonly=True' if self.readonly else ''})"

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One committed transaction (taken with the write lock up front, so it cannot deadlock)."""
        if self.readonly:
            raise StoreError(f"{self.path}: opened read-only")
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    # -- meta --------------------------------------------------------------------------------------

    def set_meta(self, key: str, value: str) -> None:
        """Stores a text value (the resolved config as YAML, the archive layout as JSON, ...)."""
        self.set_metas({key: value})

    def set_metas(self, values: dict[str, str]) -> None:
        """Stores several text values in one transaction: all of them, or (after a crash) none."""
        with self._write() as c:
            c.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                list(values.items()),
            )

    def get_meta(self, key: str) -> str | None:
        row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    # -- writes ------------------------------------------------------------------------------------

    def add_pending(self, *, genome: Genome, parents: Sequence[str] = (), operator: str) -> bool:
        """Stores a candidate as ``pending``; ``False`` (and no change) if its genome id is already stored."""
        return self.add_pending_many([(genome, parents, operator)]) == 1

    def add_pending_many(self, entries: Iterable[PendingEntry]) -> int:
        """Stores many candidates in one transaction; returns how many were new (duplicates are skipped)."""
        now = time.time()
        rows = []
        for genome, parents, operator in entries:
            if isinstance(parents, str):
                raise TypeError("parents must be a sequence of ids, not a string")
            rows.append((genome.id, dumps(list(parents)), operator, canonical_json(genome.params), genome.source, now))
        with self._write() as c:
            before = c.total_changes
            c.executemany(
                "INSERT INTO candidates (id, parents, operator, params, source, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO NOTHING",
                rows,
            )
            return c.total_changes - before

    def record_result(self, id: str, result: EvalResult, *, descriptors: dict[str, float] | None = None) -> None:
        """Records a pending candidate's result, its descriptors and hardware in one transaction.

        Assigns the next ``eval_seq``. A candidate's result is recorded once: recording another for an
        evaluated candidate raises :class:`StoreError`, an unknown id :class:`CandidateNotFoundError`.
        Only a confirmation may change it afterwards (:meth:`revise_result`).
        """
        self._write_result(id, result, descriptors, "pending")

    def revise_result(self, id: str, result: EvalResult, *, descriptors: dict[str, float] | None = None,
                      confirmed: Sequence[str] | None = None) -> None:  # fmt: skip
        """Replaces an ok candidate's result with what its confirmation measured (fresh evaluations after
        the search), keeping its place in the evaluation order. Any other candidate raises :class:`StoreError`.
        ``confirmed``: the run's confirmed candidates now, best first (:meth:`confirmed`), stored with it."""
        self._write_result(id, result, descriptors, "ok", confirmed)

    def _write_result(self, id: str, result: EvalResult, descriptors: dict[str, float] | None, was: str,
                      confirmed: Sequence[str] | None = None) -> None:  # fmt: skip
        if result.status == Status.PENDING:
            raise ValueError("a result cannot have status 'pending'")
        fitness = result.fitness
        if fitness is not None:
            fitness = float(fitness)
            fitness = fitness if fitness == fitness else None  # NaN -> NULL
        # a revised result keeps its place in the evaluation order and the time it was first recorded
        seq = "(SELECT COALESCE(MAX(eval_seq), 0) + 1 FROM candidates)" if was == "pending" else "eval_seq"
        at = "?" if was == "pending" else "COALESCE(evaluated_at, ?)"
        with self._write() as c:
            hardware_id = None
            if result.hardware is not None:
                text = canonical_json(result.hardware)
                hardware_id = hashlib.sha256(text.encode()).hexdigest()
                if hardware_id not in self._hardware_ids:
                    c.execute(
                        "INSERT INTO hardware (id, fingerprint) VALUES (?, ?) ON CONFLICT(id) DO NOTHING",
                        (hardware_id, text),
                    )
            cur = c.execute(
                "UPDATE candidates SET status = ?, fitness = ?, unit = ?, metrics = ?, descriptors = ?, error = ?,"
                f" timings = ?, hardware_id = ?, evaluated_at = {at}, eval_seq = {seq}"
                " WHERE id = ? AND status = ?",
                (
                    str(result.status),
                    fitness,
                    result.unit,
                    dumps(result.metrics),
                    dumps(descriptors or {}),
                    result.error,
                    dumps(result.timings),
                    hardware_id,
                    time.time(),
                    id,
                    was,
                ),
            )
            if cur.rowcount != 1:
                row = c.execute("SELECT status FROM candidates WHERE id = ?", (id,)).fetchone()
                if row is None:
                    raise CandidateNotFoundError(f"no candidate {id}")
                if was == "pending":
                    raise StoreError(f"candidate {id[:12]} is already evaluated ({row[0]}); a result is recorded once")
                raise StoreError(f"candidate {id[:12]} is {row[0]}: only an ok result is revised by a confirmation")
            if confirmed is not None:
                c.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = "
                          "excluded.value", (CONFIRMED_KEY, json.dumps(list(confirmed))))  # fmt: skip
        if hardware_id is not None:
            self._hardware_ids.add(hardware_id)  # only once committed: a rolled-back insert must be retried

    def add_qd_snapshot(
        self,
        *,
        evals: int,
        elapsed_s: float,
        coverage: float,
        qd_score: float,
        best: float | None = None,
        mean: float | None = None,
        at: float | None = None,
    ) -> None:
        """Appends one point of the run's QD progress to ``qd_history`` (``at`` defaults to now)."""
        with self._write() as c:
            c.execute(
                "INSERT INTO qd_history (evals, elapsed_s, coverage, qd_score, best, mean, at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (evals, elapsed_s, coverage, qd_score, best, mean, time.time() if at is None else at),
            )

    def add_bandit_weights(self, *, evals: int, elapsed_s: float, weights: dict[str, float],
                           at: float | None = None) -> None:  # fmt: skip
        """Appends how the adaptive operator choice weighs each operator now to ``bandit_history``."""
        with self._write() as c:
            c.execute("INSERT INTO bandit_history (evals, elapsed_s, weights, at) VALUES (?, ?, ?, ?)",
                      (evals, elapsed_s, json.dumps(weights, sort_keys=True), time.time() if at is None else at))

    # -- reads -------------------------------------------------------------------------------------

    def _select(self, where: str, params: Sequence[Any] = ()) -> list[Candidate]:
        rows = self._conn.execute(f"SELECT {COLUMNS} FROM candidates {where}", params).fetchall()
        return [from_row(r) for r in rows]

    def get(self, id: str) -> Candidate | None:
        """The candidate with this id, or with this unique id prefix (like git); ``None`` if none.

        Raises :class:`AmbiguousIdError` when the prefix matches several candidates.
        """
        key = id.strip().lower()
        found = self._select("WHERE id = ?", (key,))
        if found or not key:
            return found[0] if found else None
        upper = key[:-1] + chr(ord(key[-1]) + 1)  # the range [key, upper) holds exactly the ids with this prefix
        found = self._select("WHERE id >= ? AND id < ? ORDER BY id LIMIT 2", (key, upper))
        if len(found) > 1:
            raise AmbiguousIdError(
                f"id prefix {key!r} matches several candidates ({found[0].id[:12]}, {found[1].id[:12]}, ...);"
                " give more characters"
            )
        return found[0] if found else None

    def get_many(self, ids: Sequence[str]) -> list[Candidate]:
        """The candidates with these full ids, in the order given; unknown ids are skipped."""
        found: dict[str, Candidate] = {}
        for i in range(0, len(ids), _BATCH):
            chunk = list(ids[i : i + _BATCH])
            found.update((c.id, c) for c in self._select(f"WHERE id IN ({','.join('?' * len(chunk))})", chunk))
        return [found[i] for i in dict.fromkeys(ids) if i in found]

    def pending(self) -> list[Candidate]:
        """Candidates not yet evaluated, oldest first (what a resumed run evaluates first)."""
        return self._select("WHERE status = 'pending' ORDER BY seq")

    def evaluated(self) -> Iterator[Candidate]:
        """Every evaluated candidate in evaluation order (replaying them rebuilds the archive exactly)."""
        last = 0
        while True:
            page = self._select("WHERE eval_seq > ? ORDER BY eval_seq LIMIT ?", (last, _BATCH))
            yield from page
            if len(page) < _BATCH:
                return
            last = page[-1].eval_seq or 0

    def confirmed(self) -> list[str]:
        """Ids of the candidates the run confirmed (measured again after its search), best first as the
        confirmation ranked them; empty before any confirmation."""
        return list(json.loads(self.get_meta(CONFIRMED_KEY) or "[]"))

    def best(self, k: int = 10, *, unit: str | None = None) -> list[Candidate]:
        """The ``k`` best ok candidates, best first: the confirmed ones (:meth:`confirmed`, in that order),
        then the fittest others (ties: the earlier evaluation first). Confirmed figures were measured after
        the search, in another phase of the machine, so they are ranked by the confirmation, not by
        fitness against the figures recorded during the search."""
        first = [c for c in self.get_many(self.confirmed())
                 if c.status == Status.OK and c.fitness is not None and unit in (None, c.unit)][:k]  # fmt: skip
        where, params = "", []
        if unit is not None:
            where, params = " AND unit = ?", [unit]
        if first:
            where += f" AND id NOT IN ({','.join('?' * len(first))})"
            params += [c.id for c in first]
        # INDEXED BY: without ANALYZE statistics the planner would favour the status index and sort every
        # ok row; the partial index is already in answer order, so LIMIT k reads about k entries.
        return first + self._select(
            "INDEXED BY candidates_best WHERE status = 'ok' AND fitness IS NOT NULL"
            f"{where} ORDER BY fitness DESC, eval_seq LIMIT ?",
            [*params, k - len(first)],
        )

    def by_status(self, status: Status | str, limit: int = 100) -> list[Candidate]:
        """Candidates with this status, newest first."""
        return self._select("WHERE status = ? ORDER BY seq DESC LIMIT ?", (str(Status(status)), limit))

    def by_operator(self, operator: str, limit: int = 100) -> list[Candidate]:
        """Candidates proposed by this operator, newest first."""
        return self._select("WHERE operator = ? ORDER BY seq DESC LIMIT ?", (operator, limit))

    def counts_by_status(self) -> dict[Status, int]:
        rows = self._conn.execute("SELECT status, COUNT(*) FROM candidates GROUP BY status ORDER BY status")
        return {Status(s): n for s, n in rows}

    def counts_by_operator(self) -> dict[str, int]:
        rows = self._conn.execute("SELECT operator, COUNT(*) FROM candidates GROUP BY operator ORDER BY operator")
        return dict(rows.fetchall())

    def count(self, status: Status | str | None = None) -> int:
        """How many candidates are stored (with this status, if given)."""
        if status is None:
            return int(self._conn.execute("SELECT COUNT(*) FROM candidates").fetchone()[0])
        return int(
            self._conn.execute("SELECT COUNT(*) FROM candidates WHERE status = ?", (str(Status(status)),)).fetchone()[0]
        )

    def lineage(self, id: str) -> list[Candidate]:
        """The candidate, then all its stored ancestors breadth-first, each once (nearest generations first)."""
        start = self.get(id)
        if start is None:
            raise CandidateNotFoundError(f"no candidate {id}")
        out, seen, frontier = [start], {start.id}, list(start.parents)
        while frontier:
            ids = [p for p in dict.fromkeys(frontier) if p not in seen]
            seen.update(ids)
            level = self.get_many(ids)  # parents not in the store (e.g. external seeds) are skipped
            out.extend(level)
            frontier = [p for c in level for p in c.parents]
        return out

    def hardware(self, hardware_id: str) -> dict[str, Any] | None:
        """The hardware fingerprint stored under this id (see :attr:`Candidate.hardware_id`)."""
        row = self._conn.execute("SELECT fingerprint FROM hardware WHERE id = ?", (hardware_id,)).fetchone()
        return None if row is None else json.loads(row[0])

    def qd_history(self) -> list[QDSnapshot]:
        """The QD progress snapshots, in the order they were taken."""
        rows = self._conn.execute(
            "SELECT evals, elapsed_s, coverage, qd_score, best, mean, at FROM qd_history ORDER BY rowid"
        )
        return [
            QDSnapshot(evals=e, elapsed_s=s, coverage=c, qd_score=q, best=b, mean=m, at=at)
            for e, s, c, q, b, m, at in rows
        ]

    def marker(self) -> tuple[int, int, int]:
        """(candidates, last evaluation, QD snapshots): changes whenever the run records something."""
        row = self._conn.execute("SELECT COUNT(*), COALESCE(MAX(eval_seq), 0), (SELECT COUNT(*) FROM qd_history) "
                                 "FROM candidates").fetchone()  # fmt: skip
        return int(row[0]), int(row[1]), int(row[2])

    def bandit_history(self) -> list[tuple[int, float, dict[str, float]]]:
        """``(evals, elapsed_s, weights)`` of the adaptive operator choice, in order; empty without a bandit
        (and for runs stored before it was kept)."""
        if self.schema_version < 3:
            return []
        rows = self._conn.execute("SELECT evals, elapsed_s, weights FROM bandit_history ORDER BY rowid")
        return [(e, s, json.loads(w)) for e, s, w in rows]


def run_db(run_dir: str | os.PathLike[str]) -> Path:
    """The store file of the run in ``run_dir`` (what a user opens with ``sqlite3``)."""
    return Path(run_dir) / Store.FILENAME


def is_run(run_dir: str | os.PathLike[str]) -> bool:
    """Whether ``run_dir`` holds a run: its store file, there once ``evo run`` has started in it."""
    return run_db(run_dir).is_file()

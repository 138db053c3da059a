"""Opening an SQLite file that several processes write at once."""

from __future__ import annotations

import sqlite3
import time

__all__ = ["use_wal"]


def use_wal(conn: sqlite3.Connection, *, timeout_s: float) -> None:
    """Puts ``conn``'s database in WAL mode, waiting up to ``timeout_s`` for other writers.

    Switching the journal mode needs an exclusive lock, and SQLite answers "database is locked" at once,
    without its busy handler, when another connection is creating or switching the same file: two
    processes that open a new file together would otherwise fail on the first statement.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)

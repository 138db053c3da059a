"""The SQLite schema of a run's store, its version, and the check made when a store is opened.

A run is one file a user can open with ``sqlite3``::

    sqlite3 runs/x/archive.db "SELECT id, fitness, unit FROM candidates WHERE status='ok'
                                ORDER BY fitness DESC LIMIT 5"
    sqlite3 runs/x/archive.db "SELECT value FROM meta WHERE key='confirmed'"   # the run's best first

Figures confirmed after the search were measured in another phase of the machine than those recorded
during it, so the run's best are the ids in ``meta`` key ``confirmed`` (in order), then the fittest others.

``candidates.seq`` is the rowid (order of creation), so appending a candidate appends to the table;
``id`` (the genome id) is ``UNIQUE``. JSON columns hold JSON text (``json_extract`` works on them).
"""

from __future__ import annotations

import sqlite3

from archive._errors import SchemaVersionError

__all__ = ["SCHEMA_VERSION", "ensure_schema"]

SCHEMA_VERSION = 3

_DDL = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE hardware (id TEXT PRIMARY KEY, fingerprint TEXT NOT NULL)",
    """CREATE TABLE candidates (
        id           TEXT NOT NULL UNIQUE,      -- genome id: sha256 of canonical (params, source)
        seq          INTEGER PRIMARY KEY,       -- order of creation (the rowid)
        parents      TEXT NOT NULL DEFAULT '[]',-- JSON list of parent ids
        operator     TEXT NOT NULL,             -- the variation operator that proposed it ('seed', ...)
        params       TEXT NOT NULL,             -- JSON object
        source       TEXT,                      -- NULL: the task's template filled with params
        status       TEXT NOT NULL DEFAULT 'pending',
        fitness      REAL,                      -- higher is better, in unit; NULL unless status='ok'
        unit         TEXT NOT NULL DEFAULT '',
        metrics      TEXT NOT NULL DEFAULT '{}',
        descriptors  TEXT NOT NULL DEFAULT '{}',
        error        TEXT,
        timings      TEXT NOT NULL DEFAULT '{}',
        hardware_id  TEXT REFERENCES hardware(id),
        created_at   REAL NOT NULL,             -- unix seconds
        evaluated_at REAL,
        eval_seq     INTEGER UNIQUE             -- order of evaluation; NULL while pending
    )""",
    # Best-k: a partial index already in answer order, so ORDER BY ... LIMIT k reads k entries.
    "CREATE INDEX candidates_best ON candidates(fitness DESC, eval_seq) WHERE status = 'ok' AND fitness IS NOT NULL",
    "CREATE INDEX candidates_status ON candidates(status, seq)",
    "CREATE INDEX candidates_operator ON candidates(operator, seq)",
    """CREATE TABLE qd_history (
        evals     INTEGER NOT NULL,  -- evaluations recorded when the snapshot was taken
        elapsed_s REAL NOT NULL,     -- seconds since the run started
        coverage  REAL NOT NULL,     -- filled cells / cells
        qd_score  REAL NOT NULL,     -- sum over elites of (fitness - qd_offset)
        best      REAL,              -- best elite fitness (NULL while the archive is empty)
        mean      REAL,              -- mean elite fitness
        at        REAL NOT NULL      -- unix seconds
    )""",
)

# Version 2: model calls of LLM-guided operators, and their responses cached by prompt hash.
_LLM_DDL = (
    """CREATE TABLE llm_calls (
        seq          INTEGER PRIMARY KEY,       -- order of recording
        at           REAL NOT NULL,             -- unix seconds the answer arrived
        proposal     TEXT NOT NULL,             -- one proposal may make several calls (a retry, agent steps)
        operator     TEXT NOT NULL,             -- llm_diff, llm_rewrite, llm_params, agentic
        model        TEXT NOT NULL,
        prompt_hash  TEXT NOT NULL,             -- sha256 of (model, messages, sampling, tools)
        slot         INTEGER NOT NULL,          -- n-th ask of this prompt in a session (the cache key with the hash)
        cached       INTEGER NOT NULL,          -- 1: replayed from llm_responses, nothing paid
        tokens_in    INTEGER NOT NULL DEFAULT 0,
        tokens_out   INTEGER NOT NULL DEFAULT 0,
        latency_s    REAL NOT NULL DEFAULT 0,
        outcome      TEXT NOT NULL,             -- error rejected step duplicate applied compiled correct improved
        reason       TEXT,                      -- why it was rejected or failed
        candidate_id TEXT,                      -- the child it produced (NULL when none)
        transcript   TEXT                       -- JSON messages of an agentic loop (on its last call)
    )""",
    "CREATE INDEX llm_calls_candidate ON llm_calls(candidate_id)",
    """CREATE TABLE llm_responses (
        prompt_hash TEXT NOT NULL,
        slot        INTEGER NOT NULL,
        model       TEXT NOT NULL,
        response    TEXT NOT NULL,              -- JSON: text, tool_calls, tokens_in, tokens_out
        created_at  REAL NOT NULL,
        PRIMARY KEY (prompt_hash, slot)
    )""",
)
# Version 3: how an adaptive operator choice (the bandit) weighed the operators as the run went on.
_BANDIT_DDL = (
    """CREATE TABLE bandit_history (
        evals     INTEGER NOT NULL,  -- evaluations recorded when the weights were taken
        elapsed_s REAL NOT NULL,     -- seconds since the run started
        weights   TEXT NOT NULL,     -- JSON object: operator -> expected reward of its next child
        at        REAL NOT NULL      -- unix seconds
    )""",
)
_DDL = _DDL + _LLM_DDL + _BANDIT_DDL

# from_version -> statements that bring a store to from_version + 1.
_MIGRATIONS: dict[int, tuple[str, ...]] = {1: _LLM_DDL, 2: _BANDIT_DDL}


def ensure_schema(conn: sqlite3.Connection, *, path: str, readonly: bool) -> int:
    """Creates the schema in an empty database, migrates an older one, refuses a newer or foreign one;
    returns the version the store now has. Read-only, an older store is read as it is: its missing
    tables read as empty (a report of an old run shows what the run kept)."""
    conn.execute("BEGIN" if readonly else "BEGIN IMMEDIATE")
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            if readonly:
                raise SchemaVersionError(f"{path}: empty database, not an evoforge store")
            for stmt in _DDL:
                conn.execute(stmt)
            conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            conn.execute("COMMIT")
            return SCHEMA_VERSION
        version = _read_version(conn, tables, path)
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{path}: schema version {version} was written by a newer evoforge "
                f"(this one reads up to {SCHEMA_VERSION}); upgrade evoforge to open it"
            )
        if version < SCHEMA_VERSION and not readonly:
            for v in range(version, SCHEMA_VERSION):
                if v not in _MIGRATIONS:
                    raise SchemaVersionError(f"{path}: no migration from schema version {v}")
                for stmt in _MIGRATIONS[v]:
                    conn.execute(stmt)
            conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
            version = SCHEMA_VERSION
        conn.execute("COMMIT")
        return version
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _read_version(conn: sqlite3.Connection, tables: set[str], path: str) -> int:
    row = None
    if "meta" in tables:
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None:
        raise SchemaVersionError(f"{path}: not an evoforge store (no schema_version in a meta table)")
    try:
        return int(row[0])
    except ValueError:
        raise SchemaVersionError(f"{path}: unknown schema version {row[0]!r}") from None

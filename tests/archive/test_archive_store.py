"""The SQLite store: candidates round-trip, dedup, results, queries, lineage and schema versions."""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

import pytest
from archive_testlib import genome, ok

from archive import (
    AmbiguousIdError,
    Candidate,
    CandidateNotFoundError,
    SchemaVersionError,
    Store,
    StoreError,
)
from genome import Genome
from runtime.result import EvalResult, Status


def test_pending_round_trip(store: Store) -> None:
    g = Genome(params={"MC": 64, "unroll": 4}, source="int main(void) { return 0; }")
    assert store.add_pending(genome=g, parents=["p1", "p2"], operator="llm_diff")
    c = store.get(g.id)
    assert isinstance(c, Candidate)
    assert (c.id, c.seq, c.parents, c.operator, c.status) == (g.id, 1, ("p1", "p2"), "llm_diff", Status.PENDING)
    assert c.params == {"MC": 64, "unroll": 4} and c.source == g.source
    assert c.genome == g and c.genome.id == c.id
    assert c.fitness is None and c.eval_seq is None and c.evaluated_at is None and c.created_at > 0
    json.dumps(c.to_dict())  # JSON-ready


def test_dedup_by_genome_id(store: Store) -> None:
    assert store.add_pending(genome=genome(1), operator="random")
    assert not store.add_pending(genome=genome(1), parents=["x"], operator="mutate")
    assert store.get(genome(1).id).operator == "random"  # the first proposal is kept
    assert store.add_pending_many([(genome(i), [], "random") for i in (1, 2, 3, 3)]) == 2
    assert store.count() == 3
    assert [c.id for c in store.pending()] == [genome(i).id for i in (1, 2, 3)]  # creation order


def test_parents_must_be_a_list(store: Store) -> None:
    with pytest.raises(TypeError):
        store.add_pending(genome=genome(1), parents="abc", operator="x")  # type: ignore[arg-type]


def test_record_result(store: Store) -> None:
    for i in range(3):
        store.add_pending(genome=genome(i), operator="random")
    hw = {"cpu": "Xeon", "cores": 2}
    res = ok(12.5, error=None, timings={"compile": 0.2, "total": 0.4}, hardware=hw)
    res.metrics["spread"] = float("nan")  # SQLite's JSON cannot hold NaN: stored as null
    store.record_result(genome(2).id, res, descriptors={"intensity": 0.5})
    store.record_result(genome(0).id, EvalResult(status=Status.WRONG, error="max err 1e-2", hardware=hw))
    c = store.get(genome(2).id)
    assert (c.status, c.fitness, c.unit, c.eval_seq) == (Status.OK, 12.5, "GFLOP/s", 1)
    assert c.metrics == {"vs_reference": 1.25, "spread": None}
    assert c.descriptors == {"intensity": 0.5} and c.timings == {"compile": 0.2, "total": 0.4}
    assert c.evaluated_at >= c.created_at
    assert store.hardware(c.hardware_id) == hw
    w = store.get(genome(0).id)
    assert (w.status, w.fitness, w.error, w.eval_seq) == (Status.WRONG, None, "max err 1e-2", 2)
    assert w.hardware_id == c.hardware_id  # one hardware row, shared
    assert store._conn.execute("SELECT COUNT(*) FROM hardware").fetchone()[0] == 1
    assert [c.id for c in store.pending()] == [genome(1).id]
    assert [c.id for c in store.evaluated()] == [genome(2).id, genome(0).id]  # evaluation order
    # json_extract works on the JSON columns
    row = store._conn.execute("SELECT json_extract(metrics, '$.vs_reference') FROM candidates WHERE eval_seq=1")
    assert row.fetchone()[0] == 1.25


def test_result_is_recorded_once(store: Store) -> None:
    store.add_pending(genome=genome(1), operator="random")
    store.record_result(genome(1).id, ok(1.0))
    with pytest.raises(StoreError, match="already evaluated"):
        store.record_result(genome(1).id, ok(2.0))
    assert store.get(genome(1).id).fitness == 1.0
    with pytest.raises(CandidateNotFoundError):
        store.record_result("0" * 64, ok(2.0))
    with pytest.raises(ValueError):
        store.record_result(genome(1).id, EvalResult(status=Status.PENDING))


def test_best_k(store: Store) -> None:
    fits = [3.0, None, 7.0, 7.0, 1.0, 9.0]
    for i, f in enumerate(fits):
        store.add_pending(genome=genome(i), operator="random")
        store.record_result(genome(i).id, ok(f) if f is not None else EvalResult(status=Status.CRASH))
    store.add_pending(genome=genome(99), operator="random")
    store.record_result(genome(99).id, EvalResult(status=Status.OK, fitness=100.0, unit="GB/s"))
    best = store.best(4, unit="GFLOP/s")
    assert [c.fitness for c in best] == [9.0, 7.0, 7.0, 3.0]
    assert [best[1].id, best[2].id] == [genome(2).id, genome(3).id]  # ties: earlier evaluation first
    assert store.best(1)[0].fitness == 100.0
    assert len(store.best(100)) == 6  # only ok candidates with a fitness
    plan = store._conn.execute(
        "EXPLAIN QUERY PLAN SELECT * FROM candidates INDEXED BY candidates_best"
        " WHERE status = 'ok' AND fitness IS NOT NULL ORDER BY fitness DESC, eval_seq LIMIT 10"
    ).fetchall()
    assert not any("TEMP B-TREE" in str(r) for r in plan)  # answered from the index, no sort


def test_best_k_puts_the_confirmed_first_in_their_order(store: Store) -> None:
    """Figures confirmed after the search come from another phase of the machine than those recorded during
    it: the confirmed rank first, in the order the confirmation gave, then the fittest others."""
    for i, f in enumerate([9.0, 7.0, 5.0, 3.0]):
        store.add_pending(genome=genome(i), operator="random")
        store.record_result(genome(i).id, ok(f))
    assert store.confirmed() == []
    ids = [genome(i).id for i in range(4)]
    store.revise_result(ids[2], ok(4.0), confirmed=[ids[2]])
    store.revise_result(ids[3], ok(2.0), confirmed=[ids[3], ids[2]])  # the lower figure, the higher rank
    assert store.confirmed() == [ids[3], ids[2]]
    assert [c.id for c in store.best(10)] == [ids[3], ids[2], ids[0], ids[1]]
    assert [c.id for c in store.best(3)] == [ids[3], ids[2], ids[0]] and [c.id for c in store.best(1)] == [ids[3]]
    assert store.best(10, unit="GB/s") == []
    store.revise_result(ids[3], EvalResult(status=Status.WRONG, error="max error 2"))  # out: no longer ok
    assert [c.id for c in store.best(10)] == [ids[2], ids[0], ids[1]]


def test_counts_and_filters(store: Store) -> None:
    ops = ["random", "mutate", "mutate", "crossover"]
    for i, op in enumerate(ops):
        store.add_pending(genome=genome(i), operator=op)
    store.record_result(genome(0).id, ok(1.0))
    store.record_result(genome(1).id, EvalResult(status=Status.COMPILE_ERROR, error="syntax"))
    assert store.counts_by_status() == {"ok": 1, "compile_error": 1, "pending": 2}
    assert store.counts_by_operator() == {"random": 1, "mutate": 2, "crossover": 1}
    assert store.count() == 4 and store.count("pending") == 2
    assert [c.id for c in store.by_operator("mutate")] == [genome(2).id, genome(1).id]  # newest first
    assert [c.id for c in store.by_operator("mutate", limit=1)] == [genome(2).id]
    assert [c.error for c in store.by_status(Status.COMPILE_ERROR)] == ["syntax"]
    with pytest.raises(ValueError):
        store.by_status("okk")


def test_lineage_breadth_first_each_once(store: Store) -> None:
    # a <- b, a <- c, (b, c) <- d, d <- e; 'ext' is a parent the store never saw
    g = {n: Genome(params={"n": n}) for n in "abcde"}
    store.add_pending(genome=g["a"], parents=["ext"], operator="seed")
    store.add_pending(genome=g["b"], parents=[g["a"].id], operator="mutate")
    store.add_pending(genome=g["c"], parents=[g["a"].id], operator="mutate")
    store.add_pending(genome=g["d"], parents=[g["b"].id, g["c"].id], operator="crossover")
    store.add_pending(genome=g["e"], parents=[g["d"].id], operator="mutate")
    names = {v.id: k for k, v in g.items()}
    assert [names[c.id] for c in store.lineage(g["e"].id)] == list("edbca")
    assert [names[c.id] for c in store.lineage(g["a"].id[:8])] == ["a"]
    with pytest.raises(CandidateNotFoundError):
        store.lineage("f" * 64)


def test_get_by_prefix(store: Store) -> None:
    ids = []
    for i in range(300):  # enough ids that some share a first hex digit
        store.add_pending(genome=genome(i), operator="random")
        ids.append(genome(i).id)
    target = ids[5]
    assert store.get(target[:12]).id == target
    assert store.get(target[:12].upper()).id == target
    assert store.get("") is None and store.get("z" * 5) is None
    first = target[0]
    with pytest.raises(AmbiguousIdError, match="matches several"):
        store.get(first)
    with pytest.raises(KeyError):  # callers may catch it as a KeyError
        store.get(first)
    assert store.get_many([ids[2], "nope", ids[1]]) == [store.get(ids[2]), store.get(ids[1])]


def test_meta_and_qd_history(store: Store) -> None:
    assert store.get_meta("config") is None
    store.set_meta("config", "task: matmul\n")
    store.set_meta("config", "task: softmax\n")
    assert store.get_meta("config") == "task: softmax\n"
    store.add_qd_snapshot(evals=10, elapsed_s=1.5, coverage=0.1, qd_score=12.0, best=4.0, mean=3.0, at=100.0)
    store.add_qd_snapshot(evals=20, elapsed_s=3.0, coverage=0.0, qd_score=0.0)
    h = store.qd_history()
    assert [(s.evals, s.coverage, s.best, s.at) for s in h][0] == (10, 0.1, 4.0, 100.0)
    assert h[1].best is None and h[1].at > 100.0


def test_reopen_and_readonly(tmp_path: Path) -> None:
    with Store(tmp_path) as s:  # a run directory is accepted: the store is its archive.db
        s.add_pending(genome=genome(1), operator="random")
        s.record_result(genome(1).id, ok(2.0))
    assert (tmp_path / "archive.db").is_file()
    assert sqlite3.connect(tmp_path / "archive.db").execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with Store(tmp_path / "archive.db", readonly=True) as r:
        assert r.best(1)[0].fitness == 2.0
        with pytest.raises(StoreError, match="read-only"):
            r.add_pending(genome=genome(2), operator="random")
    with pytest.raises(StoreError, match="no such store"):
        Store(tmp_path / "missing.db", readonly=True)


def test_refuses_newer_or_foreign_databases(tmp_path: Path) -> None:
    path = tmp_path / "archive.db"
    Store(path).close()
    con = sqlite3.connect(path)
    con.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    con.commit()
    con.close()
    with pytest.raises(SchemaVersionError, match="schema version 99 .* newer evoforge"):
        Store(path)
    con = sqlite3.connect(tmp_path / "other.db")
    con.execute("CREATE TABLE t (x)")
    con.close()
    with pytest.raises(SchemaVersionError, match="not an evoforge store"):
        Store(tmp_path / "other.db")
    (tmp_path / "junk.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError):
        Store(tmp_path / "junk.db")


def test_non_finite_values_are_stored_as_null(store: Store) -> None:
    store.add_pending(genome=genome(1), operator="random")
    res = EvalResult(status=Status.OK, fitness=math.nan, metrics={"x": [1.0, math.inf]})
    store.record_result(genome(1).id, res, descriptors={"d": math.nan})
    c = store.get(genome(1).id)
    assert c.fitness is None and c.metrics == {"x": [1.0, None]} and c.descriptors == {"d": None}
    assert store.best(5) == []

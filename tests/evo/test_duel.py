"""Duels: which results are held back, how a duel's ratio settles the challenger's fitness, and a real
search whose would-be new bests are re-timed against the best in the sandboxed workers."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest
import yaml

from evo.duel import settle, wants_duel
from runtime.result import EvalResult, Status

pytestmark = pytest.mark.exclusive  # it measures time


def _ok(fitness: float, **metrics) -> EvalResult:
    return EvalResult(status=Status.OK, fitness=fitness, unit="GFLOP/s", metrics=metrics)


@pytest.mark.parametrize(("fitness", "best", "expected"), [
    (100.5, 100.0, True), (110.0, 100.0, True), (7900.0, 100.0, True),  # big claims need proof too
    (100.0, 100.0, False), (90.0, 100.0, False),  # not a new best
    (105.0, None, False),  # nothing to duel
])
def test_every_would_be_best_is_held_for_a_duel(fitness, best, expected):
    assert wants_duel(_ok(fitness), best) is expected
    assert not wants_duel(EvalResult(status=Status.WRONG), best)


def test_a_lost_duel_caps_the_fitness_where_the_side_by_side_timing_puts_it():
    challenger = _ok(105.0, vs_reference=1.05)
    lost = settle(challenger, _ok(90.0, duel_ratio=0.9), "best", 100.0)
    assert lost.fitness == pytest.approx(90.0) and lost.metrics["fitness_before_duel"] == 105.0
    assert lost.metrics["duel"] == {"rival": "best", "rival_fitness": 100.0, "ratio": 0.9, "won": False}
    # Won: crowned at its claim, cut to where the duel puts it (the best times the ratio) when it says less.
    won = settle(challenger, _ok(120.0, duel_ratio=1.02), "best", 100.0)  # its claim was luckier than the duel
    assert won.fitness == pytest.approx(102.0) and won.metrics["duel"]["won"] is True
    assert won.metrics["fitness_before_duel"] == 105.0 and won.metrics["vs_reference"] == pytest.approx(1.02)
    clear = settle(challenger, _ok(120.0, duel_ratio=1.3), "best", 100.0)  # the duel says more than it claimed
    assert clear.fitness == 105.0 and "fitness_before_duel" not in clear.metrics  # never above its claim
    # With both vs_reference known, they are compared: the machine ran 30% slower when the best was timed.
    drifted = settle(_ok(140.0, vs_reference=1.12), _ok(1.0, duel_ratio=1.05), "best", 100.0, 1.0)
    assert drifted.fitness == pytest.approx(140.0 * 1.05 / 1.12)
    assert drifted.metrics["vs_reference"] == pytest.approx(1.05)
    honest = settle(_ok(140.0, vs_reference=1.04), _ok(1.0, duel_ratio=1.05), "best", 100.0, 1.0)
    assert honest.fitness == 140.0  # not cut to 105 by the best's raw figure from a slower moment
    # the machine ran slower for the challenger's own timing: the cut would rank it under the best it beat
    slow = settle(_ok(101.0, vs_reference=1.2), _ok(1.0, duel_ratio=1.05), "best", 100.0, 1.0)
    assert slow.fitness == pytest.approx(105.0)  # ranked above the best by the ratio...
    assert slow.metrics["vs_reference"] == pytest.approx(1.05)  # ...its ratio to BLAS the cut one, not inflated
    crashed = settle(challenger, EvalResult(status=Status.CRASH, error="SIGSEGV"), "best", 100.0)
    assert crashed.fitness == 100.0 and crashed.metrics["duel"]["error"] == "SIGSEGV"  # no verdict: not crowned
    stopped = settle(challenger, None, "best", 100.0)
    assert stopped.fitness == 100.0 and stopped.metrics["duel"]["error"] == "the run stopped first"
    wrong = settle(challenger, EvalResult(status=Status.WRONG, error="max error 3 in output 'y'"), "best", 100.0)
    assert wrong.status == Status.WRONG and wrong.fitness is None and wrong.metrics["fitness_before_duel"] == 105.0
    over_budget = settle(challenger, EvalResult(status=Status.OK, fitness=None, metrics={"duel_ratio": 1.2}),
                         "best", 100.0)  # an engine faster in the duel but over its p99 budget there
    assert over_budget.fitness == 100.0 and over_budget.metrics["duel"]["won"] is False


def test_a_search_duels_its_would_be_bests(tmp_path):
    """Every new best but the first is a duel, run by a sandboxed worker against the best of the moment."""
    cfg = {
        "task": {"name": "softmax", "args": {"rows": 64, "cols": 256}},
        "evaluation": {"timing": {"max_seconds": 0.05, "max_repeats": 20}, "check_trials": 1},
        "search": {"workers": 2, "initial_random": 4},
        "budget": {"max_evals": 12},
        "archive": {"descriptors": ["vector_width"], "bins": 4},
        "memory": {"enabled": False},
    }
    path = tmp_path / "duel.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "evo", "run", str(path), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with sqlite3.connect(tmp_path / "run" / "archive.db") as db:
        rows = [(cid, fitness, json.loads(m)) for cid, fitness, m in
                db.execute("SELECT id, fitness, metrics FROM candidates WHERE status = 'ok' ORDER BY eval_seq")]
    # the figures as the search recorded them: the best was confirmed after the search (tests/evo/test_confirm.py)
    assert any("confirmed" in m for _, _, m in rows)
    rows = [(cid, m["confirmed"]["recorded_fitness"] if "confirmed" in m else f, m) for cid, f, m in rows]
    assert len(rows) == 12  # every held result was recorded once, after its duel
    duels = [(cid, f, m["duel"], m) for cid, f, m in rows if "duel" in m]
    assert duels, "no duel happened"
    ids = {cid for cid, _, _ in rows}
    for cid, fitness, duel, m in duels:
        assert duel["rival"] in ids and duel["rival"] != cid and duel["ratio"] > 0
        if duel["won"]:  # crowned at its claim, or cut toward where the ratio puts it; always above the best
            claimed = m.get("fitness_before_duel", fitness)
            assert fitness > duel["rival_fitness"]
            assert fitness <= max(claimed, duel["rival_fitness"] * duel["ratio"]) * (1 + 1e-9)
        else:
            assert fitness == pytest.approx(duel["rival_fitness"] * duel["ratio"]) and fitness <= duel["rival_fitness"]
    best = None
    for cid, fitness, m in rows:  # in the order they were recorded: a claim above the best was dueled
        claimed = m.get("fitness_before_duel", fitness)
        if best is not None and claimed > best:
            assert "duel" in m, (cid, claimed, best)
        best = fitness if best is None else max(best, fitness)


def test_a_stored_duel_margin_is_migrated_with_a_note(tmp_path):
    cfg = {
        "task": {"name": "softmax", "args": {"rows": 16, "cols": 64}},
        "evaluation": {"timing": {"max_seconds": 0.02, "max_repeats": 5}, "check_trials": 1},
        "search": {"workers": 1, "initial_random": 1, "duel_margin": 0.1},
        "budget": {"max_evals": 2},
        "archive": {"descriptors": ["vector_width"], "bins": 2},
        "memory": {"enabled": False},
    }
    path, run = tmp_path / "old.yaml", tmp_path / "run"
    path.write_text(yaml.safe_dump(cfg))
    evo = [sys.executable, "-m", "evo", "run", str(path), "--run-dir", str(run)]
    first = subprocess.run(evo, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "search.duel_margin is obsolete and ignored" in first.stderr
    with sqlite3.connect(run / "archive.db") as db:  # a run stored by an earlier version still names it
        (stored,) = db.execute("SELECT value FROM meta WHERE key = 'config'").fetchone()
        old = yaml.safe_load(stored)
        assert "duel_margin" not in old["search"]
        old["search"]["duel_margin"] = 0.1
        db.execute("UPDATE meta SET value = ? WHERE key = 'config'", (yaml.safe_dump(old),))
    resumed = subprocess.run([*evo, "--resume", "--max-evals", "3"], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "stored config): search.duel_margin is obsolete" in resumed.stderr


def test_a_rival_that_broke_a_rule_loses_its_duel_and_the_challenger_stands():
    challenger = _ok(105.0, vs_reference=1.05)
    duel = EvalResult(status=Status.OK, metrics={"rival_failed": "wrong output 'C'", "rival_status": "wrong"})
    settled = settle(challenger, duel, "best", 100.0)
    assert settled.fitness == 105.0 and settled.status == Status.OK
    assert settled.metrics["duel"]["won"] is True and settled.metrics["duel"]["rival_failed"] == "wrong output 'C'"


# A kernel right in its own evaluation (the checks start small) that answers zeros whenever its first call is
# at the timed size: it is a duel's rival then, and the challenger's outputs were once compared with its own.
THRONE_DEFENDER = """
static int calls, defending;
void kernel(int M, int N, int K, const float *A, const float *B, float *C) {
    if (calls++ == 0 && M == 64) defending = 1;
    for (int i = 0; i < M * N; i++) C[i] = 0.0f;
    if (defending) return;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++)
            for (int k = 0; k < K; k++) C[i * N + j] += A[i * K + k] * B[k * N + j];
}
"""
FASTER = """
void kernel(int M, int N, int K, const float *A, const float *B, float *C) {
    for (int i = 0; i < M * N; i++) C[i] = 0.0f;
    for (int i = 0; i < M; i++)
        for (int k = 0; k < K; k++) {
            float a = A[i * K + k];
            for (int j = 0; j < N; j++) C[i * N + j] += a * B[k * N + j];
        }
}
"""


def test_a_best_that_defends_its_throne_is_demoted_by_the_duel(tmp_path):
    """The defender is crowned first; the faster honest kernel's duel checks both against the reference, so the
    defender's zeros are its own failure: it is demoted to wrong and the challenger is crowned."""
    (tmp_path / "throne.py").write_text(
        "from genome import Genome\nfrom runtime.tasks.matmul import Matmul\n\n"
        f"class Throne(Matmul):\n    def seeds(self):\n"
        f"        return [Genome(source={THRONE_DEFENDER!r}), Genome(source={FASTER!r})]\n"
    )
    cfg = {
        "task": {"name": "throne:Throne", "args": {"m": 64, "n": 64, "k": 64}},
        "evaluation": {"timing": {"max_seconds": 0.05, "max_repeats": 20}, "check_trials": 1},
        "search": {"workers": 1, "initial_random": 0, "confirm": {"repeats": 0}},
        "budget": {"max_evals": 2},
        "archive": {"descriptors": ["source_lines"], "bins": 4},
        "memory": {"enabled": False},
    }
    path = tmp_path / "throne.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "evo", "run", str(path), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with sqlite3.connect(tmp_path / "run" / "archive.db") as db:
        rows = {src: (status, error, json.loads(m)) for src, status, error, m in db.execute(
            "SELECT source, status, error, metrics FROM candidates")}  # fmt: skip
    status, error, _ = rows[THRONE_DEFENDER]
    assert status == "wrong" and "as the rival of" in error, (status, error)
    status, error, metrics = rows[FASTER]
    assert status == "ok" and metrics["duel"]["won"] is True and "rival_failed" in metrics["duel"], metrics

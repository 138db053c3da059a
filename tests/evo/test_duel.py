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


def _ok(fitness: float, **metrics) -> EvalResult:
    return EvalResult(status=Status.OK, fitness=fitness, unit="GFLOP/s", metrics=metrics)


@pytest.mark.parametrize(("fitness", "best", "margin", "expected"), [
    (105.0, 100.0, 0.1, True), (110.0, 100.0, 0.1, True), (111.0, 100.0, 0.1, False),  # far ahead: no doubt
    (100.0, 100.0, 0.1, False), (90.0, 100.0, 0.1, False),  # not a new best
    (105.0, None, 0.1, False), (105.0, 100.0, 0.0, False),  # nothing to duel, duels off
])
def test_only_a_narrow_would_be_best_is_held_for_a_duel(fitness, best, margin, expected):
    assert wants_duel(_ok(fitness), best, margin) is expected
    assert not wants_duel(EvalResult(status=Status.WRONG), best, margin)


def test_a_lost_duel_caps_the_fitness_where_the_side_by_side_timing_puts_it():
    challenger = _ok(105.0, vs_reference=1.05)
    lost = settle(challenger, _ok(90.0, duel_ratio=0.9), "best", 100.0)
    assert lost.fitness == pytest.approx(90.0) and lost.metrics["fitness_before_duel"] == 105.0
    assert lost.metrics["duel"] == {"rival": "best", "rival_fitness": 100.0, "ratio": 0.9, "won": False}
    won = settle(challenger, _ok(120.0, duel_ratio=1.02), "best", 100.0)
    assert won.fitness == 105.0 and won.metrics["duel"]["won"] is True
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
    """duel_margin 1000: every new best is a duel, each run by a sandboxed worker against the best of the moment."""
    cfg = {
        "task": {"name": "softmax", "args": {"rows": 64, "cols": 256}},
        "evaluation": {"timing": {"max_seconds": 0.05, "max_repeats": 20}, "check_trials": 1},
        "search": {"workers": 2, "initial_random": 4, "duel_margin": 1000.0},
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
    assert len(rows) == 12  # every held result was recorded once, after its duel
    duels = [(cid, f, m["duel"], m) for cid, f, m in rows if "duel" in m]
    assert duels, "no duel happened"
    ids = {cid for cid, _, _ in rows}
    for cid, fitness, duel, m in duels:
        assert duel["rival"] in ids and duel["rival"] != cid and duel["ratio"] > 0
        if duel["won"]:
            assert fitness == m.get("fitness_before_duel", fitness)
        else:
            assert fitness == pytest.approx(duel["rival_fitness"] * duel["ratio"]) and fitness <= duel["rival_fitness"]

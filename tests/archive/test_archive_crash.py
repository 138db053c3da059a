"""Crash safety: every evaluation a call has committed survives kill -9 of the writing process."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from archive import Store
from runtime.result import Status

REPO = Path(__file__).resolve().parents[2]

# Writes candidates and results forever (or until it kills itself inside an open transaction),
# printing "<id> <fitness>" after each committed result.
CHILD = """
import os, signal, sys
from archive import Store
from genome import Genome
from runtime.result import EvalResult, Status
store = Store(sys.argv[1])
self_kill_at = int(sys.argv[2])
i = 0
while True:
    g = Genome(params={"i": i}, source="x" * (i % 97))
    store.add_pending(genome=g, parents=[], operator="random")
    if i == self_kill_at:
        with store._write() as c:  # a transaction that never commits
            c.execute("UPDATE candidates SET status = 'ok', fitness = -1 WHERE id = ?", (g.id,))
            os.kill(os.getpid(), signal.SIGKILL)
    fitness = float(i) + 0.5
    store.record_result(g.id, EvalResult(status=Status.OK, fitness=fitness, metrics={"i": i}), descriptors={"d": i})
    print(g.id, fitness, flush=True)
    i += 1
"""


def _spawn(path: Path, self_kill_at: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(self_kill_at)], stdout=subprocess.PIPE, text=True, env=env
    )


def _check(path: Path, committed: list[tuple[str, float]]) -> None:
    assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with Store(path) as store:  # reopening recovers from the WAL
        for cid, fitness in committed:
            c = store.get(cid)
            assert c is not None and c.status == Status.OK and c.fitness == fitness
            assert c.metrics == {"i": int(fitness)} and c.descriptors == {"d": int(fitness)}
        evaluated = list(store.evaluated())
        assert [c.eval_seq for c in evaluated] == list(range(1, len(evaluated) + 1))
        assert all(c.fitness is not None and c.fitness >= 0 for c in evaluated)  # nothing uncommitted leaked
        assert len(store.pending()) <= 1  # at most the candidate in flight when killed


def test_kill_9_from_outside_loses_no_committed_result(tmp_path: Path) -> None:
    path = tmp_path / "archive.db"
    proc = _spawn(path, self_kill_at=-1)
    assert proc.stdout is not None
    committed = []
    for line in proc.stdout:
        cid, fitness = line.split()
        committed.append((cid, float(fitness)))
        if len(committed) == 150:
            proc.send_signal(signal.SIGKILL)  # somewhere inside the next add_pending / record_result
            break
    proc.wait(timeout=30)
    committed += [(cid, float(f)) for cid, f in (ln.split() for ln in proc.stdout.read().splitlines() if ln)]
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    _check(path, committed)


def test_kill_9_inside_a_transaction_rolls_it_back(tmp_path: Path) -> None:
    path = tmp_path / "archive.db"
    proc = _spawn(path, self_kill_at=40)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    committed = [(cid, float(f)) for cid, f in (ln.split() for ln in out.splitlines())]
    assert len(committed) == 40
    _check(path, committed)
    with Store(path, readonly=True) as store:
        assert store.count() == 41
        (last,) = store.pending()  # the 41st candidate: its uncommitted result is gone
        assert last.params == {"i": 40} and last.fitness is None


# Creates runs in new directories, one after another, printing each directory once it is created.
CREATOR = """
import sys
from pathlib import Path
from archive import Run
for i in range(10_000):
    Run.create(Path(sys.argv[1]) / str(i), config_text="task: {name: matmul}\\n").close()
    print(i, flush=True)
"""


def test_a_run_killed_while_it_is_created_is_whole_or_absent(tmp_path: Path) -> None:
    """kill -9 at any moment of ``Run.create``: a directory holds no store, or one with its config (which
    ``--resume`` continues), and a new run can still be created where the cut one was."""
    from archive import Run, StoreError, is_run

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for delay in [0.3 + 0.02 * k for k in range(15)]:
        root = tmp_path / f"d{delay:.2f}"
        proc = subprocess.Popen([sys.executable, "-c", CREATOR, str(root)], env=env, stdout=subprocess.PIPE)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        for run_dir in root.glob("*") if root.exists() else ():
            if is_run(run_dir):
                try:
                    with Run.open(run_dir) as run:
                        assert "matmul" in run.config_text
                except StoreError as exc:
                    raise AssertionError(f"{run_dir}: a store without its config after kill -9: {exc}") from None
            else:
                Run.create(run_dir, config_text="task: {name: matmul}\n").close()
                assert is_run(run_dir)

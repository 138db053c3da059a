"""End to end: real compiler, real sandboxed workers, real SQLite; small sizes so it stays quick."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.exclusive]  # it measures time


def small_config(tmp_path: Path, *, max_evals: int, n: int = 192, seed: int = 0, **budget) -> Path:
    cfg = {
        "name": "mm",
        "task": {"name": "matmul", "args": {"m": n, "n": n, "k": n}},
        "evaluation": {"timing": {"max_seconds": 0.3, "max_repeats": 15}, "check_trials": 1},
        "search": {"workers": 2, "seed": seed, "initial_random": 6},
        "budget": {"max_evals": max_evals, **budget},
        "archive": {"descriptors": ["register_tile_area", "cache_block_kib"], "bins": [4, 4]},
        "memory": {"enabled": False},
    }
    p = tmp_path / "mm.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def evo(*args: str, cwd: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evo", *args], capture_output=True, text=True, cwd=cwd, **kw)


def rows(db: Path) -> dict[str, tuple]:
    con = sqlite3.connect(db)
    try:
        return {r[0]: r[1:] for r in con.execute(
            # the figure as the search recorded it: a confirmed best keeps it in its metrics
            "SELECT id, status, COALESCE(json_extract(metrics, '$.confirmed.recorded_fitness'), fitness),"
            " evaluated_at, eval_seq FROM candidates WHERE status != 'pending'")}
    finally:
        con.close()


def test_search_beats_the_naive_seed_and_archive_answers(tmp_path):
    cfg = small_config(tmp_path, max_evals=30)
    run_dir = tmp_path / "run"
    proc = evo("run", str(cfg), "--run-dir", str(run_dir), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "best kernel" in proc.stdout

    out = evo("archive", "best", str(run_dir), "--top", "5", "--json", cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    best = json.loads(out.stdout)
    assert 1 <= len(best) <= 5
    for key in ("id", "status", "fitness", "unit", "metrics", "params", "descriptors", "operator", "parents"):
        assert key in best[0]
    assert best[0]["unit"] == "GFLOP/s" and best[0]["status"] == "ok"
    # the confirmed first, ranked by vs_reference (their figures were measured after the search), then the
    # others by fitness
    confirmed = [b for b in best if "confirmed" in b["metrics"]]
    assert confirmed and best[: len(confirmed)] == confirmed
    ratios = [b["metrics"]["vs_reference"] for b in confirmed]
    assert ratios == sorted(ratios, reverse=True)
    rest = [b["fitness"] for b in best[len(confirmed) :]]
    assert rest == sorted(rest, reverse=True)
    assert best[0]["metrics"]["vs_reference"] > 0

    con = sqlite3.connect(run_dir / "archive.db")
    (naive,) = con.execute("SELECT fitness FROM candidates WHERE operator='seed' AND params='{}'").fetchone()
    (n_eval,) = con.execute("SELECT COUNT(*) FROM candidates WHERE status != 'pending'").fetchone()
    con.close()
    assert n_eval == 30
    assert best[0]["fitness"] >= 5 * naive, (best[0]["fitness"], naive)

    stats = evo("archive", "stats", str(run_dir), "--json", cwd=tmp_path, timeout=60)
    s = json.loads(stats.stdout)
    assert s["candidates"] == 30 and s["by_status"]["ok"] >= 1 and 0 < s["archive"]["coverage"] <= 1

    show = evo("archive", "show", str(run_dir), best[0]["id"][:10], cwd=tmp_path, timeout=60)
    assert show.returncode == 0 and "void kernel(" in show.stdout
    src = tmp_path / "best.c"
    exp = evo("archive", "export", str(run_dir), best[0]["id"], "-o", str(src), cwd=tmp_path, timeout=60)
    assert exp.returncode == 0
    cmd = ["cc", "-O2", "-march=native", "-shared", "-fPIC", str(src), "-o", str(tmp_path / "b.so")]
    compiled = subprocess.run(cmd, capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr


def test_existing_run_needs_resume(tmp_path):
    cfg = small_config(tmp_path, max_evals=2)
    run_dir = tmp_path / "run"
    assert evo("run", str(cfg), "--run-dir", str(run_dir), cwd=tmp_path, timeout=300).returncode == 0
    again = evo("run", str(cfg), "--run-dir", str(run_dir), cwd=tmp_path, timeout=60)
    assert again.returncode == 2 and "--resume" in again.stderr


def test_kill_9_then_resume_loses_nothing_and_repeats_nothing(tmp_path):
    cfg = small_config(tmp_path, max_evals=24, n=160)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "evo", "run", str(cfg), "--run-dir", str(run_dir)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    db = run_dir / "archive.db"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if db.exists():
            try:
                if len(rows(db)) >= 8:
                    break
            except sqlite3.OperationalError:
                pass
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = rows(db)
    assert 8 <= len(before) < 24

    resumed = evo("run", str(cfg), "--run-dir", str(run_dir), "--resume", cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = rows(db)
    for cid, row in before.items():
        assert after[cid] == row  # nothing committed was lost or re-evaluated
    assert len(after) == 24  # the budget counts what was already done
    seqs = [r[3] for r in after.values()]
    assert len(set(seqs)) == len(seqs)
    con = sqlite3.connect(db)
    (pending,) = con.execute("SELECT COUNT(*) FROM candidates WHERE status='pending'").fetchone()
    con.close()
    assert pending <= 2  # at most what was in flight when the budget ran out


def candidate_ids(db: Path) -> list[str]:
    con = sqlite3.connect(db)
    try:
        return [r[0] for r in con.execute("SELECT id FROM candidates ORDER BY seq")]
    finally:
        con.close()


def test_proposals_are_reproducible_from_the_run_seed(tmp_path):
    runs = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        cfg = small_config(tmp_path, max_evals=1, n=64, seed=seed)
        proc = evo("run", str(cfg), "--run-dir", str(tmp_path / name), cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[name] = candidate_ids(tmp_path / name / "archive.db")
    assert len(runs["a"]) == 8  # 2 seeds + 6 random samples, written before evaluation
    assert runs["a"] == runs["b"]
    assert runs["a"][2:] != runs["c"][2:]  # same task seeds, other random samples


def test_the_user_task_example_runs_on_a_cvt_archive(tmp_path):
    root = Path(__file__).parents[2]
    cfg = yaml.safe_load((root / "configs" / "rmsnorm_user.yaml").read_text())
    cfg["archive"] = {"kind": "cvt", "descriptors": ["accumulators", "source_lines"], "cells": 8}
    cfg["budget"] = {"max_evals": 6}
    cfg["evaluation"] = {"timing": {"max_seconds": 0.3}}
    cfg["memory"] = {"enabled": False}
    (root_cfg := tmp_path / "rms.yaml").write_text(yaml.safe_dump(cfg))
    # the task module sits beside the shipped config, not this copy: put it on the path
    (tmp_path / "rmsnorm_task.py").write_text((root / "configs" / "rmsnorm_task.py").read_text())
    proc = evo("run", str(root_cfg), "--run-dir", str(tmp_path / "run"), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = json.loads(evo("archive", "stats", str(tmp_path / "run"), "--json", cwd=tmp_path, timeout=60).stdout)
    assert stats["archive"]["kind"] == "cvt" and stats["archive"]["cells"] == 8
    assert stats["by_status"].get("ok", 0) >= 4 and stats["archive"]["filled"] >= 1


def test_a_resumed_session_evaluates_the_offers_left_pending_first(tmp_path):
    """An offer (a candidate made of a newly offered kernel) left pending when a session's budget ran out goes
    first in the next session, before the older seeds and samples still pending."""
    from evo.config import load_config
    from evo.rundir import create_run, open_run
    from evo.search import Search
    from genome import Genome

    config = load_config(small_config(tmp_path, max_evals=4))
    first = Search(config, create_run(tmp_path / "run", config))
    for op, unroll in (("seed", 1), ("random", 2), ("offer", 4), ("random", 8), ("offer", 16)):
        assert first.proposer.add(Genome(params={"UNROLL": unroll}), [], op) is not None
    first.stored_run.close()
    resumed = Search(config, open_run(tmp_path / "run", writable=True))
    order = [(c.operator, c.genome.params["UNROLL"]) for c in resumed._requeue_pending()]
    assert order == [("offer", 4), ("offer", 16), ("seed", 1), ("random", 2), ("random", 8)]
    resumed.stored_run.close()


def test_an_offer_waits_until_the_tasks_seeds_are_measured(tmp_path):
    """An offer builds on the best genome measured so far, so the task's own seeds (a hand-tuned engine, say) are
    measured before offers jump the queue: offers first used to starve the seeds of a small budget."""
    import numpy as np

    from evo.config import load_config
    from evo.rundir import create_run
    from evo.search import Search
    from genome import Genome

    config = load_config(small_config(tmp_path, max_evals=4, n=64))
    search = Search(config, create_run(tmp_path / "run", config))
    offered = Genome(params=search.space.sample(np.random.default_rng(99)))
    looks: list[bool] = []

    def new_offers() -> list:  # a kernel offered at once, from the first look on
        looks.append(True)
        if len(looks) > 1:
            return []
        cand = search.proposer.add(offered, [], "offer")
        return [cand] if cand is not None else []

    search._new_offers = new_offers  # type: ignore[method-assign]
    search.run()
    evaluated = list(search.store.evaluated())
    search.stored_run.close()
    seeds = [c.eval_seq for c in evaluated if c.operator == "seed"]
    offers = [c.eval_seq for c in evaluated if c.operator == "offer"]
    assert len(seeds) == len(search.task.seeds()) >= 1 and len(offers) == 1
    assert max(seeds) < offers[0]


def test_a_run_builds_its_task_once_and_a_resumed_one_twice(tmp_path, monkeypatch):
    """The backend check, the summary's unit and the search share the task the config built (one ``evo run``
    used to build it four times); a resumed run builds the file's, then the stored config's."""
    from cli_testlib import evo_here

    from runtime.tasks.matmul import Matmul

    built: list[object] = []
    init = Matmul.__init__

    def counted(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(Matmul, "__init__", counted)
    cfg = str(small_config(tmp_path, max_evals=2, n=64))
    got = evo_here("run", cfg, "--run-dir", "run", "--workers", "1", "--no-confirm", cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-2000:]
    assert len(built) == 1
    built.clear()
    got = evo_here("run", cfg, "--run-dir", "run", "--workers", "1", "--no-confirm", "--resume", "--max-evals", "3",
                   cwd=tmp_path)  # fmt: skip
    assert got.returncode == 0, got.stderr[-2000:]
    assert len(built) == 2

"""The memory in a real search: one run records its discoveries, a related run is seeded from them."""

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("faiss", reason="the memory extra is not installed")
pytestmark = pytest.mark.slow


def run(tmp_path: Path, name: str, n: int, memory: dict, evals: int) -> subprocess.CompletedProcess:
    cfg = {
        "task": {"name": "matmul", "args": {"m": n, "n": n, "k": n}},
        "evaluation": {"timing": {"max_seconds": 0.1}, "check_trials": 1},
        "search": {"workers": 2, "initial_random": 4, "confirm": {"repeats": 0}},
        "budget": {"max_evals": evals},
        "archive": {"descriptors": ["register_tile_area"], "bins": 4},
        "memory": memory,
    }
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "evo", "run", f"{name}.yaml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)


def operators(db: Path) -> list[str]:
    con = sqlite3.connect(db)
    try:
        return [r[0] for r in con.execute("SELECT operator FROM candidates ORDER BY seq")]
    finally:
        con.close()


def test_a_run_records_discoveries_and_a_related_run_is_seeded_from_them(tmp_path):
    memory = {"enabled": True, "path": str(tmp_path / "mem"), "seed_k": 3}
    first = run(tmp_path, "first", 96, memory, evals=6)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "discoveries recorded" in first.stdout
    stats = subprocess.run([sys.executable, "-m", "evo", "memory", "--path", str(tmp_path / "mem"), "stats", "--json"],
                           capture_output=True, text=True, timeout=120)
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["entries"] >= 1

    second = run(tmp_path, "second", 80, memory, evals=4)
    assert second.returncode == 0, second.stderr[-2000:]
    ops = operators(tmp_path / "runs" / "second" / "archive.db")
    assert ops[:3].count("memory") >= 1 and ops[0] == "memory"  # memory seeds come first
    assert "seeds from earlier runs" in second.stderr + second.stdout

    cold = run(tmp_path, "cold", 80, {"enabled": False}, evals=2)
    assert cold.returncode == 0
    assert "memory" not in operators(tmp_path / "runs" / "cold" / "archive.db")


def test_a_run_without_faiss_goes_on_without_its_memory(tmp_path):
    """faiss missing (as in an install without the memory extra): the run says so once and completes."""
    shadow = tmp_path / "no-faiss"
    shadow.mkdir()
    (shadow / "faiss.py").write_text("raise ImportError(\"No module named 'faiss'\", name='faiss')\n")
    cfg = {"task": {"name": "matmul", "args": {"m": 32, "n": 32, "k": 32}},
           "evaluation": {"timing": {"max_seconds": 0.05}, "check_trials": 1},
           "search": {"workers": 1, "initial_random": 1}, "budget": {"max_evals": 2},
           "archive": {"descriptors": ["register_tile_area"], "bins": 4},
           "memory": {"enabled": True, "path": str(tmp_path / "mem")}}  # fmt: skip
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(shadow)}
    got = subprocess.run([sys.executable, "-m", "evo", "run", "job.yaml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=env)  # fmt: skip
    assert got.returncode == 0, got.stderr[-2000:]
    assert "memory disabled" in got.stdout + got.stderr and "Traceback" not in got.stderr

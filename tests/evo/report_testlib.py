"""A small real run to report on, and a way to add a result to it while someone watches."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from archive import Store
from genome import Genome
from runtime.result import EvalResult, Status

CONFIG = {
    "task": {"name": "matmul", "args": {"m": 96, "n": 96, "k": 96}},
    "evaluation": {"timing": {"max_seconds": 0.05, "max_repeats": 15, "min_seconds": 0}, "check_trials": 1},
    "search": {"workers": 1, "initial_random": 4, "operators": {"adaptive": True}},
    "budget": {"max_evals": 14},
    "archive": {"kind": "grid", "descriptors": ["register_tile_area", "cache_block_kib"], "bins": [4, 4]},
    "memory": {"enabled": False},
}


def evo(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evo", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)  # fmt: skip


def make_run(root: Path) -> Path:
    """A finished 14-evaluation matmul run with the bandit on, in ``root/run``."""
    cfg = root / "job.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    out = evo("run", str(cfg), "--run-dir", str(root / "run"), cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    return root / "run"


def add_best(run: Path) -> str:
    """Records a new, fitter candidate in the run and confirms it as the run's leader (as a resumed search would
    once its session ends) and returns its id."""
    store = Store(run)
    try:
        best = store.best(1)[0]
        genome = Genome(params={**best.params}, source=f"/* added at {time.time()} */\n{best.source or ''}")
        store.add_pending(genome=genome, parents=[best.id], operator="mutate")
        store.record_result(genome.id, EvalResult(status=Status.OK, fitness=(best.fitness or 1.0) * 10, unit=best.unit,
                                                  metrics={"vs_reference": 9.0}),
                            descriptors=best.descriptors)  # fmt: skip
        store.set_meta("confirmed", json.dumps([genome.id, *store.confirmed()]))
        return genome.id
    finally:
        store.close()

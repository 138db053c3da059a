"""Fixtures of the serving tests: two tiny real runs (matmul kernels, engine configs) made by `evo run`,
and real `evo serve` processes on 127.0.0.1 (each loads the model once, for the whole session)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from serve_helpers import KEY, Server, start_server, stop  # noqa: E402


def _config(tmp: Path, name: str, cfg: dict[str, Any]) -> Path:
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump({**cfg, "memory": {"enabled": False}}))
    return p


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny matmul run and a tiny engine run, made side by side by `python -m evo run`."""
    tmp = tmp_path_factory.mktemp("runs")
    mm = _config(tmp, "mm", {
        "task": {"name": "matmul", "args": {"m": 64, "n": 64, "k": 64}},
        "evaluation": {"timing": {"max_seconds": 0.1, "max_repeats": 5}, "check_trials": 1},
        "search": {"workers": 1, "initial_random": 1}, "budget": {"max_evals": 3},
        "archive": {"descriptors": ["register_tile_area", "cache_block_kib"], "bins": [4, 4]}})
    eng = _config(tmp, "eng", {
        "task": {"name": "engine", "args": {"threads": 2, "concurrency": 2, "duration_s": 0.3, "warmup_s": 0.05,
                                            "texts": 8, "lengths": {10: 1.0}, "p99_budget_ms": 10000}},
        "search": {"workers": 1, "initial_random": 0}, "budget": {"max_evals": 2},
        "archive": {"descriptors": ["p99_ms", "memory_mb"], "bins": [3, 3], "ranges": [[0, 10000], [0, 4096]]}})
    out = {"matmul": tmp / "mm", "engine": tmp / "eng"}
    procs = [subprocess.Popen([sys.executable, "-m", "evo", "run", str(cfg), "--run-dir", str(out[k])], cwd=tmp,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, cfg in (("matmul", mm), ("engine", eng))]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    return out


@pytest.fixture(scope="session")
def engine_server(runs: dict[str, Path]) -> Iterator[Server]:
    """The engine run's best elite, with an API key and a small in-flight cap."""
    srv = start_server(runs["engine"], "--max-in-flight", "6", key=KEY)
    yield srv
    stop(srv)


@pytest.fixture(scope="session")
def matmul_server(runs: dict[str, Path]) -> Iterator[Server]:
    """A matmul run (no engine elite: the default engine configuration), no API key, a 3 s body timeout."""
    srv = start_server(runs["matmul"], "--body-timeout", "3")
    yield srv
    stop(srv)

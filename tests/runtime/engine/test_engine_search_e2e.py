"""End to end: a tiny layernorm kernel search, then a tiny engine search offering its elites to the
layernorm slot (real sandboxed workers), then the archive shows engine elites and one loads back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from archive import Run
from runtime.engine import Engine, EngineConfig, load_elite, numpy_ops

pytestmark = pytest.mark.slow


def evo(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evo", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def write(tmp_path: Path, name: str, cfg: dict) -> Path:
    from evo.config import RunConfig

    if "memory" in RunConfig.model_fields:  # keep the shared memory of discoveries out of this test
        cfg = {**cfg, "memory": {"enabled": False}}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_engine_search_runs_and_its_elite_loads_back(tmp_path, model, sentences):
    fast = {"timing": {"max_seconds": 0.1, "max_repeats": 10}, "check_trials": 1}
    ln_cfg = write(tmp_path, "ln", {
        "task": {"name": "layernorm", "args": {"rows": 256, "cols": 384}},
        "evaluation": fast, "search": {"workers": 1, "initial_random": 1, "confirm": {"repeats": 0}},
        "budget": {"max_evals": 3}, "archive": {"descriptors": ["vector_width"], "bins": 4},
    })
    proc = evo("run", str(ln_cfg), "--run-dir", str(tmp_path / "ln"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    eng_cfg = write(tmp_path, "eng", {
        "task": {"name": "engine", "args": {
            "threads": 2, "concurrency": 3, "duration_s": 0.5, "warmup_s": 0.1, "texts": 16,
            "lengths": {10: 0.7, 30: 0.3}, "p99_budget_ms": 5000,
            "kernels": {"layernorm": [  # run dirs relative to where evo runs; a run not made yet is skipped
                {"run_dir": "ln", "top": 2}, {"run_dir": "no-run-yet", "optional": True}]}}},
        "space": {"params": {  # the genome in YAML; the task adds kernel_layernorm (its elites are read at start)
            "max_batch": {"type": "pow2", "low": 1, "high": 16}, "max_wait_ms": [0, 1], "bucketing": ["split", "queue"],
            "workers": {"type": "int", "low": 1, "high": 2}, "worker_kind": ["thread", "process"]}},
        "search": {"workers": 1, "initial_random": 2, "confirm": {"repeats": 1}},
        "budget": {"max_evals": 4},
        "archive": {"descriptors": ["p99_ms", "memory_mb"], "bins": [3, 3], "ranges": [[0, 5000], [0, 2048]]},
    })
    from evo.config import load_config

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        config = load_config(eng_cfg)
    space = config.make_space(config.make_task())
    assert space.names()[-1] == "kernel_layernorm" and len(space.params["kernel_layernorm"].values()) == 3
    ln_run, not_yet = config.task.args["kernels"]["layernorm"]
    assert (ln_run["run_dir"], not_yet["run_dir"]) == (str(tmp_path / "ln"), str(tmp_path / "no-run-yet"))
    assert len(ln_run["ids"]) == 2 and "ids" not in not_yet  # the offered elites are frozen into the run
    assert list(ln_run["offered"]) == ln_run["ids"] and "no run in" in not_yet["unreadable"]
    run_dir = tmp_path / "eng"
    proc = evo("run", str(eng_cfg), "--run-dir", str(run_dir), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    out = evo("archive", "best", str(run_dir), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    best = json.loads(out.stdout)
    assert best, "no engine elite"
    top = best[0]
    assert top["status"] == "ok" and top["unit"] == "sentences/s" and top["fitness"] > 0
    for key in ("throughput", "p50_ms", "p99_ms", "similarity", "memory_mb", "vs_reference"):
        assert key in top["metrics"]
    assert "kernel_layernorm" in top["params"]
    stats = json.loads(evo("archive", "stats", str(run_dir), "--json", cwd=tmp_path).stdout)
    evaluated = {k: v for k, v in stats["by_status"].items() if k != "pending"}
    assert evaluated == {"ok": 4} and stats["unit"] == "sentences/s"
    import sqlite3

    with sqlite3.connect(run_dir / "archive.db") as db:
        kinds = {json.loads(p)["worker_kind"] for (p,) in db.execute("SELECT params FROM candidates")}
    assert kinds == {"thread", "process"}  # the seeds measure both kinds of workers, in the sandbox
    show = evo("archive", "show", str(run_dir), top["id"][:10], cwd=tmp_path)
    assert show.returncode == 0 and "max_batch:" in show.stdout

    # the best engine loads back, and one with an evolved layernorm kernel (a seed has the best one)
    ids = [b["id"] for b in best]
    with_kernel = [b["id"] for b in best if b["params"]["kernel_layernorm"] != "numpy"]
    assert with_kernel
    want = Engine(model, numpy_ops(), EngineConfig()).embed(sentences[:8])
    for cid in [ids[0], *with_kernel[:1]]:
        with Run.open(run_dir) as run:
            engine = load_elite(run, cid[:12], model=model)
        try:
            assert engine.config.max_batch == best[ids.index(cid)]["params"]["max_batch"]
            assert set(engine.ops.kernels) == ({"layernorm"} if cid in with_kernel else set())
            with engine:
                got = np.stack([engine.submit(s).result(timeout=60) for s in sentences[:8]])
            assert np.sum(got * want, axis=1).min() >= 0.999
        finally:
            engine.close()

    # the elite with another offered kernel in its measured slot, hosted as a duel or a bench hosts it: it builds
    # that kernel (the elite's measured build names the kernel it was measured with, not the one put in its place)
    from runtime.sandbox.hosted_engine import spawn_elite

    cid = with_kernel[0]
    params = best[ids.index(cid)]["params"]
    other = next(v for v in ln_run["ids"] if not v.startswith(params["kernel_layernorm"]))
    with Run.open(run_dir) as run:
        hosted = spawn_elite(run, cid[:12], model, runs=Run.open, overrides={"kernels": {"layernorm": other[:16]}})
    try:
        hosted.start()
        got = np.stack([hosted.submit(s).result(timeout=60) for s in sentences[:8]])
        hosted.stop()
        assert np.sum(got * want, axis=1).min() >= 0.999
    finally:
        hosted.close()

"""`evo run --ray` end to end on a real two-node Ray cluster started on this machine: the search's results
match the local pool's statuses, both nodes evaluate, a driver killed with kill -9 resumes on the
cluster with every candidate recorded once, and a factory spreads its searches over the nodes."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")

pytestmark = pytest.mark.slow

CONFIG = {
    "task": {"name": "softmax", "args": {"rows": 64, "cols": 256}},
    "evaluation": {"timing": {"max_seconds": 0.05, "max_repeats": 20, "min_seconds": 0}, "check_trials": 1},
    "search": {"initial_random": 4},
    "archive": {"descriptors": ["vector_width"], "bins": 4},
    "memory": {"enabled": False},
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
    c = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    c.add_node(**node)
    try:
        yield c
    finally:
        c.shutdown()


def _evo(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evo", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)  # fmt: skip


def _settled(run: Path) -> int:
    """How many of a live run's candidates are evaluated; 0 while its store is not linked into place yet."""
    try:
        return sum(1 for r in _rows(run) if r[1] != "pending")
    except sqlite3.OperationalError:
        return 0


def _rows(run: Path) -> list[tuple[str, str, int | None, dict]]:
    # read-only: a plain connect would create an empty archive.db, and the driver would find a run in its way
    with sqlite3.connect(f"file:{run / 'archive.db'}?mode=ro", uri=True) as db:
        return [(cid, status, seq, json.loads(m or "{}")) for cid, status, seq, m in
                db.execute("SELECT id, status, eval_seq, metrics FROM candidates ORDER BY eval_seq")]


def test_a_search_on_the_cluster_matches_the_local_pool(cluster, tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({**CONFIG, "budget": {"max_evals": 10}}))
    on_ray = _evo("run", str(cfg), "--run-dir", str(tmp_path / "ray"), "--ray", cluster.address, cwd=tmp_path)
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    local = _evo("run", str(cfg), "--run-dir", str(tmp_path / "local"), "--workers", "2", cwd=tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    ray_rows, local_rows = _rows(tmp_path / "ray"), _rows(tmp_path / "local")
    assert sorted(r[1] for r in ray_rows) == sorted(r[1] for r in local_rows) == ["ok"] * 10
    nodes = {r[3].get("node") for r in ray_rows}
    assert len(nodes) == 2 and None not in nodes  # both nodes evaluated, and each result says which
    assert "2 workers" in on_ray.stdout + on_ray.stderr  # the cluster's slots


def test_a_driver_killed_mid_run_resumes_on_the_cluster(cluster, tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({**CONFIG, "budget": {"max_evals": 16}}))
    run = tmp_path / "run"
    driver = subprocess.Popen([sys.executable, "-m", "evo", "run", str(cfg), "--run-dir", str(run), "--ray",
                               cluster.address], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if _settled(run) >= 4:
            break
        assert driver.poll() is None, driver.stderr.read() if driver.stderr else ""
        time.sleep(0.2)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    done_before = {r[0] for r in _rows(run) if r[1] != "pending"}
    assert 4 <= len(done_before) < 16
    resumed = _evo("run", str(cfg), "--run-dir", str(run), "--resume", "--ray", cluster.address, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = _rows(run)
    evaluated = [r for r in rows if r[1] != "pending"]
    assert len(evaluated) == 16 and len({r[0] for r in evaluated}) == 16  # none lost, none twice
    assert len({r[2] for r in evaluated}) == 16  # one eval_seq each
    assert done_before <= {r[0] for r in evaluated}


def test_a_factory_spreads_its_searches_over_the_cluster(cluster, tmp_path):
    """A factory with execution on the cluster: its kernel searches run at once, every search evaluates on
    the nodes, and the engine search's kernels (runs on the driver's disk only) reach the nodes in the
    task's arguments; the profile and the duel run on the driver's machine."""
    from factory_testlib import tiny_factory

    cfg = tiny_factory(tmp_path, load={"threads": 1}, promote={"duration_s": 0.3, "min_gain": -0.9},
                       execution={"kind": "ray", "address": cluster.address})  # fmt: skip
    (tmp_path / "factory.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "EVOFORGE_MEMORY_DIR": str(tmp_path / "memory")}
    out = subprocess.run([sys.executable, "-m", "evo", "factory", "factory.yaml", "--dir", "fac"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    fac = tmp_path / "fac"
    events = [json.loads(line) for line in (fac / "events.jsonl").read_text().splitlines()]
    planned = {e["task"]: e["evals"] for e in events if e["event"] == "planned"}  # split by the profile's shares
    spans = {}
    for task in ("gelu", "layernorm"):
        with sqlite3.connect(fac / "runs" / task / "archive.db") as db:
            got = db.execute("SELECT status, metrics, created_at, evaluated_at FROM candidates").fetchall()
        done = [(m, t) for status, m, _, t in got if status != "pending"]
        assert len(done) == planned[task] >= 2 and all(json.loads(m).get("node") for m, _ in done), (planned, got)
        spans[task] = (min(c for _, _, c, _ in got), max(t for _, t in done))  # its first proposal, last result
    (a0, a1), (b0, b1) = spans.values()
    assert a0 < b1 and b0 < a1, spans  # started at once (the cluster's slots then serve them as they free up)
    rows = _rows(fac / "runs" / "engine-r1")
    evaluated = [r for r in rows if r[1] != "pending"]
    assert evaluated and all(r[1] == "ok" and r[3].get("node") for r in evaluated), evaluated
    with sqlite3.connect(fac / "runs" / "engine-r1" / "archive.db") as db:
        params = [json.loads(p) for (p,) in db.execute("SELECT params FROM candidates WHERE status = 'ok'")]
    assert any(v != "numpy" for p in params for k, v in p.items() if k.startswith("kernel_"))  # evolved, on a node
    duel = json.loads((fac / "duels" / "round-1.json").read_text())
    assert duel["figures"]["candidate"]["throughput"] > 0 and duel["promoted"], duel["why"]


def test_an_unreachable_cluster_ends_the_run_in_one_line(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({**CONFIG, "budget": {"max_evals": 2}}))
    t0 = time.monotonic()
    out = _evo("run", str(cfg), "--run-dir", str(tmp_path / "run"), "--ray", "127.0.0.1:9", cwd=tmp_path)
    assert out.returncode == 2 and "no Ray cluster answers at 127.0.0.1:9" in out.stderr, out.stderr[-2000:]
    assert time.monotonic() - t0 < 60 and "Traceback" not in out.stderr

"""``evo report``, ``evo archive pareto`` and the figures: drawn from real runs and real stores."""

from __future__ import annotations

import io
import json
import re
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("matplotlib")

from cli_testlib import evo_here  # noqa: E402
from report_testlib import evo, make_run  # noqa: E402

from archive import CVTArchive, GridArchive, Objective, Run, Store, pareto_front, save_layout  # noqa: E402
from genome import Genome  # noqa: E402
from runtime.result import EvalResult, Status  # noqa: E402


def _image(data: bytes) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(io.BytesIO(data), format="png")


def _drawn(data: bytes) -> bool:
    """Not blank: a real picture has many colours."""
    img = _image(data)
    return img.std() > 0.02 and len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 16


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("report"))


def test_the_report_of_a_real_run_holds_every_view_offline(run, tmp_path):
    out = evo("report", str(run), "-o", str(tmp_path / "r.html"), "--png", str(tmp_path / "png"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "r.html").read_text()
    for section in ("summary", "archive", "progress", "operators", "lineage", "quality"):
        assert f'<section id="{section}">' in page
    plots = set(re.findall(r'data-plot="(\w+)"', page))
    assert {"archive_fitness", "archive_vs_reference", "progress", "statuses", "operators", "bandit",
            "uncertainty"} <= plots  # fmt: skip
    assert not re.search(r'(src|href)="(https?:)?//', page), "the report loads something from the network"
    pngs = {p.stem: p.read_bytes() for p in (tmp_path / "png").glob("*.png")}
    assert set(pngs) == plots and all(_drawn(d) for d in pngs.values())
    with Run.open(run) as view:
        best = view.best(1)[0]
        chain = view.path_to(best.id)
    assert best.id[:12] in page and chain[0].operator in ("seed", "random")
    assert page.count('<details class="step">') == len(chain) - 1  # a diff for every step from the seed


def test_the_bandit_weights_are_stored_as_the_run_goes(run):
    with Run.open(run) as view:
        history = view.store.bandit_history()
    assert history and {"mutate", "crossover"} <= set(history[-1][2])
    assert all(0 < w < 1 for _, _, weights in history for w in weights.values())


def test_report_errors_are_one_line(tmp_path):
    out = evo("report", str(tmp_path / "nothing"), cwd=tmp_path)
    assert out.returncode == 2 and "no run in" in out.stderr and "Traceback" not in out.stderr


def test_archive_maps_for_every_layout_leave_empty_cells_blank():
    from evo.report import figures

    rng = np.random.default_rng(0)
    grid2 = GridArchive(names=["a", "b"], bins=[5, 4], ranges=[(0, 1), (0, 1)])
    grid1 = GridArchive(names=["a"], bins=[8], ranges=[(0, 1)])
    cvt = CVTArchive(names=["a", "b"], ranges=[(0, 1), (0, 10)], cells=30, samples=600, seed=1)
    many = GridArchive(names=["a", "b", "c"], bins=[3, 3, 3], ranges=[(0, 1)] * 3)
    drawn: dict[str, dict[str, float]] = {}
    for name, archive in (("grid2", grid2), ("grid1", grid1), ("cvt", cvt), ("many", many)):
        values = drawn[name] = {}
        for i in range(6):
            cid = f"{i:064x}"
            archive.add(cid, float(i + 1), list(rng.random(len(archive.names)) * [r[1] for r in archive.ranges]))
            values[cid] = float(i + 1)
        data = figures.archive_map(archive, values, "fitness")
        assert data is not None and _drawn(data), archive
    assert figures.archive_map(grid2, {}, "fitness") is None  # nothing to draw: said so, not a blank plot
    # a 2D grid: a filled cell is coloured, an empty one white
    img = _image(figures.archive_map(grid2, drawn["grid2"], "fitness"))
    assert (img[..., :3] > 0.99).all(axis=-1).any()


def _engine_store(path: Path, points: list[tuple[float, float, float]]) -> list[str]:
    """An engine-like run whose candidates have (throughput, p99_ms, memory_mb)."""
    path.mkdir()
    store = Store(path)
    store.set_meta("config", yaml.safe_dump({"name": "eng", "task": {"name": "engine", "args": {"p99_budget_ms": 60}},
                                             "archive": {"kind": "grid", "descriptors": ["p99_ms"], "bins": 4}}))
    save_layout(store, GridArchive(names=["p99_ms"], bins=[4], ranges=[(0, 100)]))
    ids = []
    for i, (tp, p99, mem) in enumerate(points):
        g = Genome(params={"max_batch": i})
        store.add_pending(genome=g, operator="seed" if i == 0 else "mutate")
        store.record_result(g.id, EvalResult(status=Status.OK, fitness=tp, unit="sentences/s",
                                             metrics={"throughput": tp, "p99_ms": p99, "memory_mb": mem}),
                            descriptors={"p99_ms": p99})  # fmt: skip
        ids.append(g.id)
    store.close()
    return ids


def test_pareto_front_on_the_cli_and_in_the_report(tmp_path):
    points = [(100, 50, 300), (120, 80, 310), (90, 40, 290), (95, 60, 280), (120, 90, 200), (60, 40, 100)]
    ids = _engine_store(tmp_path / "eng", points)
    out = evo("archive", "pareto", str(tmp_path / "eng"), "--objectives", "throughput,-p99_ms", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    # (95, 60) loses to (100, 50); (120, 90) to (120, 80); (60, 40) to (90, 40)
    assert [g["id"] for g in got] == [ids[1], ids[0], ids[2]]
    assert got[0]["objectives"] == {"throughput": 120.0, "p99_ms": 80.0}
    bad = evo("archive", "pareto", str(tmp_path / "eng"), "--objectives", "tokens", cwd=tmp_path)
    assert bad.returncode == 2 and "no ok candidate" in bad.stderr and "tokens" in bad.stderr
    assert evo("archive", "pareto", str(tmp_path / "eng"), "--objectives", ",", cwd=tmp_path).returncode == 2
    out = evo("report", str(tmp_path / "eng"), "-o", str(tmp_path / "eng.html"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "eng.html").read_text()
    assert '<section id="engine">' in page and 'data-plot="engine"' in page


def test_pareto_front_ignores_candidates_without_the_metrics():
    from archive import Candidate

    def cand(i: int, **metrics: float) -> Candidate:
        return Candidate(id=f"{i:064x}", seq=i, parents=(), operator="seed", params={}, source=None,
                         status=Status.OK, fitness=1.0, metrics=metrics)  # fmt: skip

    front = pareto_front([cand(1, a=1.0, b=1.0), cand(2, a=2.0), cand(3, a=0.5, b=0.5), cand(4, a=1.0, b=1.0)],
                         [Objective("a"), Objective("b", maximise=False)])  # fmt: skip
    assert [c.seq for c in front] == [1, 3]  # 2 lacks b; 4 ties 1: kept once, the first


def test_an_older_store_is_read_as_it_is_and_migrated_when_opened_to_write(tmp_path):
    db = tmp_path / "archive.db"
    Store(db).close()
    with sqlite3.connect(db) as con:  # what a store of schema version 2 looked like
        con.execute("DROP TABLE bandit_history")
        con.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    old = Store(db, readonly=True)
    assert old.schema_version == 2 and old.bandit_history() == []
    old.close()
    new = Store(db)
    assert new.schema_version == 3
    new.add_bandit_weights(evals=3, elapsed_s=1.0, weights={"mutate": 0.5})
    assert new.bandit_history() == [(3, 1.0, {"mutate": 0.5})]
    new.close()


_PAYLOAD = "<img src=x onerror=alert(1)>"


def _hostile_store(path: Path, *, config: str | None = None, best_metrics: dict | None = None,
                   operator: str = "mutate", descriptors: dict | None = None) -> Path:  # fmt: skip
    """A run written by someone hostile: markup in params, TeX in names, odd metrics, odd configs."""
    path.mkdir()
    store = Store(path)
    store.set_meta("config", config if config is not None else yaml.safe_dump(
        {"name": "x", "task": {"name": "matmul", "args": {}}, "archive": {"kind": "grid", "descriptors": ["a"],
                                                                           "bins": 2}}))  # fmt: skip
    save_layout(store, GridArchive(names=["a"], bins=[2], ranges=[(0, 1)]))
    seed = Genome(params={"P": 1}, source="a")
    child = Genome(params={"P": _PAYLOAD, _PAYLOAD: 2}, source="b" + _PAYLOAD)
    store.add_pending(genome=seed, operator="seed")
    store.record_result(seed.id, EvalResult(status=Status.OK, fitness=1.0, unit="$\\frac{$"), descriptors={"a": 0.2})
    store.add_pending(genome=child, parents=[seed.id], operator=operator)
    store.record_result(child.id, EvalResult(status=Status.OK, fitness=2.0, unit="$\\frac{$",
                                             metrics=best_metrics or {"vs_reference": 1.0}),
                        descriptors=descriptors or {"a": 0.7})  # fmt: skip
    store.close()
    return path


def test_a_hostile_run_is_reported_escaped_and_without_a_traceback(tmp_path):
    run = _hostile_store(tmp_path / "x", operator="$\\foo{$",
                         best_metrics={"vs_reference": "fast", "throughput": 1.0, "p99_ms": 1.0, "memory_mb": "lots"})
    out = evo("report", str(run), "-o", str(tmp_path / "x.html"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "x.html").read_text()
    assert _PAYLOAD not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    odd = _hostile_store(tmp_path / "odd", descriptors={"b": 0.5})  # descriptors that do not fit the layout
    out = evo("report", str(odd), "-o", str(tmp_path / "odd.html"), cwd=tmp_path)
    assert out.returncode == 0 and "descriptors lack" in (tmp_path / "odd.html").read_text()
    for i, config in enumerate(("a: [", "- 1\n- 2", "task: matmul", "task: {name: m, args: [1, 2]}")):
        bad = _hostile_store(tmp_path / f"bad{i}", config=config)
        out = evo_here("report", str(bad), cwd=tmp_path)
        assert out.returncode == 2 and "stored config" in out.stderr and "Traceback" not in out.stderr, config
    assert evo_here("report", str(_hostile_store(tmp_path / "s", config="task: {name: m}\nsearch: fast")),
                    cwd=tmp_path).returncode == 0
    (tmp_path / "pngs").write_text("a file, not a folder")
    out = evo_here("report", str(run), "--png", str(tmp_path / "pngs"), cwd=tmp_path)
    assert out.returncode == 2 and "--png" in out.stderr

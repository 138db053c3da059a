"""``evo report`` and ``evo dashboard`` on a real factory directory: its timeline, the served engine's
throughput, its runs; hostile texts escaped, torn or missing files reported as far as they go."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from dashboard_testlib import dashboard  # noqa: E402
from report_testlib import evo  # noqa: E402

from archive import FactoryDir, Run  # noqa: E402
from evo.report import write_report  # noqa: E402

SECTIONS = ("factory", "timeline", "profiles", "searches", "duels", "decisions", "runs")


def _copy(factory: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(factory, tmp_path / "fac"))


def _page(fac: Path, tmp_path: Path) -> str:
    write_report(fac, tmp_path / "r.html")
    return (tmp_path / "r.html").read_text()


def test_the_report_of_a_real_factory_shows_its_timeline_promotion_and_runs(factory, tmp_path):
    out = evo("report", str(factory), "-o", str(tmp_path / "r.html"), "--png", str(tmp_path / "png"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "r.html").read_text()
    for section in SECTIONS:
        assert f'<section id="{section}">' in page
    assert {"timeline", "served"} <= set(re.findall(r'data-plot="(\w+)"', page))
    assert {p.stem for p in (tmp_path / "png").glob("*.png")} == {"timeline", "served"}
    assert not re.search(r'(src|href)="(https?:)?//', page), "the report loads something from the network"
    (promoted,) = FactoryDir(factory).promotions()
    assert f"<td>{promoted['throughput']:.4g}</td>" in page and promoted["elite"][:12] in page
    runs = sorted(p.name for p in (factory / "runs").iterdir())
    assert runs == ["engine-r1", "gelu", "layernorm"]
    for name in runs:
        with Run.open(factory / "runs" / name) as view:
            best = view.best(1)[0]
            line = f"<b>{name}</b>: task {view.task_name}, {len(list(view.evaluated()))} evaluations, " \
                   f"best {best.fitness:.4g} {best.unit}"  # fmt: skip
        assert line in page
        assert f'<a href="runs/{name}/report.html">' in page
    searched = [json.loads(line) for line in (factory / "events.jsonl").read_text().splitlines()]
    assert page.count("<td>searched</td>") == sum(e["event"] == "searched" for e in searched) == 3


def test_hostile_texts_are_escaped(factory, tmp_path):
    fac = _copy(factory, tmp_path)
    hostile = "<script>alert('factory')</script>"
    with (fac / "events.jsonl").open("a") as f:  # an event no one knows yet, with texts that are markup
        f.write(json.dumps({"at": time.time(), "event": "<b>audited</b>", "round": 1, "why": hostile,
                            "engine": {"run_dir": "<img src=x>", "elite": "<i>"}}) + "\n")  # fmt: skip
    page = _page(fac, tmp_path)
    assert "&lt;script&gt;alert(&#x27;factory&#x27;)&lt;/script&gt;" in page and "<td>&lt;b&gt;audited" in page
    assert "<script>" not in page and "<img src=x>" not in page and "<i>" not in page and "<b>audited" not in page


def test_a_factory_killed_mid_round_is_reported_as_far_as_it_got(factory, tmp_path):
    fac = _copy(factory, tmp_path)
    shutil.rmtree(fac / "duels")
    for name in ("events.jsonl", "promotions.jsonl"):  # a line torn by a kill
        with (fac / name).open("a") as f:
            f.write('{"at": 1.5, "event": "promo')
    page = _page(fac, tmp_path)
    assert "no duel yet" in page and 'data-plot="timeline"' in page and 'data-plot="served"' in page
    (promoted,) = FactoryDir(fac).promotions()
    assert promoted["elite"][:12] in page
    assert "<tbody><tr><td>0</td><td>1</td><td>profiled</td>" in page  # the torn line's time is not the start
    (fac / "promotions.jsonl").unlink()
    shutil.rmtree(fac / "runs")
    page = _page(fac, tmp_path)
    assert "nothing promoted yet" in page and "no run yet" in page and 'data-plot="timeline"' in page


@pytest.mark.skipif(importlib.util.find_spec("uvicorn") is None, reason="needs the dashboard extra")
def test_the_dashboard_serves_a_factory_and_follows_it(factory, tmp_path):
    fac = _copy(factory, tmp_path)
    with dashboard(fac, key=None) as url:
        with urllib.request.urlopen(url, timeout=30) as r:
            page = r.read().decode()
        assert '<section id="timeline">' in page and 'data-plot="timeline"' in page and "<b>engine-r1</b>" in page
        with urllib.request.urlopen(url + "api/report", timeout=30) as r:
            first = json.load(r)["marker"]
        with (fac / "events.jsonl").open("a") as f:  # the factory goes on: a new decision
            f.write(json.dumps({"at": time.time(), "event": "profiled", "round": 2, "why": "round two begins"}) + "\n")
        deadline = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(url + f"api/report?after={first}", timeout=30) as r:
                got = json.load(r)
            if got["changed"] and any("round two begins" in s["body"] for s in got["sections"]):
                break
            assert time.monotonic() < deadline, "the factory's new decision never reached the dashboard"
            time.sleep(0.5)

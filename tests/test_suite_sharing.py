"""The suite's own sharing rule (tests/conftest.py), run for real on two xdist workers: a test marked
``exclusive`` overlaps no other test, while ordinary tests do run side by side, and the tests of an expensive
fixture run on one worker, which builds it once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

_TESTS = """
import json, os, time
from pathlib import Path

import pytest

def _span(name):
    t0 = time.time()
    time.sleep(0.4)
    Path(os.environ["SPANS"], name).write_text(json.dumps([t0, time.time()]))

@pytest.mark.parametrize("i", range(6))
def test_ordinary(i):
    _span(f"ordinary-{i}")

@pytest.mark.exclusive
@pytest.mark.parametrize("i", range(2))
def test_exclusive(i):
    _span(f"exclusive-{i}")

@pytest.fixture(scope="session")
def factory():
    Path(os.environ["SPANS"], f"built-{os.getpid()}").write_text("")

@pytest.mark.parametrize("i", range(4))
def test_sharing_a_fixture(i, factory):
    time.sleep(0.2)
"""


def test_an_exclusive_test_runs_alone_and_the_others_side_by_side(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_spans.py").write_text(_TESTS)
    spans = tmp_path / "spans"
    spans.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "xdist",
         "-o", "markers=exclusive: alone", "-p", "no:cacheprovider", "test_spans.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={"SPANS": str(spans), "PATH": ""},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert len(list(spans.glob("built-*"))) == 1  # one worker ran the fixture's tests
    got = {p.name: json.loads(p.read_text()) for p in spans.iterdir() if not p.name.startswith("built-")}
    assert len(got) == 8

    def overlap(a: list[float], b: list[float]) -> bool:
        return a[0] < b[1] and b[0] < a[1]

    for name, span in got.items():
        if name.startswith("exclusive"):
            assert not [o for o, s in got.items() if o != name and overlap(span, s)], name
    ordinary = [s for n, s in got.items() if n.startswith("ordinary")]
    assert any(overlap(a, b) for i, a in enumerate(ordinary) for b in ordinary[i + 1 :])  # two workers at work

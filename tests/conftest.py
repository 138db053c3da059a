"""How the suite shares this machine when it runs on several workers (pytest-xdist, ``-n 2`` by default).

- A test that measures time (a speedup, a duel, a p99, a clock) is marked ``exclusive``: it runs with no other
  test beside it. The workers share a readers-writer lock on a file: every other test holds it shared, an
  exclusive one holds it alone, and a turnstile keeps a waiting exclusive test from being overtaken.
- Tests that use one expensive session fixture (a factory directory, the served runs, a Ray cluster) run on
  one worker, so that it is built once; a module may name its group itself (``pytest.mark.xdist_group``).

Run without xdist (``-n 0``, or ``-p no:xdist``) none of this applies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# session or module fixture -> the one worker's group of the tests that use it
_BUILT_ONCE = {"factory": "factory", "runs": "served-runs", "cluster": "ray-cluster"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group"):  # the module named its group itself
            continue
        group = next((g for name, g in _BUILT_ONCE.items() if name in getattr(item, "fixturenames", ())), None)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


@contextlib.contextmanager
def _share(exclusive: bool) -> Iterator[None]:
    """The machine, shared with the other workers' tests, or alone."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:  # one process runs every test: nothing to share
        yield
        return
    base = Path(tempfile.gettempdir()) / f"evoforge-tests-{run}"
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.machine", "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:  # an exclusive test keeps the turnstile: no new test starts until it ends
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with _share(item.get_closest_marker("exclusive") is not None):
        yield

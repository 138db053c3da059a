"""How the suite shares this machine when it runs on several workers (pytest-xdist, ``-n 2`` by default).

- A test that measures time (a speedup, a duel, a p99, a clock) is marked ``exclusive``: it runs with no other
  test beside it. The workers share a readers-writer lock on a file: every other test holds it shared, an
  exclusive one holds it alone, and a turnstile keeps a waiting exclusive test from being overtaken.
- Tests that use one expensive session fixture (a factory directory, a Ray cluster) run on one worker, so
  that it is built once; a module may name its group itself (``pytest.mark.xdist_group``).

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
_BUILT_ONCE = {"factory": "factory", "cluster": "ray-cluster"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = next((g for name, g in _BUILT_ONCE.items() if name in getattr(item, "fixturenames", ())), None)
        if group and not item.get_closest_marker("xdist_group"):  # a module may name its group itself
            item.add_marker(pytest.mark.xdist_group(group))
        groups = sorted({str(m.args[0]) for m in item.iter_markers("xdist_group")})
        if groups and getattr(config.option, "loadgroup", False) and hasattr(item, "_id"):
            # xdist schedules a group by the "@group" suffix of a node id, which its worker writes into
            # ``_nodeid``; pytest 9 keeps the id in ``_id``, so the suffix is written here
            from _pytest.nodeid import coerce_node_id

            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")


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

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def probe(tmp_path_factory):
    """Where the probing GELU (probe_testlib) writes what it sees, and the listener it connects to."""
    from factory_testlib import Probe

    return Probe(tmp_path_factory.mktemp("probe") / "marker")


@pytest.fixture(scope="session")
def factory(tmp_path_factory, probe) -> Path:
    """A real factory directory (see factory_testlib): built once, read by every test that asks for it. Its
    gelu search is seeded from a memory a model endpoint planted the probing GELU in."""
    from factory_testlib import killed_and_resumed_factory

    return killed_and_resumed_factory(tmp_path_factory.mktemp("factory"), probe)

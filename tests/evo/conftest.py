from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def factory(tmp_path_factory) -> Path:
    """A real factory directory (see factory_testlib): built once, read by every test that asks for it."""
    from factory_testlib import killed_and_resumed_factory

    return killed_and_resumed_factory(tmp_path_factory.mktemp("factory"))

"""Fixtures of the runtime tests: a module-wide pool and its working directory."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from runtime.pool import LocalPool


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("runtime"))


@pytest.fixture(scope="module")
def pool(workdir: str) -> Iterator[LocalPool]:
    with LocalPool(workers=1, log_dir=os.path.join(workdir, "logs")) as p:
        yield p

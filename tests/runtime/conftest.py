"""Fixtures of the runtime tests: a working directory, an in-process worker context, a sandboxed pool."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from runtime.backends import WorkerContext
from runtime.executors import LocalPool
from runtime.timing import TimingLock


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("runtime"))


@pytest.fixture(scope="module")
def ctx(workdir: str) -> Iterator[WorkerContext]:
    """What a worker holds, for evaluations run in this process (benign or hostile kernels alike)."""
    os.makedirs(os.path.join(workdir, "cache"), exist_ok=True)
    lock = TimingLock(os.path.join(workdir, "timing.lock"))
    context = WorkerContext(cache_dir=os.path.join(workdir, "cache"), work_dir=workdir, lock=lock)
    yield context
    context.close()
    lock.close()


@pytest.fixture(scope="module")
def pool(workdir: str) -> Iterator[LocalPool]:
    with LocalPool(workers=1, log_dir=os.path.join(workdir, "logs")) as p:
        yield p

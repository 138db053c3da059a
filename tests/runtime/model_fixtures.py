"""Fixtures shared by the engine and decoder tests (imported by their conftests): nothing downloads, one BLAS
thread, the fixed corpus."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="session", autouse=True)
def one_blas_thread():
    """One BLAS thread: on a small shared machine more threads than free cores make BLAS crawl."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    return [s for s in (DATA / "sentences.txt").read_text(encoding="utf-8").splitlines() if s.strip()]

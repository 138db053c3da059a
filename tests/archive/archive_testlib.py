"""Helpers shared by the archive tests (a uniquely named module, importable from any test here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from archive import Archive
from genome import Genome
from runtime.result import EvalResult, Status

ArchiveFactory = Callable[..., Archive]


def genome(i: int) -> Genome:
    return Genome(params={"i": i, "MC": 16})


def ok(fitness: float, **extra: Any) -> EvalResult:
    metrics = {"vs_reference": fitness / 10}
    return EvalResult(status=Status.OK, fitness=fitness, unit="GFLOP/s", metrics=metrics, **extra)

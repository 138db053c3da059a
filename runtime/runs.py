"""What the runtime reads of a stored run, as an interface: ``runtime`` may not import ``archive``, which
owns the store and its schema, so whoever reads a run for the runtime hands in a reader
(``archive.read_run`` gives one). Used where a task is resolved: an engine task's kernel runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from genome import Genome

__all__ = ["OpenRun", "RunNotFound", "RunReader", "StoredCandidate"]


class RunNotFound(LookupError):
    """No run in the directory (or not one written by ``evo run``), or no such candidate in it."""


@dataclass(frozen=True)
class StoredCandidate:
    id: str
    genome: Genome
    status: str
    fitness: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


class RunReader(Protocol):
    """A run, read-only, as the runtime needs it."""

    path: Path
    config: dict[str, Any]  # the frozen config as stored

    @property
    def task_name(self) -> str: ...

    @property
    def task_args(self) -> dict[str, Any]: ...

    def elite_ids(self, top: int) -> list[str]:
        """Ids of the ``top`` best ok candidates, best first: those the run confirmed after its search first,
        as it ranked them, then the fittest others."""
        ...

    def stored(self, cid: str) -> StoredCandidate:
        """The candidate with this id or unique prefix; :class:`RunNotFound` when none (or ambiguous)."""
        ...

    def close(self) -> None:
        """Lets go of the run (its store's connection)."""
        ...


OpenRun = Callable[[str | Path], RunReader]
"""Opens the run in a directory; raises :class:`RunNotFound`."""

"""What the runtime reads of a stored run, as an interface: ``runtime`` may not import ``archive``, which
owns the store and its schema, so whoever reads a run for the runtime hands in a reader
(``archive.Run.open`` gives one). Used where a task is resolved: an engine task's kernel runs.

A task whose arguments read other runs implements :class:`FollowsRuns` besides :class:`runtime.task.Task`:
the search and whoever resolves a config ask a task for these hooks only when it has them."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from genome import Genome, ParamSpace

__all__ = ["FollowsRuns", "OpenRun", "RunNotFound", "RunReader", "StoredCandidate"]


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


class FollowsRuns(abc.ABC):
    """What a task whose arguments read other runs adds to :class:`runtime.task.Task` (the engine task reads
    its kernel runs): what they offer is read once and frozen into the arguments, a search looks again every
    :meth:`offers_every_s`, grows the arguments by what is new and tries it first."""

    @classmethod
    @abc.abstractmethod
    def read_runs(cls, args: Mapping[str, object], runs: OpenRun) -> dict[str, object]:
        """Resolved ``args`` (:meth:`runtime.task.Task.resolve_args`) with what the runs they name offer now
        read into them, once: a resumed run, a worker, a Ray node or a server sees exactly this, without
        reading the runs again. Arguments read already stay as they are."""

    @abc.abstractmethod
    def offers_every_s(self) -> float:
        """How often a search asks :meth:`new_offers` (0: never, what the task offers is frozen)."""

    @classmethod
    @abc.abstractmethod
    def new_offers(
        cls, args: Mapping[str, object], runs: OpenRun
    ) -> tuple[dict[str, object], list[dict[str, object]]] | None:
        """Read ``args`` grown by what their runs offer now and did not when they were read, and one record per
        addition; ``None``: nothing new. Offers only grow: every genome of the run stays in the space."""

    @abc.abstractmethod
    def offer_seeds(self, base: Genome | None, added: Sequence[Mapping[str, object]]) -> list[Genome]:
        """Genomes that try what :meth:`new_offers` added, starting from ``base`` (the run's best, if any)."""

    @abc.abstractmethod
    def complete_space(self, space: ParamSpace) -> ParamSpace:
        """``space`` (a config's ``space:``) with the parameters only the runs' offers make known added."""

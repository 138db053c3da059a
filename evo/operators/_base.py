"""The operator protocol: given a context (parents and their results, the space, ...), propose a child."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from archive import Candidate, Store
from genome import Genome, ParamSpace
from runtime import Task

__all__ = ["Operator", "Proposal", "ProposalContext"]


@dataclass(frozen=True)
class ProposalContext:
    """What an operator may use. ``rng`` is owned by this one proposal (derived from seed and counter).

    ``parents`` are stored candidates with their full results; ``inspirations`` are elites of other
    cells; ``hints`` are memory hits for the parents (empty without a memory).
    """

    space: ParamSpace
    rng: np.random.Generator
    task: Task | None = None
    parents: Sequence[Candidate] = ()
    inspirations: Sequence[Candidate] = ()
    hints: Sequence[Any] = ()

    @property
    def parent_genomes(self) -> list[Genome]:
        return [p.genome for p in self.parents]


@dataclass
class Proposal:
    """An operator's answer: a child genome, or ``None`` when it tried and produced nothing valid.

    ``on_commit(store, candidate_id)`` runs in the controller's thread once the child is stored
    (``candidate_id`` is ``None`` when there was no child or it was a duplicate): operators record
    what they did (e.g. model calls) through it, since the store belongs to the controller's thread.
    """

    genome: Genome | None
    on_commit: Callable[[Store, str | None], None] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Operator(abc.ABC):
    """What the proposer asks of an operator: every member here, nothing reached past it. Subclasses set the
    three class attributes and implement :meth:`propose`; the rest has defaults for an operator that never
    rests, records nothing and holds nothing."""

    name: ClassVar[str]
    arity: ClassVar[int]  # parents it needs (0 for operators that sample from scratch)
    blocking: ClassVar[bool]  # True when a proposal waits on something slow (a model): run off the controller's thread

    @abc.abstractmethod
    def propose(self, ctx: ProposalContext) -> Genome | Proposal | None:
        """A child genome (or a :class:`Proposal`), or ``None`` when this operator has nothing to offer."""

    def available(self) -> bool:
        """Whether it may be asked now (a model-backed operator rests while its endpoint is down or its budget
        is spent)."""
        return True

    def on_result(self, store: Store, candidate_id: str, status: Any, add_status: Any) -> None:
        """What became of a child it proposed (its status, and whether it entered the archive)."""
        return None  # the default records nothing

    def close(self) -> None:
        """Lets go of what it holds (threads, connections) when the search ends."""
        return None  # the default holds nothing

"""The operator protocol: given parents, propose one child genome."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from genome import Genome, ParamSpace

__all__ = ["Operator", "ProposalContext"]


@dataclass(frozen=True)
class ProposalContext:
    """What an operator may use: the space to stay inside and a generator owned by this proposal."""

    space: ParamSpace
    rng: np.random.Generator


class Operator(Protocol):
    name: str
    arity: int  # parents it needs (0 for operators that sample from scratch)

    def propose(self, parents: list[Genome], ctx: ProposalContext) -> Genome | None:
        """A child genome, or ``None`` when this operator has nothing valid to offer."""

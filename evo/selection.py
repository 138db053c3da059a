"""Parent selection over the archive's elites: uniform, tournament (fitness-biased) or curiosity.

Every scheme draws a ``uniform_fraction`` of parents uniformly, so no niche is starved.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from evo.config import SelectionConfig

__all__ = ["Curiosity", "select_parents"]


class _Elite(Protocol):
    id: str
    fitness: float


class Curiosity:
    """Per-candidate curiosity: rises when its children enter the archive, falls when they do not.

    The score follows the CURIOSITY scheme of Cully & Demiris (2018): +1 for a child that is added,
    -0.5 for one that is not. Scores start at 0; selection prefers the highest (ties at random).
    """

    def __init__(self) -> None:
        self.scores: defaultdict[str, float] = defaultdict(float)

    def update(self, parent_ids: Sequence[str], added: bool) -> None:
        for pid in parent_ids:
            self.scores[pid] += 1.0 if added else -0.5


def select_parents(
    elites: Sequence[_Elite],
    k: int,
    rng: np.random.Generator,
    config: SelectionConfig,
    curiosity: Curiosity | None = None,
) -> list[_Elite]:
    """``k`` parents (with replacement) from a non-empty list of elites."""
    if not elites:
        raise ValueError("no elites to select from")
    out = []
    for _ in range(k):
        if config.scheme == "uniform" or rng.random() < config.uniform_fraction:
            out.append(elites[int(rng.integers(len(elites)))])
            continue
        idx = rng.integers(len(elites), size=min(config.tournament_size, len(elites)))
        pool = [elites[int(i)] for i in idx]
        if config.scheme == "tournament":
            out.append(max(pool, key=lambda e: e.fitness))
        else:
            scores = curiosity.scores if curiosity is not None else {}
            best = max(scores.get(e.id, 0.0) for e in pool)
            tied = [e for e in pool if scores.get(e.id, 0.0) == best]
            out.append(tied[int(rng.integers(len(tied)))])
    return out

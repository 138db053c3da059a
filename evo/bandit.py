"""Adaptive operator choice: a bandit rewarded when an operator's child enters the archive.

Discounted Thompson sampling: each operator keeps a Beta(1 + wins, 1 + losses) belief that its next
child is a ``new_cell`` or ``improved``; every update first decays all counts by ``discount``, so the
belief follows a search whose best operator changes over time (parameters early, code rewrites late).
The draw comes from the proposal's own generator, so choices stay reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["OperatorBandit"]


class OperatorBandit:
    def __init__(self, names: Sequence[str], *, discount: float = 0.98) -> None:
        self.wins = dict.fromkeys(names, 0.0)
        self.losses = dict.fromkeys(names, 0.0)
        self.discount = discount

    def choose(self, names: Sequence[str], rng: np.random.Generator) -> str:
        """One of ``names`` (a subset of the arms: those able to propose now)."""
        draws = [rng.beta(1.0 + self.wins[n], 1.0 + self.losses[n]) for n in names]
        return names[int(np.argmax(draws))]

    def update(self, name: str, rewarded: bool) -> None:
        if name not in self.wins:
            return
        for n in self.wins:
            self.wins[n] *= self.discount
            self.losses[n] *= self.discount
        if rewarded:
            self.wins[name] += 1.0
        else:
            self.losses[name] += 1.0

    def shares(self) -> dict[str, float]:
        """The expected reward of each arm (for reports)."""
        return {n: (1.0 + self.wins[n]) / (2.0 + self.wins[n] + self.losses[n]) for n in self.wins}

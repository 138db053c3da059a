"""Duels: a would-be new best is re-timed side by side against the current best before it is crowned.

Timings on a shared machine drift by tens of percent between evaluations, so a challenger a few percent
above the best may only have been timed in a quiet moment. When a result lands within
``search.duel_margin`` above the best, the controller holds it back and asks a worker to time both
kernels (or engines) interleaved, under the timing lock. The duel's ratio decides: a challenger faster
side by side keeps its fitness and is crowned; one that is not gets the best's fitness times the ratio
(below the best, where the side-by-side timing puts it). The candidate's result is recorded once, after
the duel, so a run killed mid-duel re-evaluates it on resume.
"""

from __future__ import annotations

from dataclasses import replace

from runtime.result import EvalResult, Status

__all__ = ["DUEL_BACKENDS", "settle", "wants_duel"]

DUEL_BACKENDS = ("c", "engine")
"""Backends whose evaluation can time two genomes side by side."""


def wants_duel(result: EvalResult, best_fitness: float | None, margin: float) -> bool:
    """True when ``result`` would be the new best, but by no more than ``margin`` (a fraction) of the best."""
    if margin <= 0 or best_fitness is None or best_fitness <= 0:
        return False
    if result.status != Status.OK or result.fitness is None:
        return False
    return best_fitness < result.fitness <= best_fitness * (1.0 + margin)


def settle(result: EvalResult, duel: EvalResult, rival_id: str, rival_fitness: float) -> EvalResult:
    """The challenger's result once its duel is over (``duel`` is the duel evaluation's result).

    A duel that failed (the rival no longer compiles, a crash) leaves the result as it was, noted in
    its metrics; so does a won duel. A lost one (ratio <= 1) caps the fitness at ``rival_fitness * ratio``.
    """
    ratio = duel.metrics.get("duel_ratio") if duel.status == Status.OK else None
    note = {"rival": rival_id, "rival_fitness": rival_fitness, "ratio": ratio}
    if ratio is None:
        note["error"] = duel.error or f"duel ended {duel.status}"
        return replace(result, metrics={**result.metrics, "duel": note})
    note["won"] = won = ratio > 1.0
    if won or result.fitness is None:
        return replace(result, metrics={**result.metrics, "duel": note})
    return replace(result, fitness=rival_fitness * ratio,
                   metrics={**result.metrics, "duel": note, "fitness_before_duel": result.fitness})

"""Duels: a would-be new best is re-timed side by side against the current best before it is crowned.

Timings on a shared machine drift by tens of percent between evaluations, and a worker's state can bias
them for as long as it lives, so a challenger may have been timed in a quiet moment or a lucky worker;
the bigger its claim, the more it needs checking. Every result that would be the new best, whatever its
margin, is held back (when the task's backend offers duels) while a worker times it and the best
interleaved, on the same inputs, under the timing lock. The duel's ratio
decides: a challenger faster side by side is crowned, its figure cut to where the ratio puts it (the
best's figure times the ratio) when its claim says more: the claim was picked for being high, the
ratio is a second measurement, side by side. Never more than the claim: the best's own figure may
come from another state of the machine (a shared host runs fast and slow phases, and a kernel and
BLAS do not slow alike), so the figure the ratio points at may be too high as well as too low, and
averaging the two crowned over-rated winners of a user task by up to 23%. The two are compared on
``vs_reference``, not raw fitness: the machine's speed drifts between the two evaluations, and
``vs_reference`` was measured beside the reference each time. One that is not faster
gets the best's fitness times the ratio (below the best, where the side-by-side timing puts it); one
that fails its re-check, or gets no verdict, is not crowned either (:func:`settle`). The candidate's result is
recorded once, after the duel: a run killed mid-duel re-evaluates it on resume; one stopped by its
budget records it capped at the best.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from runtime.result import EvalResult, Status

if TYPE_CHECKING:
    from archive import Candidate
    from runtime.executors import EvalRequest

__all__ = ["Challenges", "settle", "wants_duel"]


class Challenges:
    """The search's side of duels: results that would be the new best, held back while they duel the best.

    Duels start only while ``enabled`` (the task's backend offers them) and until :meth:`close` (the search
    stops, or confirms its best); a result held when the run stops is recorded by :meth:`abandon`, capped at
    the best it did not beat."""

    def __init__(self, *, enabled: bool) -> None:
        self._open = enabled
        self._held: dict[str, tuple[EvalRequest, EvalResult, Candidate]] = {}

    def close(self) -> None:
        """No more duels: results that come back from now on are recorded as they are."""
        self._open = False

    def challenge(self, request: EvalRequest, result: EvalResult, best: Candidate | None) -> EvalRequest | None:
        """The duel to run before ``result`` is recorded (``result`` is then held), or ``None``: record it now."""
        if not self._open or best is None or best.id == request.key or not wants_duel(result, best.fitness):
            return None
        self._held[request.key] = (request, result, best)
        return replace(request, stages="duel", rival=best.genome)

    def verdict(self, duel: EvalRequest, outcome: EvalResult) -> tuple[EvalRequest, EvalResult, Candidate]:
        """The held request, its result settled by the duel's ``outcome`` (:func:`settle`), and the rival."""
        request, result, best = self._held.pop(duel.key)
        return request, settle(result, outcome, best.id, best.fitness or 0.0, best.metrics.get("vs_reference")), best

    def abandon(self) -> list[tuple[EvalRequest, EvalResult]]:
        """Every held result whose duel did not come back, settled without a verdict: recorded, not crowned."""
        out = [(request, settle(result, None, best.id, best.fitness or 0.0)) for request, result, best in
               self._held.values()]  # fmt: skip
        self._held.clear()
        return out


def wants_duel(result: EvalResult, best_fitness: float | None) -> bool:
    """True when ``result`` would be the new best, by any margin: big claims need more proof, not less."""
    if best_fitness is None or best_fitness <= 0:
        return False
    if result.status != Status.OK or result.fitness is None:
        return False
    return result.fitness > best_fitness


def settle(result: EvalResult, duel: EvalResult | None, rival_id: str, rival_fitness: float,
           rival_vs_reference: float | None = None) -> EvalResult:  # fmt: skip
    """The challenger's result once its duel is over (``duel``: the duel evaluation's result, ``None`` when
    the run stopped before it came back). Only a challenger faster side by side is crowned:

    - won (ratio > 1, fitness within any budget): its fitness times ``min(1, rival_vs_reference * ratio /
      its vs_reference)`` (raw fitness in place of ``vs_reference`` where either is missing), and
      ``vs_reference`` scaled by as much; where that fitness would not rank it above the best (the
      machine drifted between the two timings), its fitness is ``rival_fitness * ratio``, and its
      ``vs_reference`` stays the estimate. A figure measured in a lucky (or an unlucky) moment is not what
      the run crowns;
    - lost (ratio <= 1, or over the engine's p99 budget in the duel): fitness ``rival_fitness * ratio``;
    - the challenger broke a rule when checked again (``wrong``, ``invalid``): the duel's failure is its result;
    - the rival broke a rule (its outputs checked against the reference, as the challenger's): the challenger
      stands with its own figure, crowned (the caller demotes the rival);
    - no verdict (the duel crashed, timed out, or never ran): capped at ``rival_fitness``, not crowned.
    """
    ratio = duel.metrics.get("duel_ratio") if duel is not None and duel.status == Status.OK else None
    note: dict[str, object] = {"rival": rival_id, "rival_fitness": rival_fitness, "ratio": ratio}
    if result.fitness is None:
        return replace(result, metrics={**result.metrics, "duel": note})
    if duel is not None and duel.status in (Status.WRONG, Status.INVALID):
        note["won"] = False
        return replace(duel, metrics={**duel.metrics, "duel": note, "fitness_before_duel": result.fitness})
    if duel is not None and duel.status == Status.OK and duel.metrics.get("rival_failed"):
        note.update(won=True, rival_failed=duel.metrics["rival_failed"])
        return replace(result, metrics={**result.metrics, "duel": note})
    if ratio is None:
        note["won"] = False
        note["error"] = "the run stopped first" if duel is None else (duel.error or f"duel ended {duel.status}")
        return _capped(result, min(result.fitness, rival_fitness), note)
    note["won"] = won = ratio > 1.0 and duel is not None and duel.fitness is not None
    if not won:
        return _capped(result, rival_fitness * min(ratio, 1.0), note)
    claim = result.metrics.get("vs_reference")
    if isinstance(claim, (int, float)) and claim > 0 and rival_vs_reference:
        factor = min(1.0, rival_vs_reference * ratio / claim)
    else:
        factor = min(1.0, rival_fitness * ratio / result.fitness)
    fitness = result.fitness * factor
    if fitness == result.fitness:
        return replace(result, metrics={**result.metrics, "duel": note})
    settled = _capped(result, fitness, note)
    if fitness <= rival_fitness:  # the machine drifted: it still ranks above the best it beat, by the ratio
        settled = replace(settled, fitness=rival_fitness * ratio)  # its vs_reference stays the estimate
    return settled


def _capped(result: EvalResult, fitness: float, note: dict[str, object]) -> EvalResult:
    """``result`` with ``fitness``, and ``vs_reference`` scaled by as much."""
    metrics = {**result.metrics, "duel": note, "fitness_before_duel": result.fitness}
    vs = metrics.get("vs_reference")
    if isinstance(vs, (int, float)) and result.fitness:
        metrics["vs_reference"] = vs * fitness / result.fitness
    return replace(result, fitness=fitness, metrics=metrics)

"""Confirmation: the run's best is evaluated again after the search, and what that measures is its figure.

The best was picked because its figure was the highest, so its figure is biased high (the winner's
curse); a duel checks it side by side against the best before it, but it is still crowned near its
claim. A fresh measurement taken after the choice carries no such bias. A shared host also runs in
fast and slow phases minutes long, and a kernel and its reference do not slow alike, so a figure
taken early in a run may not hold later even as a ratio to the reference: what the run reports must
be measured when the run ends. So once the search stops, the best is evaluated ``repeats`` more
times, each in a fresh host, on fresh inputs, as any candidate is, and its result becomes the
median of those (:func:`confirmed_result`): a figure in the task's unit is always one that was
measured, never one scaled from another.

Ranking. The search ranks by fitness as it goes (a duel keeps each new best comparable with the one it
beats); the confirmed figures are measured later, in another phase of the machine, so their fitness
is not comparable with the figures recorded during the search. What is comparable across phases is
``vs_reference``, the ratio to the reference timed beside the kernel each time. So the confirmation
walks down the run's ranking: while the best candidate not yet confirmed outranks the confirmed leader
(:func:`outranks`: by ``vs_reference``), it is confirmed in turn, up to ``top`` candidates; and the
confirmed candidates rank among themselves by ``vs_reference`` where every one has it, else by fitness
(:func:`ranked`). The store keeps that order, and its best are the confirmed candidates first
(:meth:`archive.Store.best`). A best that fails its confirmation (wrong, invalid, crashed) takes that
failure as its result: a figure that cannot be measured again is not a best.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from runtime.result import EvalResult, Status

if TYPE_CHECKING:
    from archive import Candidate, Store
    from evo.config import ConfirmConfig

__all__ = ["CONFIRMED", "Confirmation", "confirmed_result", "outranks", "provenance", "ranked"]

CONFIRMED = "confirmed"  # the metrics key a confirmed result carries


class _Figures(Protocol):
    """A result or a stored candidate: what ranking reads."""

    @property
    def fitness(self) -> float | None: ...
    @property
    def metrics(self) -> Mapping[str, Any]: ...


_C = TypeVar("_C", bound=_Figures)


def confirmed_result(recorded: EvalResult, again: Sequence[EvalResult]) -> EvalResult:
    """The result a candidate recorded as ``recorded`` keeps after its re-evaluations ``again``.

    All ok: the re-evaluation with the median fitness (the lower middle one for an even count), as it
    was measured: its fitness, its own ``vs_reference`` (not a median of the ratios: the two come from
    one timing, beside one run of the reference) and every other metric of it, with the recorded duel
    note and ``metrics["confirmed"]`` listing every figure and the recorded ones. Nothing is scaled: a
    recorded figure that was high because the reference ran fast in its phase (a low recorded ratio)
    does not lift what is measured now. Any failure: the first failure, with the same note.
    """
    if not again:
        raise ValueError("a confirmation needs at least one re-evaluation")
    note = {
        "recorded_fitness": recorded.fitness,
        "recorded_vs_reference": recorded.metrics.get("vs_reference"),
        "fitness": [r.fitness for r in again],
        "vs_reference": [r.metrics.get("vs_reference") for r in again],
        "statuses": [str(r.status) for r in again],
    }
    kept = {k: recorded.metrics[k] for k in ("duel", "fitness_before_duel") if k in recorded.metrics}
    failed = [r for r in again if r.status != Status.OK or r.fitness is None]
    if failed:
        first = failed[0]
        return replace(first, fitness=None, metrics={**first.metrics, **kept, CONFIRMED: note})
    by_fitness = sorted(again, key=lambda r: r.fitness or 0.0)
    median = by_fitness[(len(by_fitness) - 1) // 2]
    return replace(median, metrics={**median.metrics, **kept, CONFIRMED: note})


def provenance(metrics: Mapping[str, Any], *, short: bool = False) -> str:
    """Where a stored figure comes from, in words, for whatever shows it beside the figure (``short``: a
    table cell, ``confirmed x3`` or ``search``)."""
    note = metrics.get(CONFIRMED)
    if isinstance(note, Mapping):
        n = len(note.get("fitness") or ())
        return f"confirmed x{n}" if short else f"confirmed: the median of {n} fresh evaluations after the search"
    return "search" if short else "recorded during the search (not confirmed)"


def outranks(challenger: _Figures, leader: _Figures) -> bool:
    """Whether ``challenger`` ranks above ``leader``: by ``vs_reference`` where both have one (comparable
    across the machine's phases), else by fitness. A tie keeps the leader."""
    a, b = _ratio(challenger), _ratio(leader)
    if a is not None and b is not None:
        return a > b
    return (challenger.fitness or 0.0) > (leader.fitness or 0.0)


def ranked(confirmed: Sequence[_C]) -> list[_C]:
    """Confirmed candidates best first: by ``vs_reference`` where every one has it, else by fitness (a
    stable sort: ties keep their order)."""
    if all(_ratio(c) is not None for c in confirmed):
        return sorted(confirmed, key=lambda c: -(_ratio(c) or 0.0))
    return sorted(confirmed, key=lambda c: -(c.fitness or 0.0))


def _ratio(result: _Figures) -> float | None:
    """The result's ratio to the reference timed beside it, ``None`` where it has none."""
    vs = result.metrics.get("vs_reference")
    return float(vs) if isinstance(vs, (int, float)) and vs > 0 else None


class Confirmation:
    """The confirmation of a run's best once its search stops: the best not yet confirmed, while it outranks the
    confirmed leader, is evaluated ``repeats`` more times (by ``evaluate_again``), up to ``top`` of them, and
    the store keeps each one's :func:`confirmed_result` and the confirmed ranking."""

    def __init__(self, settings: ConfirmConfig, store: Store, unit: str, note: Callable[[str], None]) -> None:
        self.settings, self.store, self.unit, self.note = settings, store, unit, note

    def run(self, evaluate_again: Callable[[Candidate, int], list[EvalResult]]) -> bool:
        """Confirms what needs it; whether any stored figure changed."""
        repeats, top = self.settings.repeats, self.settings.top
        if repeats == 0:
            return False
        confirmed = set(self.store.confirmed())
        leaders = [c for c in self.store.best(len(confirmed)) if c.id in confirmed]  # those still ok, best first
        changed = False
        for _ in range(top):
            cand = self._unconfirmed(leaders)
            if cand is None or (leaders and not outranks(cand, leaders[0])):
                break
            self.note(f"confirming the best {cand.id[:12]} ({cand.fitness:.4g} {self.unit}): "
                      f"{repeats} fresh evaluations")  # fmt: skip
            again = evaluate_again(cand, repeats)
            recorded = EvalResult(status=Status(cand.status), fitness=cand.fitness, unit=cand.unit,
                                  metrics=cand.metrics)  # fmt: skip
            result = confirmed_result(recorded, again)
            ok = result.status == Status.OK
            now = ranked([*leaders, replace(cand, fitness=result.fitness, metrics=result.metrics)]
                         if ok else leaders)  # fmt: skip
            self.store.revise_result(cand.id, result, descriptors=cand.descriptors if ok else {},
                                     confirmed=[c.id for c in now])  # fmt: skip
            leaders, changed = self.store.get_many([c.id for c in now]), True
            figures = ", ".join(f"{r.fitness:.4g}" if r.fitness is not None else str(r.status) for r in again)
            vs = result.metrics.get("vs_reference")
            self.note(f"confirmed {cand.id[:12]}: recorded {cand.fitness:.4g}, again {figures}: "
                      + (f"keeps {result.fitness:.4g} {self.unit}, the median measured"
                         + (f" ({vs:.3f}x the reference)" if vs is not None else "") if ok
                         else f"{result.status}: {result.error}"))  # fmt: skip
        else:
            cand = self._unconfirmed(leaders)
            if cand is not None and not leaders:
                self.note(f"the best is not confirmed: {top} candidates were (search.confirm.top)")
            elif cand is not None and outranks(cand, leaders[0]):
                self.note(f"{cand.id[:12]} recorded a figure above the confirmed best's but is not confirmed: "
                          f"{top} candidates were (search.confirm.top); the best is the confirmed "
                          f"{leaders[0].id[:12]}")  # fmt: skip
        return changed

    def _unconfirmed(self, leaders: list[Candidate]) -> Candidate | None:
        """The best candidate not confirmed yet, by the search's own ranking (fitness)."""
        found = self.store.best(len(leaders) + 1)
        return found[-1] if len(found) > len(leaders) else None

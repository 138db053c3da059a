"""Confirmation: the run's best is evaluated again after the search, and that is the figure it keeps.

The best was picked because its figure was the highest, so its figure is biased high (the winner's
curse); a duel checks it side by side against the best before it, but it is still crowned near its
claim. A fresh measurement taken after the choice carries no such bias. A shared host also runs in
fast and slow phases minutes long, and a kernel and its reference do not slow alike, so a figure
taken early in a run may not hold later even as a ratio to the reference: what the run reports must
be measured when the run ends. So once the search stops, the best is evaluated ``repeats`` more
times, each in a fresh host, on fresh inputs, as any candidate is, and its result becomes the
median of those (on the run's scale: :func:`confirmed_result`). If that ranks it below another
candidate whose figure is not confirmed, that one is confirmed in turn, up to ``top`` candidates. A
best that fails its confirmation (wrong, invalid, crashed) takes that failure as its result: a figure
that cannot be measured again is not a best.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from runtime.result import EvalResult, Status

__all__ = ["CONFIRMED", "confirmed_result"]

CONFIRMED = "confirmed"  # the metrics key a confirmed result carries


def confirmed_result(recorded: EvalResult, again: Sequence[EvalResult]) -> EvalResult:
    """The result a candidate recorded as ``recorded`` keeps after its re-evaluations ``again``.

    All ok: the re-evaluation with the median ``vs_reference`` (the lower middle one for an even count:
    a real measurement, whose metrics agree), with the recorded duel note and ``metrics["confirmed"]``
    listing every figure. Its fitness is the recorded one scaled by the confirmed ``vs_reference`` over
    the recorded one: the ratio to the reference, timed beside it each time, is what holds when the
    machine's speed drifts (as in a duel), so the confirmed figure stays comparable with the rest of the
    run's. Where either has no ``vs_reference``, the median fitness itself. Any failure: the first
    failure, with the same note.
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
    claim = _ratio(recorded)
    by_ratio = claim is not None and recorded.fitness is not None and all(_ratio(r) is not None for r in again)
    ranked = sorted(again, key=lambda r: (_ratio(r) if by_ratio else r.fitness) or 0.0)
    median = ranked[(len(ranked) - 1) // 2]
    fitness = median.fitness
    if by_ratio:
        fitness = (recorded.fitness or 0.0) * (_ratio(median) or 0.0) / (claim or 1.0)
    return replace(median, fitness=fitness, metrics={**median.metrics, **kept, CONFIRMED: note})


def _ratio(result: EvalResult) -> float | None:
    vs = result.metrics.get("vs_reference")
    return float(vs) if isinstance(vs, (int, float)) and vs > 0 else None

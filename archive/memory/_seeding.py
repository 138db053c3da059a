"""Turning memory hits into seeds of a new run: ranking for a task, mapping params into a new space.

Ranking (:func:`seed_score`), each term in [0, 1]::

    score = 0.35 * similarity      cosine of the entry's text to the new task's text, clipped to [0, 1]
          + 0.25 * task_match      0 for another task; 0.7 + 0.3 * (share of task args with equal values)
          + 0.20 * hardware_match  1 same fingerprint id, 0.5 same CPU model, 0 otherwise
          + 0.20 * quality         rank of the entry's vs_reference (else fitness) among the candidates of its
                                   own task, 1 for the best, 0 for the worst (0.5 when it is alone)

so an entry of the same task on the same machine outranks any other, and among those the fittest wins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from archive.memory._entry import MemoryEntry, MemoryHit
from genome import Genome, ParamSpace

__all__ = ["SEED_WEIGHTS", "map_params", "quality_ranks", "seed_genomes", "seed_score"]

SEED_WEIGHTS = {"similarity": 0.35, "task": 0.25, "hardware": 0.20, "quality": 0.20}


def _args_overlap(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    keys = set(a) | set(b)
    return 1.0 if not keys else sum(1 for k in keys if k in a and k in b and a[k] == b[k]) / len(keys)


def seed_score(
    entry: MemoryEntry,
    similarity: float,
    quality: float,
    *,
    task: str,
    task_args: Mapping[str, Any],
    hardware: Mapping[str, Any] | None,
) -> float:
    """The blend documented in this module's docstring."""
    task_match = 0.0 if entry.task != task else 0.7 + 0.3 * _args_overlap(entry.task_args, task_args)
    hw = dict(hardware or {})
    if hw.get("id") and entry.hardware.get("id") == hw.get("id"):
        hw_match = 1.0
    elif hw.get("cpu_model") and entry.hardware.get("cpu_model") == hw.get("cpu_model"):
        hw_match = 0.5
    else:
        hw_match = 0.0
    w = SEED_WEIGHTS
    return (w["similarity"] * min(max(similarity, 0.0), 1.0) + w["task"] * task_match
            + w["hardware"] * hw_match + w["quality"] * quality)  # fmt: skip


def quality_ranks(entries: Sequence[MemoryEntry]) -> list[float]:
    """Each entry's rank in [0, 1] by vs_reference (else fitness) among the entries of its own task."""
    def key(e: MemoryEntry) -> float:
        value = e.vs_reference if e.vs_reference is not None else e.fitness
        return float("-inf") if value is None else float(value)

    by_task: dict[str, list[int]] = {}
    for i, e in enumerate(entries):
        by_task.setdefault(e.task, []).append(i)
    out = [0.0] * len(entries)
    for idx in by_task.values():
        order = sorted(idx, key=lambda i: key(entries[i]))
        for rank, i in enumerate(order):
            out[i] = 0.5 if len(order) == 1 else rank / (len(order) - 1)
            if key(entries[i]) == float("-inf"):
                out[i] = 0.0
    return out


def map_params(params: Mapping[str, Any], space: ParamSpace, rng: np.random.Generator) -> dict[str, Any] | None:
    """``params`` carried into ``space``: unknown names dropped, values snapped (clamped) into their domains,
    names the old point lacks drawn at random, then constraints repaired (:meth:`ParamSpace.repair`).

    ``None`` when repair fails, or when the point shares no parameter with a non-empty space (it would
    be a random point, not a memory).
    """
    kept = {k: v for k, v in params.items() if k in space.params}
    if space.params and not kept:
        return None
    point = space.repair(kept, rng)
    return None if point is None or not space.is_valid(point) else point


def seed_genomes(
    hits: Sequence[MemoryHit], task: Any, space: ParamSpace, rng: np.random.Generator
) -> list[tuple[Genome, str]]:
    """One genome per usable hit, best hit first, with the run it came from (duplicates dropped).

    ``task`` is the new run's :class:`runtime.Task`. A code genome (``source`` set) is reused as code only
    for the same task name and C signature; otherwise, as for template genomes, its params are mapped
    into ``space`` and the task's template is used. Code seeds keep params only if they map.
    """
    out: list[tuple[Genome, str]] = []
    seen: set[str] = set()  # seed genome ids
    used: set[str] = set()  # entry ids (a repeated hit would map to another random repair)
    for hit in hits:
        e = hit.entry
        g = e.genome
        if e.id in used:
            continue
        used.add(e.id)
        same_code = g.source is not None and e.task == task.name and e.signature == getattr(task, "signature", None)
        if same_code:
            params = map_params(g.params, space, rng) if g.params else {}
            genome = None if params is None else Genome(params=params, source=g.source)
        else:
            params = map_params(g.params, space, rng) if g.params else None
            genome = None if params is None else Genome(params=params)
        if genome is not None and genome.id not in seen:
            seen.add(genome.id)
            out.append((genome, e.run))
    return out

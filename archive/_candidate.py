"""A stored candidate: its genome, where it came from, and (once evaluated) its result."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from genome import Genome
from runtime.result import Status

__all__ = ["COLUMNS", "Candidate", "dumps", "from_row"]

# The column order every SELECT of whole candidates uses; ``from_row`` reads rows in this order.
COLUMNS = (
    "id, seq, parents, operator, params, source, status, fitness, unit, metrics, descriptors,"
    " error, timings, hardware_id, created_at, evaluated_at, eval_seq"
)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One row of ``candidates``. ``fitness`` is ``None`` unless ``status`` is ok."""

    id: str
    seq: int
    parents: tuple[str, ...]
    operator: str
    params: dict[str, Any]
    source: str | None
    status: Status
    fitness: float | None = None
    unit: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    descriptors: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    hardware_id: str | None = None
    created_at: float = 0.0
    evaluated_at: float | None = None
    eval_seq: int | None = None

    @property
    def genome(self) -> Genome:
        return Genome(params=self.params, source=self.source)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``evo archive ... --json`` and the serving API show)."""
        return {
            "id": self.id,
            "seq": self.seq,
            "status": str(self.status),
            "fitness": self.fitness,
            "unit": self.unit,
            "metrics": self.metrics,
            "params": self.params,
            "source": self.source,
            "descriptors": self.descriptors,
            "operator": self.operator,
            "parents": list(self.parents),
            "error": self.error,
            "timings": self.timings,
            "hardware_id": self.hardware_id,
            "created_at": self.created_at,
            "evaluated_at": self.evaluated_at,
            "eval_seq": self.eval_seq,
        }


def from_row(row: tuple[Any, ...]) -> Candidate:
    """Builds a :class:`Candidate` from a row selected as :data:`COLUMNS`."""
    (cid, seq, parents, operator, params, source, status, fitness, unit, metrics, descriptors,
     error, timings, hardware_id, created_at, evaluated_at, eval_seq) = row  # fmt: skip
    return Candidate(
        id=cid,
        seq=seq,
        parents=tuple(json.loads(parents)),
        operator=operator,
        params=json.loads(params),
        source=source,
        status=Status(status),
        fitness=fitness,
        unit=unit,
        metrics=json.loads(metrics),
        descriptors=json.loads(descriptors),
        error=error,
        timings=json.loads(timings),
        hardware_id=hardware_id,
        created_at=created_at,
        evaluated_at=evaluated_at,
        eval_seq=eval_seq,
    )


def dumps(value: Any) -> str:
    """Compact JSON with non-finite floats stored as ``null``: SQLite's JSON functions reject NaN."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):  # NaN/inf or numpy scalars: the slow, careful path
        return json.dumps(_finite(value), separators=(",", ":"), allow_nan=False)


def _finite(value: Any) -> Any:
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()  # numpy scalar or array -> Python scalar or list
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value

"""What an evaluation answers: a status, the fitness in the task's unit, metrics and timings."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

__all__ = ["EvalResult", "Status", "TimingStats"]


class Status(StrEnum):
    """How a candidate's evaluation ended. Only ``ok`` candidates carry a fitness."""

    PENDING = "pending"  # stored, not yet evaluated
    OK = "ok"
    COMPILE_ERROR = "compile_error"  # the compiler rejected the source (error holds its message)
    CRASH = "crash"  # the worker died (error names the signal)
    TIMEOUT = "timeout"  # wall-clock or CPU limit hit; the worker's process group was killed
    WRONG = "wrong"  # output differs from the reference (error holds max error and where)
    INVALID = "invalid"  # broke a rule: wrote out of bounds, changed its inputs, bad genome, ...


@dataclass(frozen=True, kw_only=True)
class TimingStats:
    """Seconds per call over ``n`` timed repeats."""

    n: int
    min: float
    median: float
    mean: float
    std: float

    @classmethod
    def of(cls, samples: list[float]) -> TimingStats:
        s = sorted(samples)
        n = len(s)
        mid = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
        mean = sum(s) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in s) / n)
        return cls(n=n, min=s[0], median=mid, mean=mean, std=std)


@dataclass(kw_only=True)
class EvalResult:
    """One evaluation's outcome.

    ``fitness`` is higher-is-better in ``unit`` (``None`` unless ``status`` is ok). ``metrics`` always
    holds ``vs_reference`` for ok results: the reference's median time over the candidate's, timed
    interleaved in the same worker (> 1 means faster than the reference).
    ``timings`` holds wall seconds per stage (compile, check, time, total).
    """

    status: Status
    fitness: float | None = None
    unit: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    hardware: dict[str, Any] | None = None
    outputs: dict[str, Any] | None = None  # the kernel's outputs (numpy arrays) of a stages="run" request

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = str(self.status)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalResult:
        return cls(**{**d, "status": Status(d["status"])})

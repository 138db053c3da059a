"""The executor seam: submit a request, get its result. :class:`Executor` is everything a caller may use of an
executor; :class:`EvalRequest` is what travels to it."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

import numpy as np

from genome import Genome
from runtime.backends.base import Stage
from runtime.result import EvalResult
from runtime.settings import EvalSettings, TaskSpec

__all__ = ["EvalRequest", "Executor"]


@dataclass(frozen=True)
class EvalRequest:
    """Everything a worker needs to evaluate one genome, and nothing secret."""

    key: str  # the candidate id, echoed back with the result
    genome: Genome
    task: TaskSpec
    settings: EvalSettings
    cache_dir: str  # compile cache (shared by the workers of a run)
    sys_path: tuple[str, ...] = field(default=())  # extra import paths for a user's task module
    # how far the cascade goes (runtime.cascade): "compile" stops after building and loading, "check" after
    # the correctness checks (no timing, no lock), "full" times it too. Partial runs end ``ok`` without a
    # fitness. Two stages are optional, offered by the backends whose programs can (asking another backend
    # is an UnsupportedStage error): "run" calls the candidate once on ``inputs`` for ``case`` (guarded,
    # checked for integrity) and returns its outputs in ``EvalResult.outputs`` (serving's kernel invoke);
    # "duel" checks the genome again, then times it side by side with ``rival`` (the current best):
    # ``metrics["duel_ratio"]`` is the rival's time over the genome's (> 1: the genome is faster); "profile"
    # checks the genome, then says where its time goes (``metrics["profile"]``: the factory's plans).
    stages: Stage = "full"
    rival: Genome | None = None  # stages="duel" only
    case: Mapping[str, Any] | None = None  # stages="run" only
    inputs: Mapping[str, np.ndarray] | None = None  # stages="run" only: the case's inputs by name


class Executor(Protocol):
    """Runs evaluation requests, up to :attr:`slots` at once, and hands back their results as they finish.

    The implementations subclass it (and so share its context manager); a stand-in need only match it."""

    @abstractmethod
    def submit(self, request: EvalRequest) -> None:
        """Queues ``request``; never blocks on the evaluation itself. Raises here, in the caller, what the
        request can never do (its backend lacks the stage, the compiler is missing) and after :meth:`close`."""

    @abstractmethod
    def next_result(self, timeout: float | None = None) -> tuple[EvalRequest, EvalResult] | None:
        """The next finished evaluation, or ``None`` if none finished within ``timeout`` seconds."""

    @property
    @abstractmethod
    def in_flight(self) -> int:
        """Submitted requests whose results were not yet returned."""

    @property
    @abstractmethod
    def slots(self) -> int:
        """How many requests it evaluates at once (more are queued); a caller keeps this many in flight."""

    @abstractmethod
    def close(self) -> None:
        """Stops all workers (killing their process groups); idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

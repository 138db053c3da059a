"""A backend small enough to read at a glance, for the cascade's tests: a candidate is a speed.

``ToyTask``'s genome is ``{"speed": s, "fail": stage}``: its program's fitness is ``s`` (the reference's
is 1, so ``vs_reference`` is ``s``), and it raises :class:`Failure` at ``stage`` (``compile``, ``load``,
``check``, ``confirm``); ``later_speed`` is its speed when timed again. Every program it loads is listed
in ``LOADED`` with whether it was closed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from genome import Genome, ParamSpace
from runtime.backends import Backend, Build, Duels, Failure, Measurement, Program, WorkerContext
from runtime.result import Status
from runtime.settings import EvalSettings
from runtime.task import Task

LOADED: list[ToyProgram] = []


class ToyTask(Task):
    name = "toy"
    unit = "ops/s"
    signature = "(a speed)"
    backend = "toy_backend:ToyBackend"

    def space(self) -> ParamSpace:
        return ParamSpace.from_dict({"params": {"speed": {"type": "int", "low": 1, "high": 100}}})

    def seeds(self) -> list[Genome]:
        return [Genome(params={"speed": 1})]

    def render(self, genome: Genome) -> str:
        return f"speed = {genome.params['speed']}"


class ToyProgram(Program, Duels):
    def __init__(self, params: Mapping[str, Any]) -> None:
        self.speed, self.fail, self.closed = float(params["speed"]), params.get("fail"), False
        self.later_speed, self.timed = float(params.get("later_speed", 0)), 0
        LOADED.append(self)

    def check(self, trials: int) -> dict[str, Any]:
        self.calls_s += 0.001
        if self.fail == "check":
            raise Failure(Status.WRONG, "answered 41", metrics={"answer": 41})
        return {"checked_trials": trials}

    def time(self) -> Measurement:
        self.calls_s += 0.002
        self.timed += 1
        speed = self.later_speed if self.timed > 1 and self.later_speed else self.speed
        return Measurement(speed, {"vs_reference": speed}, {"lock_wait_s": 0.0, "time_s": 0.002})

    def confirm(self) -> None:
        if self.fail == "confirm":
            raise Failure(Status.WRONG, "answered 41 on fresh inputs")

    def duel(self, open_rival: Callable[[], Program]) -> Measurement:
        rival = open_rival()
        assert isinstance(rival, ToyProgram)
        return Measurement(self.speed, {"duel_ratio": self.speed / rival.speed}, {"time_s": 0.001})

    def close(self) -> None:
        self.closed = True


class ToyBackend(Backend[ToyTask]):
    name = "toy"
    program = ToyProgram

    def compile(self, task: ToyTask, genome: Genome, settings: EvalSettings, ctx: WorkerContext) -> Build:
        if genome.params.get("fail") == "compile":
            raise Failure(Status.COMPILE_ERROR, "toy compiler says no")
        return Build(genome, dict(genome.params), 0.01, {"compile_cached": False, "toy_size": 1})

    def load(self, task: ToyTask, build: Build, settings: EvalSettings, ctx: WorkerContext) -> ToyProgram:
        if build.artifact.get("fail") == "load":
            raise Failure(Status.COMPILE_ERROR, "toy loader says no")
        return ToyProgram(build.artifact)

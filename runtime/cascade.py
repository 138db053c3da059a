"""The evaluation cascade, run inside a sandboxed worker: render + build -> load -> check -> time -> confirm.

One skeleton for every backend (:mod:`runtime.backends`): the backend does each stage's work, the
cascade decides which stages run for a request, stops at the first :class:`Failure`, and builds every
:class:`EvalResult` here. :func:`open_program` is the one place candidate code is loaded into a process;
after it, the candidate is called only through its :class:`Program`.

Stages by request (``EvalRequest.stages``):

- ``compile``: build and load; ``ok`` without a fitness.
- ``check``: then check correctness; ``ok`` without a fitness.
- ``full``: then time against the reference; a ``vs_reference`` above ``implausible_speedup`` is
  checked again on fresh inputs (``confirm``), timed again (the slower timing counts) and ``flagged``.
- ``run``: build, load, one call on the request's inputs; the outputs come back in ``outputs``.
- ``duel``: build and load the genome; its program re-checks itself, has the rival loaded (through
  the same loader) and times both side by side (``duel_ratio``: the rival's time over the genome's),
  each checked against the reference. A rival that breaks a rule ends the duel ``ok`` with no fitness
  and ``rival_failed`` (why) and ``rival_status`` in the metrics.

A fitness beyond the task's physical ceiling (:meth:`runtime.task.Task.ceiling`, from the core's measured
FMA peak) is ``invalid``, whatever produced it.

Timings: ``compile_s``, ``check_s``, ``lock_wait_s``, ``time_s``, ``total_s``, ``calls_s`` (inside the
candidate's and the reference's calls) and ``overhead_s`` (the rest, less compile and lock wait).
A failed result keeps only ``compile_cached`` and the metrics its :class:`Failure` carries.
"""

from __future__ import annotations

import time
from typing import Any

from genome import Genome
from runtime.backends import Backend, Failure, Program, RivalFailure, UnsupportedStage, WorkerContext, backend_for
from runtime.executors.base import EvalRequest
from runtime.result import EvalResult, Status
from runtime.settings import EvalSettings
from runtime.task import Task

__all__ = ["Failure", "WorkerContext", "evaluate", "open_program"]


def open_program(
    backend: Backend, task: Task, genome: Genome, settings: EvalSettings, ctx: WorkerContext,
    metrics: dict[str, Any], timings: dict[str, float],
) -> Program:  # fmt: skip
    """Builds ``genome`` and loads it: the one place candidate code enters this process. Records
    ``compile_s`` and the build's metrics."""
    build = backend.compile(task, genome, settings, ctx)
    timings["compile_s"] = timings.get("compile_s", 0.0) + build.seconds
    metrics.update(build.metrics)
    return backend.load(task, build, settings, ctx)


def evaluate(request: EvalRequest, task: Task, ctx: WorkerContext) -> EvalResult:
    """Runs the stages ``request`` asks for; a failing stage ends it with its status. The whole evaluation
    shares the machine's timing lock, which its timings hold alone: nothing of it runs while another
    worker times."""
    if ctx.lock is None:
        return _evaluate(request, task, ctx, 0.0)
    with ctx.lock.shared() as waited:
        return _evaluate(request, task, ctx, waited)


def _evaluate(request: EvalRequest, task: Task, ctx: WorkerContext, waited: float) -> EvalResult:
    t_start = time.perf_counter() - waited
    backend = backend_for(task)
    settings = request.settings
    timings: dict[str, float] = {}
    metrics: dict[str, Any] = {}
    fitness: float | None = None
    outputs: dict[str, Any] | None = None
    hardware = ctx.hardware
    opened: list[Program] = []
    try:
        try:
            backend.require(request.stages)
        except UnsupportedStage as exc:
            raise Failure(Status.INVALID, str(exc)) from None
        hardware = backend.hardware(task, ctx)
        program = open_program(backend, task, request.genome, settings, ctx, metrics, timings)
        opened.append(program)
        if request.stages == "run":
            outputs, mismatch = program.run(request.case or {}, request.inputs or {})  # type: ignore[attr-defined]
            metrics["matches_reference"] = mismatch is None
            if mismatch is not None:
                metrics["reference_mismatch"] = mismatch
        elif request.stages == "duel":

            def open_rival() -> Program:
                if request.rival is None:
                    raise Failure(Status.INVALID, "a duel needs a rival genome")
                try:
                    rival = open_program(backend, task, request.rival, settings, ctx, {}, {})
                except Failure as exc:
                    why = f"the rival {request.rival.id[:12]} could not be built: {exc}"
                    if exc.status == Status.COMPILE_ERROR:  # not here, not now (a compiler gone): no verdict
                        raise Failure(Status.COMPILE_ERROR, why) from None
                    raise RivalFailure(exc.status, why) from None  # its library crashed loading, say
                opened.append(rival)
                return rival

            try:
                duel = program.duel(open_rival)  # type: ignore[attr-defined]
            except RivalFailure as exc:  # a verdict against the rival: the challenger stands (its figures kept)
                metrics.update(exc.metrics, rival_failed=str(exc), rival_status=str(exc.status),
                               duel_rival=request.rival.id)  # type: ignore[union-attr]  # fmt: skip
                timings.update(exc.timings)
            else:
                fitness = duel.fitness
                metrics.update(duel.metrics, duel_rival=request.rival.id)  # type: ignore[union-attr]
                timings.update(duel.timings)
                _within_reach(task, fitness, settings, ctx)
        elif request.stages == "profile":
            metrics.update(program.check(settings.check_trials))
            measured = program.profile()  # type: ignore[attr-defined]
            metrics.update(measured.metrics)
            timings.update(measured.timings)
        elif request.stages != "compile":
            t0 = time.perf_counter()
            metrics.update(program.check(settings.check_trials))  # a failure carries check_s if it has one
            timings["check_s"] = time.perf_counter() - t0
            if request.stages == "full":
                fitness = _time(program, settings, metrics, timings)
                _within_reach(task, fitness, settings, ctx)
        status, error = Status.OK, None
    except Failure as exc:
        status, fitness, error = exc.status, None, str(exc)
        metrics = {**{k: v for k, v in metrics.items() if k == "compile_cached"}, **exc.metrics}
        timings.update(exc.timings)
    finally:
        for p in opened:
            p.close()
    calls = sum(p.calls_s for p in opened)
    total = time.perf_counter() - t_start
    timings.update(total_s=total, calls_s=calls)
    if waited > 0.001:  # for the share; the stages' own waits are in already
        timings["lock_wait_s"] = timings.get("lock_wait_s", 0.0) + waited
    timings["overhead_s"] = max(0.0, total - timings.get("compile_s", 0.0) - calls - timings.get("lock_wait_s", 0.0))
    return EvalResult(status=status, fitness=fitness, unit=task.unit, metrics=metrics, error=error, timings=timings,
                      hardware=hardware, outputs=outputs)  # fmt: skip


_CLOCK_MARGIN = 1.15
"""How far a fitness may exceed the task's ceiling before it is ``invalid``: the core's clock when the peak was
measured and when the candidate ran may differ (turbo), and a measurement only errs low."""


def _within_reach(task: Task, fitness: float | None, settings: EvalSettings, ctx: WorkerContext) -> None:
    """Raises ``invalid`` for a fitness beyond what the machine can physically do (:meth:`Task.ceiling`),
    after measuring the peak once more, now: no clock, calibration or subtraction may produce it."""
    if fitness is None or task.ceiling(1.0) is None:
        return
    core = settings.timing.core
    for again in (False, True):
        bound = task.ceiling(ctx.fma_peak(core, again=again))
        if bound is None or fitness <= bound * _CLOCK_MARGIN:
            return
    raise Failure(Status.INVALID, f"{fitness:.4g} {task.unit} is beyond what this machine can compute: at most "
                  f"{bound:.4g} by the cores' measured FMA peak of {ctx.peak_gflops:.4g} GFLOP/s each; "
                  "the timing was tampered with")  # fmt: skip


def _time(program: Program, settings: EvalSettings, metrics: dict[str, Any], timings: dict[str, float]) -> float | None:
    """The time stage, and the confirm stage for an implausible speed-up (checked again, then timed again:
    the slower timing counts); returns the fitness."""
    measured = program.time()
    metrics.update(measured.metrics, flagged=False)
    timings.update(measured.timings)
    speedup = measured.metrics.get("vs_reference")
    if speedup is None or speedup <= settings.implausible_speedup:
        return measured.fitness
    note = f"(on re-verifying an implausible {speedup:.1f}x speed-up)"
    try:
        program.confirm()
        again = program.time()
    except Failure as exc:
        raise Failure(exc.status, f"{exc} {note}", metrics=exc.metrics, timings={**timings, **exc.timings}) from None
    for key in ("lock_wait_s", "time_s"):
        timings[key] = timings.get(key, 0.0) + again.timings.get(key, 0.0)
    first = measured.fitness
    if again.fitness is None or (first is not None and again.fitness < first):
        metrics.update(again.metrics)
        measured = again
    metrics.update(flagged=True, fitness_first_timing=first)
    return measured.fitness

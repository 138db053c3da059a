"""The engine backend's evaluation, run in a sandboxed worker: build -> check similarity -> load -> measure.

``runtime.cascade.evaluate`` hands a task with ``backend = "engine"`` to :func:`evaluate_engine`.
Stages and statuses mirror the C cascade: a genome outside the engine's options is ``invalid``, a
kernel that does not compile ``compile_error``, an engine under the similarity floor ``wrong``.
The load runs under the machine-wide timing lock, pinned to ``threads`` cores. The default engine
(:class:`EngineConfig` defaults: one worker, one BLAS thread, numpy operators, fp32) is measured under
the same load and cores, again whenever its figures are older than ``reference_every_s`` (0: right
before every candidate); ``vs_reference`` is the candidate's throughput over it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from pydantic import ValidationError

from runtime.backends.c import CompileError
from runtime.cascade import Failure, WorkerContext
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.load import LoadResult, closed_loop
from runtime.engine.task import EngineTask
from runtime.engine.workers import proportional_mb
from runtime.executor import EvalRequest
from runtime.result import EvalResult, Status
from runtime.timing import pinned

__all__ = ["evaluate_engine", "measure"]


class _Done(Exception):
    """A partial evaluation (``request.stages``) reached its last stage."""


def measure(engine: Engine, task: EngineTask) -> tuple[LoadResult, float, int]:
    """Starts ``engine``, runs the task's load on it, then closes it.

    Returns the load's figures, the memory (PSS, MB, of this process and the engine's worker processes)
    at its end, and the batches the engine ran.
    """
    a = task.args
    with engine:
        result = closed_loop(engine.submit, task.texts(), concurrency=a.concurrency, duration_s=a.duration_s,
                             warmup_s=a.warmup_s)
        memory, batches = proportional_mb(engine.worker_pids), engine.batches
    return result, memory, batches


class _Dueled(Exception):
    """A duel is over; its figures are in the metrics."""


DUEL_ROUNDS = 2


def _duel(engine: Engine, request: EvalRequest, task: EngineTask, ctx: WorkerContext, metrics: dict[str, Any],
          timings: dict[str, float]) -> float | None:
    """Runs the load on ``engine`` and on the rival's engine in turn, ``DUEL_ROUNDS`` rounds each under the
    lock; ``duel_ratio`` is the median throughput over the rival's. Returns the engine's fitness from
    these rounds (``None`` when its median p99 is over the budget)."""
    if request.rival is None:
        raise Failure(Status.INVALID, "a duel needs a rival genome")
    settings, a = request.settings, task.args
    rival = task.build(task.engine_config(request.rival), compiler=settings.compiler, cache_dir=ctx.cache_dir,
                       work_dir=ctx.work_dir)
    mine: list[LoadResult] = []
    theirs: list[LoadResult] = []
    try:
        t0 = time.perf_counter()
        with ctx.lock.held() as waited, pinned(settings.timing.core, task.cores):
            for _ in range(DUEL_ROUNDS):
                for e, out in ((engine, mine), (rival, theirs)):
                    e.start()
                    try:
                        out.append(closed_loop(e.submit, task.texts(), concurrency=a.concurrency,
                                               duration_s=a.duration_s, warmup_s=a.warmup_s))
                    finally:
                        e.stop()
        timings["lock_wait_s"] = waited
        timings["time_s"] = time.perf_counter() - t0 - waited
    finally:
        rival.close()
    throughput = float(np.median([r.throughput for r in mine]))
    rival_throughput = float(np.median([r.throughput for r in theirs]))
    p99 = float(np.median([r.p99_ms for r in mine]))
    metrics.update(duel_ratio=throughput / rival_throughput if rival_throughput else float("inf"),
                   duel_rival=request.rival.id, throughput=throughput, p99_ms=p99,
                   rival_throughput=rival_throughput, duel_rounds=DUEL_ROUNDS)
    return None if p99 > a.p99_budget_ms else throughput


def evaluate_engine(request: EvalRequest, task: EngineTask, ctx: WorkerContext) -> EvalResult:
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    metrics: dict[str, Any] = {}
    settings = request.settings
    engine: Engine | None = None
    try:
        try:
            config = task.engine_config(request.genome)
        except (ValueError, ValidationError, TypeError) as exc:
            raise Failure(Status.INVALID, f"not an engine configuration: {exc}") from None
        t0 = time.perf_counter()
        try:
            engine = task.build(config, compiler=settings.compiler, cache_dir=ctx.cache_dir, work_dir=ctx.work_dir)
        except CompileError as exc:
            raise Failure(Status.COMPILE_ERROR, exc.stderr) from None
        timings["compile_s"] = time.perf_counter() - t0
        if request.stages == "compile":
            raise _Done

        t0 = time.perf_counter()
        similarity = task.similarity(engine)
        timings["check_s"] = time.perf_counter() - t0
        metrics["similarity"] = similarity
        if similarity < task.args.similarity_floor:
            raise Failure(Status.WRONG, f"min cosine to the fp32 engine {similarity:.5f} is under the floor "
                          f"{task.args.similarity_floor:g} (precision {config.precision})")
        if request.stages == "check":
            raise _Done
        if request.stages == "duel":
            fitness = _duel(engine, request, task, ctx, metrics, timings)
            raise _Dueled

        t0 = time.perf_counter()
        with ctx.lock.held() as waited, pinned(settings.timing.core, task.cores) as cores:
            age = time.monotonic() - task.reference_at
            if task.reference_load is None or age > task.args.reference_every_s:
                default = task.build(EngineConfig(), compiler=settings.compiler, cache_dir=ctx.cache_dir)
                task.reference_load, task.reference_at, age = measure(default, task)[0], time.monotonic(), 0.0
            run, memory, batches = measure(engine, task)
        engine = None  # closed by measure
        timings["lock_wait_s"] = waited
        timings["time_s"] = time.perf_counter() - t0 - waited
        ref: LoadResult = task.reference_load
        over = run.p99_ms > task.args.p99_budget_ms
        metrics.update(
            throughput=run.throughput, p50_ms=run.p50_ms, p99_ms=run.p99_ms, mean_ms=run.mean_ms,
            completed=run.completed, refused=run.refused, batches=batches,
            mean_batch=run.completed / batches if batches else None, memory_mb=memory,
            vs_reference=run.throughput / ref.throughput if ref.throughput else None,
            ref_throughput=ref.throughput, ref_p50_ms=ref.p50_ms, ref_p99_ms=ref.p99_ms, ref_age_s=age,
            over_budget=over, p99_budget_ms=task.args.p99_budget_ms, concurrency=task.args.concurrency,
            cores=sorted(cores),
        )
        status, fitness, error = Status.OK, (None if over else run.throughput), None
    except _Done:
        status, fitness, error = Status.OK, None, None
    except _Dueled:
        status, error = Status.OK, None
    except Failure as exc:
        status, fitness, error = exc.status, None, str(exc)
    finally:
        if engine is not None:
            engine.close()
    timings["total_s"] = time.perf_counter() - t_start
    return EvalResult(status=status, fitness=fitness, unit=task.unit, metrics=metrics, error=error,
                      timings=timings, hardware=ctx.hardware)

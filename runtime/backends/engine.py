"""The engine backend: a candidate is an engine configuration (:class:`runtime.engine.EngineConfig`), built
with its kernels, checked for similarity to the fp32 engine and measured under closed-loop load.

Stages and statuses are the C backend's: a genome outside the engine's options is ``invalid``, a kernel
that does not compile ``compile_error``, an engine under the similarity floor ``wrong``. The load runs
under the machine-wide timing lock, pinned to ``threads`` cores. The default engine
(:class:`EngineConfig` defaults: one worker, one BLAS thread, numpy operators, fp32) is measured under
the same load and cores, again whenever its figures are older than ``reference_every_s`` (0: right
before every candidate); ``vs_reference`` is the candidate's throughput over it. Those figures are this
backend's state in the worker, kept across the candidates it evaluates. Stage ``run`` is not offered.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError

from genome import Genome, canonical_json
from runtime.backends.base import (
    Backend,
    BackendUnavailable,
    Build,
    Column,
    Duels,
    Failure,
    Measurement,
    Program,
    WorkerContext,
)
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.load import LoadResult, closed_loop
from runtime.engine.task import EngineTask
from runtime.engine.workers import proportional_mb
from runtime.result import Status
from runtime.settings import EvalSettings
from runtime.timing import pinned
from runtime.toolchain.cc import CompileError, CompilerNotFound, compiler_version

__all__ = ["DUEL_ROUNDS", "EngineBackend", "EngineProgram", "measure"]

DUEL_ROUNDS = 2


def measure(engine: Engine, task: EngineTask, *, close: bool = True) -> tuple[LoadResult, float, int]:
    """Starts ``engine``, runs the task's load on it, then stops it (and, with ``close``, frees its kernels).

    Returns the load's figures, the memory (PSS, MB, of this process and the engine's worker processes)
    at its end, and the batches the engine ran.
    """
    a = task.args
    engine.start()
    try:
        result = closed_loop(engine.submit, task.texts(), concurrency=a.concurrency, duration_s=a.duration_s,
                             warmup_s=a.warmup_s)
        memory, batches = proportional_mb(engine.worker_pids), engine.batches
    finally:
        if close:
            engine.close()
        else:
            engine.stop()
    return result, memory, batches


@dataclass
class _Reference:
    """The default engine's figures under a task's load, and when (``time.monotonic()``) they were taken."""

    load: LoadResult | None = None
    at: float = 0.0


@dataclass
class EngineProgram(Program, Duels):
    """A built engine (its kernels loaded), not started."""

    task: EngineTask
    engine: Engine
    config: EngineConfig
    settings: EvalSettings
    ctx: WorkerContext
    reference: _Reference
    calls_s: float = 0.0
    _closed: bool = field(default=False, repr=False)

    def _similarity(self) -> tuple[dict[str, Any], float]:
        """The similarity metric and the seconds its check took; under the floor it is ``wrong``."""
        t0 = time.perf_counter()
        similarity = self.task.similarity(self.engine)
        spent = time.perf_counter() - t0
        self.calls_s += spent
        floor = self.task.args.similarity_floor
        if similarity < floor:
            raise Failure(Status.WRONG, f"min cosine to the fp32 engine {similarity:.5f} is under the floor "
                          f"{floor:g} (precision {self.config.precision})", metrics={"similarity": similarity},
                          timings={"check_s": spent})  # fmt: skip
        return {"similarity": similarity}, spent

    def check(self, trials: int) -> dict[str, Any]:
        return self._similarity()[0]

    def time(self) -> Measurement:
        task, settings, ref = self.task, self.settings, self.reference
        a = task.args
        t0 = time.perf_counter()
        with self.ctx.lock.held() as waited, pinned(settings.timing.core, task.cores) as cores:  # type: ignore[union-attr]
            age = time.monotonic() - ref.at
            if ref.load is None or age > a.reference_every_s:
                default = task.build(EngineConfig(), compiler=settings.compiler, cache_dir=self.ctx.cache_dir)
                ref.load, ref.at, age = measure(default, task)[0], time.monotonic(), 0.0
            run, memory, batches = measure(self.engine, task, close=False)  # confirm() may check it again
        spent = time.perf_counter() - t0 - waited
        self.calls_s += spent
        base = ref.load
        over = run.p99_ms > a.p99_budget_ms
        metrics = dict(
            throughput=run.throughput, p50_ms=run.p50_ms, p99_ms=run.p99_ms, mean_ms=run.mean_ms,
            completed=run.completed, refused=run.refused, batches=batches,
            mean_batch=run.completed / batches if batches else None, memory_mb=memory,
            vs_reference=run.throughput / base.throughput if base.throughput else None,
            ref_throughput=base.throughput, ref_p50_ms=base.p50_ms, ref_p99_ms=base.p99_ms, ref_age_s=age,
            over_budget=over, p99_budget_ms=a.p99_budget_ms, concurrency=a.concurrency, cores=sorted(cores),
        )  # fmt: skip
        return Measurement(None if over else run.throughput, metrics, {"lock_wait_s": waited, "time_s": spent})

    def confirm(self) -> None:
        """The similarity again, on the engine as it ran the load."""
        self._similarity()

    def duel(self, open_rival: Callable[[], Program]) -> Measurement:
        """The similarity check, then the rival's engine is built and the load runs on each engine in turn,
        ``DUEL_ROUNDS`` rounds each under the lock; ``duel_ratio`` is the median throughput over the rival's.
        The fitness is ``None`` when the median p99 is over the budget."""
        similarity, check_s = self._similarity()
        rival = open_rival()
        assert isinstance(rival, EngineProgram)
        task, a = self.task, self.task.args
        mine: list[LoadResult] = []
        theirs: list[LoadResult] = []
        t0 = time.perf_counter()
        with self.ctx.lock.held() as waited, pinned(self.settings.timing.core, task.cores):  # type: ignore[union-attr]
            for _ in range(DUEL_ROUNDS):
                for e, out in ((self.engine, mine), (rival.engine, theirs)):
                    e.start()
                    try:
                        out.append(closed_loop(e.submit, task.texts(), concurrency=a.concurrency,
                                               duration_s=a.duration_s, warmup_s=a.warmup_s))
                    finally:
                        e.stop()
        spent = time.perf_counter() - t0 - waited
        self.calls_s += spent
        throughput = float(np.median([r.throughput for r in mine]))
        rival_throughput = float(np.median([r.throughput for r in theirs]))
        p99 = float(np.median([r.p99_ms for r in mine]))
        metrics = {**similarity, "duel_ratio": throughput / rival_throughput if rival_throughput else float("inf"),
                   "throughput": throughput, "p99_ms": p99, "rival_throughput": rival_throughput,
                   "duel_rounds": DUEL_ROUNDS}  # fmt: skip
        fitness = None if p99 > a.p99_budget_ms else throughput
        return Measurement(fitness, metrics, {"check_s": check_s, "lock_wait_s": waited, "time_s": spent})

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine.close()


class EngineBackend(Backend[EngineTask]):
    """Engine configurations of the embedded MiniLM encoder, measured under load."""

    name = "engine"
    program = EngineProgram
    check_columns = (Column("similarity", "min cosine"),)

    def __init__(self) -> None:
        self._references: dict[str, _Reference] = {}  # task class and args -> the default engine's figures

    def reference_of(self, task: EngineTask) -> _Reference:
        """The default engine's figures for ``task``'s load in this worker (empty until first measured)."""
        key = f"{type(task).__module__}:{type(task).__qualname__} {canonical_json(task.args.model_dump(mode='json'))}"
        return self._references.setdefault(key, _Reference())

    def preflight(self, task: EngineTask, settings: EvalSettings, *, compile_only: bool = False) -> None:
        try:
            compiler_version(settings.compiler.cc)  # the slots' kernels are C
        except CompilerNotFound as exc:
            raise BackendUnavailable(str(exc)) from None

    def prepare_worker(self, task: EngineTask) -> None:
        """Loads the task's model, texts, reference embeddings and kernel sources, and makes one round trip
        through a process worker, so that forking and the child's loop have what they import."""
        import threadpoolctl  # noqa: F401

        from runtime.engine.workers import ProcessWorkers

        task.prime()
        workers = ProcessWorkers(_lengths, 1)
        try:
            workers([np.zeros(3, np.int32)])
        finally:
            workers.close()

    def compile(self, task: EngineTask, genome: Genome, settings: EvalSettings, ctx: WorkerContext) -> Build:
        """``genome``'s engine configuration, validated, and its kernels compiled into the cache (not loaded)."""
        try:
            config = task.engine_config(genome)
        except (ValueError, ValidationError, TypeError) as exc:
            raise Failure(Status.INVALID, f"not an engine configuration: {exc}") from None
        try:
            seconds = task.compile_kernels(config, compiler=settings.compiler, cache_dir=ctx.cache_dir,
                                           work_dir=ctx.work_dir)  # fmt: skip
        except CompileError as exc:
            raise Failure(Status.COMPILE_ERROR, exc.stderr) from None
        return Build(genome, config, seconds)

    def load(self, task: EngineTask, build: Build, settings: EvalSettings, ctx: WorkerContext) -> EngineProgram:
        """The engine: the model in the configuration's precision, its kernels loaded from the cache."""
        try:
            engine = task.build(build.artifact, compiler=settings.compiler, cache_dir=ctx.cache_dir,
                                work_dir=ctx.work_dir)  # fmt: skip
        except CompileError as exc:  # e.g. a library without the kernel function
            raise Failure(Status.COMPILE_ERROR, exc.stderr) from None
        return EngineProgram(task, engine, build.artifact, settings, ctx, self.reference_of(task))


def _lengths(seqs: list[np.ndarray]) -> np.ndarray:
    return np.array([len(s) for s in seqs], np.float32)

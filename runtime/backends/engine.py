"""The engine backend: a candidate is an engine configuration (:class:`runtime.engine.EngineConfig`), built
with its kernels in a host process of its own, checked for similarity to the fp32 engine and measured
under closed-loop load.

Stages and statuses are the C backend's: a genome outside the engine's options is ``invalid``, a kernel
that does not compile ``compile_error``, an engine under the similarity floor ``wrong``.

The boundary (see :mod:`runtime.sandbox.engine_host`): the candidate's kernels run only in its host, forked from
a template process that holds the model and nothing else of the worker. Tokenising, batching, the load
and its clock stay in the worker. Every load sends texts the engine has never seen (so remembering
answers gains nothing), and ``_VERIFIED`` of its answers, chosen after it, are checked against the fp32
engine computed here; under the floor is ``wrong``. While one engine is measured, every other engine
process of the worker is stopped (SIGSTOP): none can slow the reference or a rival. The reference (the
default engine: one worker, one BLAS thread, numpy operators, fp32) runs in a host too, under the same
load, cores and path, again whenever its figures are older than ``reference_every_s`` (0: right before
every candidate); ``vs_reference`` is the candidate's throughput over it. Those figures are this
backend's state in the worker. Stage ``run`` is not offered.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
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
    Profiles,
    Program,
    RivalFailure,
    WorkerContext,
)
from runtime.engine.engine import EngineConfig
from runtime.engine.load import LoadResult, closed_loop
from runtime.engine.profile import assemble, check_forward
from runtime.engine.task import EngineTask, cosines
from runtime.followed_runs import RunNotFound
from runtime.result import Status
from runtime.sandbox.host import HostDied
from runtime.sandbox.hosted_engine import (
    EngineBuildFailed,
    EngineTemplate,
    HostedEngine,
    beside,
    frozen,
    group_except,
    pin,
    statm_mb,
)
from runtime.settings import EvalSettings
from runtime.timing import TimingLock, pinned
from runtime.toolchain.cc import CompileError, CompilerNotFound, compiler_version

__all__ = ["EngineBackend", "EngineProgram", "Loaded", "measure"]

_VERIFIED = 32  # answers of each load checked against the fp32 engine, chosen once it is over


@dataclass
class Loaded:
    """One load on one engine: its figures, its processes' memory (MB) at the end, the batches it ran, and
    every answered request (text, future)."""

    result: LoadResult
    memory_mb: float
    batches: int
    answers: list[tuple[str, Future[Any]]]


def measure(engine: HostedEngine, task: EngineTask, cores: set[int] | None = None, salt: int | None = None) -> Loaded:
    """Starts ``engine`` (its processes on ``cores``), runs the task's load on new texts (drawn from ``salt``,
    default a fresh one), then stops it."""
    a = task.args
    if cores is not None:
        pin(engine.process.tree(), cores)
    answers: list[tuple[str, Future[Any]]] = []

    def submit(text: str) -> Future[Any]:
        fut = engine.submit(text)
        answers.append((text, fut))
        return fut

    engine.start()
    try:
        texts = task.fresh_texts(secrets.randbits(63) if salt is None else salt)
        result = closed_loop(submit, texts, concurrency=a.concurrency, duration_s=a.duration_s,
                             warmup_s=a.warmup_s)  # fmt: skip
        memory = statm_mb(engine.process.tree(), task.model().nbytes())
        batches = engine.batches
    finally:
        engine.stop()
    return Loaded(result, memory, batches, answers)


@contextlib.contextmanager
def _host_failures() -> Iterator[None]:
    """The host's death, or a batch it failed, end the candidate: ``crash`` (``timeout`` on its CPU limit)."""
    try:
        yield
    except HostDied as exc:
        if exc.signal_name == "SIGXCPU":
            raise Failure(Status.TIMEOUT, f"{exc}: its CPU time limit") from None
        raise Failure(Status.CRASH, str(exc)) from None
    except RuntimeError as exc:
        if str(exc).startswith("the engine failed"):
            raise Failure(Status.CRASH, str(exc)[-4000:]) from None
        raise


@dataclass
class _Reference:
    """The default engine's figures under a task's load, and when (``time.monotonic()``) they were taken."""

    load: LoadResult | None = None
    at: float = 0.0


@dataclass
class EngineProgram(Program, Duels, Profiles):
    """A built engine, in its host (its kernels loaded), not started."""

    task: EngineTask
    engine: HostedEngine
    config: EngineConfig
    settings: EvalSettings
    ctx: WorkerContext
    reference: _Reference
    backend: EngineBackend
    calls_s: float = 0.0
    _closed: bool = field(default=False, repr=False)

    def _similarity(self) -> tuple[dict[str, Any], float]:
        """The similarity metric and the seconds its check took; under the floor it is ``wrong``."""
        t0 = time.perf_counter()
        with _host_failures():
            similarity = self.task.similarity(self.engine)
        spent = time.perf_counter() - t0
        self.calls_s += spent
        floor = self.task.args.similarity_floor
        if not similarity >= floor:
            raise Failure(Status.WRONG, f"min cosine to the fp32 engine {similarity:.5f} is under the floor "
                          f"{floor:g} (precision {self.config.precision})", metrics={"similarity": similarity},
                          timings={"check_s": spent})  # fmt: skip
        return {"similarity": similarity}, spent

    def _verify(self, loads: list[Loaded]) -> float:
        """The min cosine of ``_VERIFIED`` answers of ``loads`` (chosen now) to the fp32 engine's; under the
        floor is ``wrong``. Returns the seconds it took."""
        t0 = time.perf_counter()
        done = [(text, fut.result()) for load in loads for text, fut in load.answers
                if fut.done() and fut.exception() is None]  # fmt: skip
        if not done:
            return 0.0
        rng = np.random.default_rng(secrets.randbits(63))
        picked = [done[i] for i in rng.choice(len(done), size=min(_VERIFIED, len(done)), replace=False)]
        expected = self.task.reference_embed([t for t, _ in picked])
        got = np.stack([np.asarray(e, np.float32).reshape(-1) for _, e in picked])
        cosine = float(np.min(cosines(got, expected))) if got.shape == expected.shape else float("nan")
        floor = self.task.args.similarity_floor
        if not cosine >= floor:
            raise Failure(Status.WRONG, f"under load, min cosine to the fp32 engine {cosine:.5f} on {len(picked)} "
                          f"new texts is under the floor {floor:g}", metrics={"load_similarity": cosine})  # fmt: skip
        return time.perf_counter() - t0

    def _load(self, engine: HostedEngine, cores: set[int], salt: int | None = None) -> Loaded:
        """``engine``'s load, every other engine process of this worker stopped meanwhile."""
        with _host_failures(), frozen(lambda: self.backend.others(engine)):
            return measure(engine, self.task, cores, salt)

    def check(self, trials: int) -> dict[str, Any]:
        metrics = self._similarity()[0]
        fallbacks = self.task.fallbacks(self.config)
        if fallbacks:  # kernels that cannot serve this model's shapes: those operators run in numpy
            metrics["slot_fallbacks"] = fallbacks
        return metrics

    def time(self) -> Measurement:
        task, settings, ref = self.task, self.settings, self.reference
        a = task.args
        t0 = time.perf_counter()
        with self.ctx.lock.held() as waited, pinned(settings.timing.core, task.cores) as cores:  # type: ignore[union-attr]
            age = time.monotonic() - ref.at
            if ref.load is None or age > a.reference_every_s:
                default = self.backend.spawn(task, EngineConfig(), settings, self.ctx)
                try:
                    ref.load, ref.at, age = self._load(default, cores).result, time.monotonic(), 0.0
                finally:
                    self.backend.release(default)
            run = self._load(self.engine, cores)
        spent = time.perf_counter() - t0 - waited
        verify_s = self._verify([run])
        self.calls_s += spent
        base, r = ref.load, run.result
        over = r.p99_ms > a.p99_budget_ms
        metrics = dict(
            throughput=r.throughput, p50_ms=r.p50_ms, p99_ms=r.p99_ms, mean_ms=r.mean_ms,
            completed=r.completed, refused=r.refused, batches=run.batches,
            mean_batch=r.completed / run.batches if run.batches else None, memory_mb=run.memory_mb,
            vs_reference=r.throughput / base.throughput if base.throughput else None,
            ref_throughput=base.throughput, ref_p50_ms=base.p50_ms, ref_p99_ms=base.p99_ms, ref_age_s=age,
            over_budget=over, p99_budget_ms=a.p99_budget_ms, concurrency=a.concurrency, cores=sorted(cores),
        )  # fmt: skip
        return Measurement(None if over else r.throughput, metrics,
                           {"lock_wait_s": waited, "time_s": spent, "verify_s": verify_s})  # fmt: skip

    def confirm(self) -> None:
        """The similarity again, on the engine as it ran the load."""
        self._similarity()

    def duel(self, open_rival: Callable[[], Program]) -> Measurement:
        """The similarity check of both engines, then the load on each in turn, ``duel_rounds`` rounds each under
        the lock (the other one stopped; both on the same new texts each round), then both engines' answers
        checked against the fp32 engine. ``duel_ratio`` is the median throughput over the rival's. The fitness
        is ``None`` when the median p99 is over the budget. A rival under the floor, or dying, is
        :class:`RivalFailure`: both are held to the reference, never one to the other."""
        similarity, check_s = self._similarity()
        failed: RivalFailure | None = None  # the challenger's figures are measured still: the verdict needs them
        rival_similarity: dict[str, Any] = {}
        try:  # a rival that cannot be built (a kernel no run offers now) loses; the challenger is measured alone
            rival = open_rival()
            assert isinstance(rival, EngineProgram)
            with RivalFailure.blame():
                rival_similarity, rival_check_s = rival._similarity()
                check_s += rival_check_s
        except RivalFailure as exc:
            failed = exc
        mine: list[Loaded] = []
        theirs: list[Loaded] = []
        t0 = time.perf_counter()
        with self.ctx.lock.held() as waited, pinned(self.settings.timing.core, self.task.cores) as cores:  # type: ignore[union-attr]
            for _ in range(self.task.args.duel_rounds):
                salt = secrets.randbits(63)
                mine.append(self._load(self.engine, cores, salt))
                if failed is None:
                    try:
                        with RivalFailure.blame():
                            theirs.append(self._load(rival.engine, cores, salt))
                    except RivalFailure as exc:
                        failed = exc
        spent = time.perf_counter() - t0 - waited
        verify_s = self._verify(mine)
        if failed is None:
            try:
                with RivalFailure.blame():
                    verify_s += rival._verify(theirs)
            except RivalFailure as exc:
                failed = exc
        self.calls_s += spent
        throughput = float(np.median([x.result.throughput for x in mine]))
        p99 = float(np.median([x.result.p99_ms for x in mine]))
        metrics: dict[str, Any] = {**similarity, "throughput": throughput, "p99_ms": p99, "duel_rounds": len(mine),
                                   "rounds": [_round(x) for x in mine]}  # fmt: skip
        timings = {"check_s": check_s, "lock_wait_s": waited, "time_s": spent, "verify_s": verify_s}
        if failed is not None:
            raise RivalFailure(failed.status, str(failed), metrics=metrics, timings=timings)
        rival_throughput = float(np.median([x.result.throughput for x in theirs]))
        metrics.update(duel_ratio=throughput / rival_throughput if rival_throughput else float("inf"),
                       rival_throughput=rival_throughput, rival_similarity=rival_similarity["similarity"],
                       rival_p99_ms=float(np.median([x.result.p99_ms for x in theirs])),
                       rival_rounds=[_round(x) for x in theirs])  # fmt: skip
        fitness = None if p99 > self.task.args.p99_budget_ms else throughput
        return Measurement(fitness, metrics, timings)

    def profile(self) -> Measurement:
        """Where the engine's time goes on the task's fixed texts (:mod:`runtime.engine.profile`): tokenised here,
        run in its host with every operator timed there, the wall time measured here around it, pinned to the
        task's cores under the lock. A profile that cannot be true (parts beyond that wall time, GEMMs the model
        does not have, another batch count: :func:`runtime.engine.profile.check_forward`) is ``invalid``; how
        the engine splits its time between operators stays its own account, and steers only where the
        factory's next searches spend (never a promotion)."""
        texts = self.task.texts()
        t0 = time.perf_counter()
        seqs = self.engine.model.tokenizer.encode_batch(list(texts))
        tokenize_s = time.perf_counter() - t0
        with self.ctx.lock.held() as waited, pinned(self.settings.timing.core, self.task.cores) as cores:  # type: ignore[union-attr]
            pin(self.engine.process.tree(), cores)
            with _host_failures(), frozen(lambda: self.backend.others(self.engine)):
                t1 = time.perf_counter()
                forward = self.engine.process.profile(seqs)
                wall_s = time.perf_counter() - t1
        self.calls_s += wall_s
        cfg = self.engine.model.config
        h, i = cfg.hidden, cfg.intermediate
        why = check_forward(forward, wall_s, batches=-(-len(seqs) // self.config.max_batch),
                            shapes={(h, 3 * h), (h, h), (h, i), (i, h)})  # fmt: skip
        if why is not None:
            raise Failure(Status.INVALID, f"the engine's process misreported its profile: {why}")
        found = assemble(seqs, tokenize_s, forward, wall_s)
        return Measurement(None, {"profile": found.to_dict()}, {"lock_wait_s": waited, "time_s": wall_s})

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.backend.release(self.engine)


class EngineBackend(Backend[EngineTask]):
    """Engine configurations of a BERT sentence encoder (the bundled MiniLM by default), measured under load."""

    name = "engine"
    whole_node = True
    program = EngineProgram
    check_columns = (Column("similarity", "min cosine"),)

    def __init__(self) -> None:
        self._references: dict[str, _Reference] = {}  # task class and args -> the default engine's figures
        self._templates: dict[str, EngineTemplate] = {}  # model directory -> its template
        self._live: set[HostedEngine] = set()

    def reference_of(self, task: EngineTask) -> _Reference:
        """The default engine's figures for ``task``'s load in this worker (empty until first measured)."""
        key = f"{type(task).__module__}:{type(task).__qualname__} {canonical_json(task.args.model_dump(mode='json'))}"
        return self._references.setdefault(key, _Reference())

    # --- host processes ---------------------------------------------------------------------------

    def template(self, task: EngineTask, ctx: WorkerContext) -> EngineTemplate:
        """The template process engines of ``task``'s model are forked from (forked from here on first use)."""
        key = str(task.model().path)
        found = self._templates.get(key)
        if found is None or not found.alive:
            keep = []
            if ctx.cache_dir.startswith("/proc/self/fd/"):
                keep.append(int(ctx.cache_dir.removeprefix("/proc/self/fd/").split("/")[0]))
            found = self._templates[key] = EngineTemplate(task.model(), keep)
        return found

    def spawn(self, task: EngineTask, config: EngineConfig, settings: EvalSettings, ctx: WorkerContext,
              built: dict[str, str] | None = None) -> HostedEngine:  # fmt: skip
        """A host with ``config``'s engine built, its kernels loaded (compiled into the cache already: each must be
        the library ``built`` names)."""
        template = self.template(task, ctx)
        engine = template.spawn(config, task.kernel_sources(config, built), compiler=settings.compiler,
                                cache_dir=ctx.cache_dir, cpu_seconds=settings.sandbox.cpu_seconds)  # fmt: skip
        self._live.add(engine)
        return engine

    def release(self, engine: HostedEngine) -> None:
        """Closes ``engine``'s host, and kills what any engine left behind when none is running."""
        self._live.discard(engine)
        engine.close()
        if not self._live and os.getpgrp() == os.getpid():  # a worker leads its group
            for pid in group_except(pids=[t.pid for t in self._templates.values()]):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)

    def others(self, engine: HostedEngine) -> list[int]:
        """The processes to stop while ``engine`` is measured: every other engine's, and, in a worker (which
        leads its process group, which no engine may leave), every process an engine orphaned."""
        live, templates = [e.process.pid for e in self._live], [t.pid for t in self._templates.values()]
        return beside(engine.process.pid, live, templates)

    # --- the backend -------------------------------------------------------------------------------

    def preflight(self, task: EngineTask, settings: EvalSettings, *, compile_only: bool = False) -> None:
        try:
            compiler_version(settings.compiler.cc)  # the slots' kernels are C
        except CompilerNotFound as exc:
            raise BackendUnavailable(str(exc)) from None

    def prepare_worker(self, task: EngineTask, lock: TimingLock) -> None:
        """Loads the task's model, texts and kernel sources, and makes one round trip through a process
        worker, so that the hosts' forked workers and their loop have what they import."""
        from runtime.sandbox.engine_host import prime_engine_process

        task.prime()
        prime_engine_process()

    def sandboxed(self, task: EngineTask, ctx: WorkerContext) -> None:
        """Forks the engines' template now, before any evaluation puts reference embeddings in memory."""
        self.template(task, ctx)

    def compile(self, task: EngineTask, genome: Genome, settings: EvalSettings, ctx: WorkerContext) -> Build:
        """``genome``'s engine configuration, validated, and its kernels compiled into the cache (not loaded)."""
        try:
            config = task.engine_config(genome)
        except (ValueError, ValidationError, TypeError) as exc:
            raise Failure(Status.INVALID, f"not an engine configuration: {exc}") from None
        try:
            built = task.compile_kernels(config, compiler=settings.compiler, cache_dir=ctx.cache_dir,
                                         work_dir=ctx.work_dir)  # fmt: skip
        except CompileError as exc:
            raise Failure(Status.COMPILE_ERROR, exc.stderr) from None
        except RunNotFound as exc:  # a kernel no run offers the task (a duel's rival of an older round, say)
            raise Failure(Status.INVALID, str(exc)) from None
        return Build(genome, config, sum(b.seconds for b in built.values()),
                     {"kernel_sha256": {slot: b.sha256 for slot, b in built.items()}} if built else {})

    def load(self, task: EngineTask, build: Build, settings: EvalSettings, ctx: WorkerContext) -> EngineProgram:
        """The engine in a host of its own: the model in the configuration's precision, its kernels loaded."""
        try:
            with _host_failures():
                engine = self.spawn(task, build.artifact, settings, ctx, build.metrics.get("kernel_sha256"))
        except EngineBuildFailed as exc:  # e.g. a library without the kernel function
            raise Failure(Status.COMPILE_ERROR, str(exc)) from None
        return EngineProgram(task, engine, build.artifact, settings, ctx, self.reference_of(task), self)


def _round(loaded: Loaded) -> dict[str, float]:
    return {"throughput": loaded.result.throughput, "p99_ms": loaded.result.p99_ms}



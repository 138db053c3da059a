"""The C backend: a candidate is C source, compiled by the system compiler, loaded in a host process of its
own (:mod:`runtime.sandbox.host`), called there on guarded shared buffers, and timed from this process against
the task's numpy reference on a pinned core.

This is the example to copy for a new backend: a :class:`Backend` with ``compile`` and ``load``, and a
:class:`Program` whose methods are the cascade's stages (see :mod:`runtime.backends.base`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from genome import Genome
from runtime.backends.base import (
    Backend,
    BackendUnavailable,
    Build,
    Duels,
    Failure,
    Measurement,
    Outputs,
    Program,
    RivalFailure,
    RunsGivenInputs,
    WorkerContext,
)
from runtime.backends.kernels import CallClock, Instance, check_plan, compare, fresh_rng, timing_metrics
from runtime.backends.ring import Ring
from runtime.result import Status
from runtime.sandbox.host import CandidateHost, HostDied
from runtime.settings import EvalSettings
from runtime.task import Case, KernelTask
from runtime.timing import TimingLock, pinned, time_interleaved
from runtime.toolchain.cc import CompileError, CompilerNotFound, compile_source, compiler_version

__all__ = ["CBackend", "CProgram", "compile_kernel", "prime_kernel_task"]


def compile_kernel(task: KernelTask, genome: Genome, settings: EvalSettings, ctx: WorkerContext) -> Build:
    """Renders ``genome`` and compiles it into the cache; the build's artifact is the shared library's path."""
    try:
        source = task.render(genome)
    except Exception as exc:  # noqa: BLE001 - a bad genome, not a worker bug
        raise Failure(Status.INVALID, f"cannot render the genome: {exc}") from None
    try:
        built = compile_source(source, compiler=settings.compiler, extra_flags=task.compile_flags(),
                               cache_dir=ctx.cache_dir, work_dir=ctx.work_dir)  # fmt: skip
    except CompileError as exc:
        raise Failure(Status.COMPILE_ERROR, exc.stderr) from None
    return Build(genome, built.path, built.seconds, {"compile_cached": built.cached, "library_sha256": built.sha256})


def prime_kernel_task(task: KernelTask) -> None:
    """Runs a kernel task's Python paths once (render, inputs, reference, arguments), so every module and
    file they read is loaded before the worker drops privileges."""
    rng = np.random.default_rng(0)
    for genome in task.seeds():
        task.render(genome)
    case = task.check_cases(rng)[0]
    inputs = task.inputs(case, rng)
    outputs = {name: np.empty(shape, dtype) for name, (shape, dtype) in task.outputs(case).items()}
    task.reference(case, inputs, outputs)
    task.kernel_args(case, {**inputs, **outputs})
    task.tolerance(case)
    task.work(case)


_SAMPLE_S = 5e-5  # a timed request lasts about this long at least (several calls, each on its own inputs)
_MAX_RING = 16
_RING_BYTES = 64 << 20
_IDLE_SLACK_NS = 1_000_000  # CPU a host may use outside its calls over a timing (its wake-ups), plus 1%
_OUTSIDE_SLACK_NS = 20_000_000  # over its whole life, plus 1% and _REQUEST_SLACK_NS a request
# What an honest host's wake-ups cost outside its calls, each bind, buffer and call request (its socket, and the
# process clock's lag on a shared core): an honest naive matmul measured 13-24 ms over 119 requests.
_REQUEST_SLACK_NS = 100_000


def _pin_near(pid: int, threads: int) -> None:
    """Pins every thread of ``pid`` to the core this process runs on now (``threads`` cores from it)."""
    cpu = ctypes.CDLL(None).sched_getcpu()
    allowed = sorted(os.sched_getaffinity(0))
    if cpu < 0 or cpu not in allowed:
        return
    cores = set((allowed[allowed.index(cpu):] + allowed)[: max(1, threads)])
    with contextlib.suppress(OSError):  # the host may be gone already: its next request says how
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), cores)


@contextlib.contextmanager
def _in_host(settings: EvalSettings) -> Iterator[None]:
    """The kernel's process died: a crash (with its signal), or a timeout when the CPU limit killed it."""
    try:
        yield
    except HostDied as exc:
        if exc.signal_name == "SIGXCPU":
            raise Failure(Status.TIMEOUT, f"CPU time limit of {settings.sandbox.cpu_seconds} s hit") from None
        raise Failure(Status.CRASH, str(exc)) from None


@dataclass
class _Calls:
    """The timed requests of one host over a ring: one call per instance each."""

    program: CProgram
    handles: list[int]
    cpu_ns: int = 0  # CPU the host used inside the requests
    wall_s: float = 0.0

    def __call__(self) -> float:
        """Seconds per call over one request (this process's clock, less the round trip)."""
        t0 = time.perf_counter()
        try:
            seconds, cpu = self.program.host.call_many(self.handles)
        finally:
            spent = time.perf_counter() - t0
            self.program.clock.calls += spent
            self.wall_s += spent
        self.cpu_ns += cpu
        return seconds / len(self.handles)

    def idle_between(self, cpu_before: int, what: str) -> None:
        """The host used no CPU outside its requests since ``cpu_before``: a candidate that computes ahead
        while inputs are written, or slows the reference or a rival meanwhile, is ``invalid``."""
        outside = self.program.host.cpu_ns() - cpu_before - self.cpu_ns
        if outside > _IDLE_SLACK_NS + 0.01 * self.cpu_ns:
            raise Failure(Status.INVALID, f"used {outside / 1e6:.1f} ms of CPU outside its calls while {what} was "
                          f"timed ({self.cpu_ns / 1e6:.1f} ms in them)")  # fmt: skip


class CProgram(Program, RunsGivenInputs, Duels):
    """A C kernel loaded in its own :class:`runtime.sandbox.host.CandidateHost`, and the task it is checked against.

    Inputs and outputs sit in shared memory; the inputs' copies the reference reads, the expected
    outputs and the clock stay in this process, out of the host's reach. Every timed round writes fresh
    inputs first, and every call's output is checked against the reference's on elements chosen after it.
    """

    def __init__(self, task: KernelTask, host: CandidateHost, settings: EvalSettings, ctx: WorkerContext) -> None:
        self.task, self.host, self.settings, self.ctx = task, host, settings, ctx
        self.clock = CallClock()
        self._full: Instance | None = None  # the full case of the last check: what is timed
        self._call_s = 1e-3  # seconds of one call on the full case, from _probe: sizes the ring
        # The host runs only while this process waits on it: on this process's core, a request costs a few
        # microseconds instead of a cross-core wake-up (tens). This process stays free to move (another
        # worker may need the core); the timing stage pins both to its own core.
        _pin_near(host.pid, task.args.threads)

    @property
    def calls_s(self) -> float:  # type: ignore[override]
        return self.clock.calls

    # --- instances in shared memory ---------------------------------------------------------------

    def _prepared(self, case: Case, given: Mapping[str, np.ndarray] | None = None, kind: str = "typical",
                  ) -> Instance:  # fmt: skip
        """Fresh inputs for ``case`` of the value distribution ``kind`` (or ``given``) in guarded shared
        buffers, with the reference's outputs."""
        inst = Instance.fresh(self.task, case, given, kind)
        inst.guard(self.task, self.host.alloc)
        inst.expect(self.task, self.clock)
        return inst

    def _bind(self, case: Case, arrays: Mapping[str, np.ndarray]) -> int:
        try:
            return self.host.bind(self.task.kernel_args(case, arrays))
        except TypeError as exc:
            raise Failure(Status.INVALID, f"the task's kernel arguments cannot be passed: {exc}") from None

    def _call(self, inst: Instance) -> None:
        handle = self._bind(inst.case, inst.arrays)
        inst.poison()
        t0 = time.perf_counter()
        try:
            self.host.call_many((handle,))
        finally:
            self.clock.calls += time.perf_counter() - t0
        inst.verify_integrity()

    def _check_case(self, case: Case, *, keep: bool = False, kind: str = "typical") -> Instance:
        mark = self.host.mark()
        inst = self._prepared(case, kind=kind)
        self._call(inst)
        compare(self.task, inst)
        if not keep:
            self.host.release(mark)
        return inst

    def _clean(self) -> None:
        """Nothing of the candidate may run between its calls: no thread beyond the task's, no process, and no
        CPU spent outside them since it loaded (beyond its wake-ups to bind calls and map buffers): what a
        host runs on its own, it runs while other workers may be timing."""
        allowed = max(1, self.task.args.threads)
        if (n := self.host.threads()) > allowed:
            raise Failure(Status.INVALID, f"left {n - 1} thread(s) running beside its own (threads: {allowed})")
        if kids := self.host.children():
            raise Failure(Status.INVALID, f"left {len(kids)} process(es) running")
        outside = self.host.outside_calls_ns()
        if outside > _OUTSIDE_SLACK_NS + _REQUEST_SLACK_NS * self.host.requests + 0.01 * self.host.in_calls_ns:
            raise Failure(Status.INVALID, f"used {outside / 1e6:.1f} ms of CPU outside its calls "
                          f"({self.host.in_calls_ns / 1e6:.1f} ms in them, {self.host.requests} requests)")  # fmt: skip

    def _ring(self, like: Instance, size: int) -> tuple[Ring, _Calls]:
        """``size`` instances of ``like``'s case in this host's memory, and the requests calling each once."""
        ring = Ring(self.task, like, size, self.host.alloc)
        return ring, _Calls(self, [self._bind(ring.case, ring.arrays(j)) for j in range(size)])

    def _probe(self, inst: Instance) -> None:
        """Seconds of one call on ``inst``, over a short request (for the ring's size only, never a fitness)."""
        handle = self._bind(inst.case, inst.arrays)
        seconds, _ = self.host.call_many((handle,) * 4)
        self._call_s = seconds / 4
        inst.verify_integrity()

    def _ring_size(self, inst: Instance) -> int:
        """Calls per timed request: enough that one lasts ~50 us, so the round trip to the host (a few
        microseconds, calibrated and subtracted) hardly matters; at most 16, and 64 MB of buffers."""
        nbytes = sum(raw.nbytes for raw in inst.raws.values())
        by_time = int(_SAMPLE_S / max(self._call_s, 1e-9))
        return max(1, min(_MAX_RING, by_time, _RING_BYTES // max(nbytes, 1)))

    # --- stages -----------------------------------------------------------------------------------

    def check(self, trials: int) -> dict[str, Any]:
        with _in_host(self.settings):
            for case, kind in check_plan(self.task, trials):
                self._check_case(case, kind=kind)
            self._full = self._check_case(self.task.full_case(), keep=True)
            self._clean()
        return {}

    def time(self) -> Measurement:
        with _in_host(self.settings):
            return self._time()

    def _time(self) -> Measurement:
        task, timing, host = self.task, self.settings.timing, self.host
        assert self._full is not None, "time() follows check()"
        t0 = time.perf_counter()
        seed, rng = fresh_rng()
        ring: Ring
        candidate: _Calls

        def reference() -> None:  # on the worker's own copies of the inputs
            ring.compute_expected()

        def timer(fn: Callable[[], object]) -> float:
            if fn is candidate:
                ring.load()
                return candidate()
            t = time.perf_counter()
            reference()
            spent = time.perf_counter() - t
            self.clock.calls += spent
            return spent / ring.size

        timings: dict[str, float] = {}
        with Failure.timed(timings):
            with self.ctx.lock.held() as waited, pinned(timing.core, task.args.threads, also=[host.pid]) as cores:  # type: ignore[union-attr]
                timings["lock_wait_s"] = waited
                host.round_trip_s = self.ctx.hosts().round_trip(cores)
                self._probe(self._full)
                ring, candidate = self._ring(self._full, self._ring_size(self._full))
                ring.draw(rng)
                ring.load()
                cpu0 = host.cpu_ns()
                try:
                    run = time_interleaved(candidate, reference, timing, timer=timer,
                                           round_start=lambda: ring.draw(rng),
                                           round_end=lambda: ring.verify(rng))  # fmt: skip
                finally:
                    timings["time_s"] = time.perf_counter() - t0 - waited
                candidate.idle_between(cpu0, "the reference")
        with Failure.timed(timings):
            compare(task, ring.instance(0, seed))  # the last timed call's output, in full
            self._clean()
        fitness, metrics = timing_metrics(run, task.work(ring.case))
        metrics.update(cores=sorted(cores), calls_per_request=ring.size, round_trip_s=host.round_trip_s,
                       cpu_per_wall=candidate.cpu_ns * 1e-9 / max(candidate.wall_s, 1e-12))  # fmt: skip
        return Measurement(fitness, metrics, timings)

    def confirm(self) -> None:
        with _in_host(self.settings):
            self._check_case(self.task.full_case())

    def run(self, case: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> tuple[Outputs, str | None]:
        with _in_host(self.settings):
            inst = self._prepared(dict(case), given=inputs)
            self._call(inst)
            try:
                compare(self.task, inst)
                mismatch = None
            except Failure as exc:
                mismatch = str(exc)
            outputs = {name: inst.arrays[name].copy() for name in inst.outputs}
        return outputs, mismatch

    def duel(self, open_rival: Callable[[], Program]) -> Measurement:
        rival = open_rival()
        assert isinstance(rival, CProgram)
        with _in_host(self.settings):
            return self._duel(rival)

    def _duel(self, rival: CProgram) -> Measurement:
        task, timing = self.task, self.settings.timing
        full_case = task.full_case()
        mine = self._check_case(full_case, keep=True)
        with self._as_rival():  # the rival is checked as the challenger is: it may behave only when checked
            rival._check_case(full_case)
        seed, rng = fresh_rng()
        ring: Ring
        rival_ring: Ring
        call: _Calls
        rival_call: _Calls

        def round_start() -> None:  # fresh inputs every round, the same for both
            ring.draw(rng)
            rival_ring.draw(rng, like=ring)

        def round_end() -> None:  # both against the reference on this round's inputs, never one against the other
            ring.compute_expected()
            with self._as_rival():
                rival_ring.verify(rng, ring.expected)
            ring.verify(rng)

        def timer(fn: Callable[[], object]) -> float:
            if fn is call:
                ring.load()
                return call()
            rival_ring.load()
            with self._as_rival():
                return rival_call()

        t0 = time.perf_counter()
        hosts = [self.host.pid, rival.host.pid]
        timings: dict[str, float] = {}
        with Failure.timed(timings):
            with self.ctx.lock.held() as waited, pinned(timing.core, task.args.threads, also=hosts) as cores:  # type: ignore[union-attr]
                timings["lock_wait_s"] = waited
                self.host.round_trip_s = rival.host.round_trip_s = self.ctx.hosts().round_trip(cores)
                self._probe(mine)
                size = self._ring_size(mine)
                (ring, call), (rival_ring, rival_call) = self._ring(mine, size), rival._ring(mine, size)
                round_start()
                ring.load()
                rival_ring.load()
                cpu0, rival_cpu0 = self.host.cpu_ns(), rival.host.cpu_ns()
                try:
                    run = time_interleaved(call, rival_call, timing, timer=timer, round_start=round_start,
                                           round_end=round_end)  # fmt: skip
                finally:
                    timings["time_s"] = time.perf_counter() - t0 - waited
                call.idle_between(cpu0, "its rival")
                with self._as_rival():
                    rival_call.idle_between(rival_cpu0, "the challenger")
        with Failure.timed(timings):
            ring.compute_expected()  # the last round's inputs, against the reference, in full
            compare(task, ring.instance(0, seed))
            self._clean()
        median = max(run.candidate.median, 1e-12)
        metrics = {"duel_ratio": run.reference.median / median, "time_median_s": median,
                   "rival_time_median_s": run.reference.median, "n_repeats": run.candidate.n}  # fmt: skip
        return Measurement(task.work(full_case) / median, metrics, timings)

    @contextlib.contextmanager
    def _as_rival(self) -> Iterator[None]:
        """What fails inside is the rival's doing (its host dying too)."""
        with RivalFailure.blame(), _in_host(self.settings):
            yield

    def close(self) -> None:
        self.host.close()


class CBackend(Backend[KernelTask]):
    """C kernels through the system compiler (``evaluation.compiler``)."""

    name = "c"
    program = CProgram

    def preflight(self, task: KernelTask, settings: EvalSettings, *, compile_only: bool = False) -> None:
        try:
            compiler_version(settings.compiler.cc)
        except CompilerNotFound as exc:
            raise BackendUnavailable(str(exc)) from None

    def prepare_worker(self, task: KernelTask, lock: TimingLock) -> None:
        prime_kernel_task(task)

    def compile(self, task: KernelTask, genome: Genome, settings: EvalSettings, ctx: WorkerContext) -> Build:
        return compile_kernel(task, genome, settings, ctx)

    def load(self, task: KernelTask, build: Build, settings: EvalSettings, ctx: WorkerContext) -> CProgram:
        """Forks the candidate's own host process and loads the library there (never in this process)."""
        try:
            host = ctx.hosts().host(build.artifact, task.kernel_name, threads=task.args.threads,
                                    cpu_seconds=settings.sandbox.cpu_seconds,
                                    sha256=build.metrics["library_sha256"])  # fmt: skip
        except CompileError as exc:  # e.g. the library defines no such function
            raise Failure(Status.COMPILE_ERROR, exc.stderr) from None
        except HostDied as exc:  # a library constructor that crashes
            raise Failure(Status.CRASH, f"{exc} while its library was loaded") from None
        return CProgram(task, host, settings, ctx)

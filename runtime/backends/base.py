"""The backend protocol: what a kind of candidate (C kernel, CUDA kernel, engine) must provide to be evaluated.

The cascade (:func:`runtime.cascade.evaluate`) runs the same stages for every backend and builds every
result itself; a backend supplies the work of each stage and nothing else:

1. **compile** (:meth:`Backend.compile`): render the genome and build it (cached). Nothing of the
   candidate runs yet, so ``evo check --compile-only`` calls this in the controller.
2. **load** (:meth:`Backend.load`): bring the build into this process as a :class:`Program`. This is
   where candidate code enters a process; from here on it is called only through the program.
3. **check** (:meth:`Program.check`): correctness on fresh inputs (kernels: small and odd cases, then
   the full one; the engine: similarity to the fp32 engine).
4. **time** (:meth:`Program.time`): measured side by side with the task's reference under the timing
   lock; gives the fitness and ``vs_reference``.
5. **confirm** (:meth:`Program.confirm`): checked again on fresh inputs when the speed-up is implausible.

Three further request stages are optional, declared by the program's type: ``run`` (one call on the
caller's inputs, :class:`RunsGivenInputs`), ``duel`` (timed side by side with a rival, :class:`Duels`)
and ``profile`` (where its time goes, :class:`Profiles`). A stage a backend does not offer is refused
with :class:`UnsupportedStage`.

Every stage ends the candidate by raising :class:`Failure` with a :class:`runtime.result.Status`.
On the controller side a backend says whether this machine can evaluate it (:meth:`Backend.preflight`),
which GPU a worker slot gets, and which metrics ``evo check`` shows as columns.

:mod:`runtime.backends.c` is the example to copy.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar, get_args

from genome import Genome
from runtime.result import Status
from runtime.settings import EvalSettings
from runtime.timing import TimingLock

if TYPE_CHECKING:
    import numpy as np

    from runtime.sandbox.c_host import HostLauncher
    from runtime.task import Task

__all__ = [
    "STAGES",
    "Backend",
    "BackendUnavailable",
    "Build",
    "Column",
    "Duels",
    "Failure",
    "Measurement",
    "Outputs",
    "Profiles",
    "Program",
    "RivalFailure",
    "RunsGivenInputs",
    "Stage",
    "UnsupportedStage",
    "WorkerContext",
]

Stage = Literal["compile", "check", "full", "run", "duel", "profile"]
"""How far an evaluation goes (see :class:`runtime.executors.base.EvalRequest`)."""
STAGES: tuple[Stage, ...] = get_args(Stage)
_CORE_STAGES: frozenset[Stage] = frozenset({"compile", "check", "full"})

T = TypeVar("T", bound="Task")  # a name only: the task module reads the backends' registry
Outputs = dict[str, "np.ndarray"]


@dataclass
class WorkerContext:
    """What a worker holds across evaluations; ``lock`` is ``None`` where nothing is timed (a compile-only
    check in the controller)."""

    cache_dir: str  # the compile cache (a /proc/self/fd path once the worker dropped privileges)
    work_dir: str | None
    lock: TimingLock | None
    hardware: dict[str, Any] | None = None
    cc: str = "cc"  # the compiler the candidate host executable is built with
    launcher: HostLauncher | None = None  # starts candidate hosts (set up on first use)
    peak_gflops: float | None = None  # this core's fp32 FMA peak (runtime.peak), once measured

    def fma_peak(self, core: int | None, *, again: bool = False) -> float:
        """This core's fp32 FMA peak in GFLOP/s (:mod:`runtime.peak`), measured on first use (``again``: now
        too), pinned and under the timing lock. A measurement only errs low, so the highest one is kept."""
        if self.peak_gflops is None or again:
            from runtime.peak import fma_peak_gflops
            from runtime.timing import pinned

            with self.lock.held() if self.lock is not None else contextlib.nullcontext(), pinned(core):
                measured = fma_peak_gflops(self.cache_dir, self.work_dir, cc=self.cc)
            self.peak_gflops = max(measured, self.peak_gflops or 0.0)
        return self.peak_gflops

    def hosts(self) -> HostLauncher:
        """What starts a candidate's host process (:mod:`runtime.sandbox.c_host`); its executable is built into the
        compile cache on first use."""
        if self.launcher is None:
            from runtime.sandbox.c_host import HostLauncher

            self.launcher = HostLauncher(self.cc, self.cache_dir, self.work_dir)
        return self.launcher

    def close(self) -> None:
        if self.launcher is not None:
            self.launcher.close()
            self.launcher = None


class Failure(Exception):
    """Ends the cascade with ``status`` and ``message``. ``metrics`` are kept with the failed result (e.g. the
    similarity an engine missed its floor by), ``timings`` too (the stages that ran before the failure)."""

    def __init__(self, status: Status, message: str, *, metrics: Mapping[str, Any] | None = None,
                 timings: Mapping[str, float] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.metrics = dict(metrics or {})
        self.timings = dict(timings or {})

    @classmethod
    @contextlib.contextmanager
    def timed(cls, timings: Mapping[str, float]) -> Iterator[None]:
        """A :class:`Failure` raised inside carries ``timings`` (what was measured before it was found)."""
        try:
            yield
        except Failure as exc:
            exc.timings = {**timings, **exc.timings}
            raise


class RivalFailure(Failure):
    """In a duel, the rival broke a rule (wrong outputs on the round's inputs, CPU used outside its calls, a
    crash): the verdict is against the rival, not the challenger. Both contestants are checked against
    the task's reference, never one against the other."""

    @classmethod
    @contextlib.contextmanager
    def blame(cls) -> Iterator[None]:
        """A :class:`Failure` raised inside is the rival's."""
        try:
            yield
        except RivalFailure:
            raise
        except Failure as exc:
            raise cls(exc.status, str(exc), metrics=exc.metrics, timings=exc.timings) from None


class UnsupportedStage(ValueError):
    """A request asked a backend for a stage it does not offer."""

    def __init__(self, backend: str, stage: str, offered: frozenset[str]) -> None:
        order = [s for s in STAGES if s in offered]
        super().__init__(f"the {backend} backend cannot run stage {stage!r} (it offers: {', '.join(order)})")


class BackendUnavailable(RuntimeError):
    """This machine cannot evaluate the task (no compiler, no GPU, ...); the message says which, and the fix.

    ``compile_only``: its candidates can still be compiled here (``evo check --compile-only``)."""

    def __init__(self, message: str, *, compile_only: bool = False) -> None:
        super().__init__(message)
        self.compile_only = compile_only


@dataclass(frozen=True)
class Column:
    """A metric ``evo check`` shows as a table column for a backend's tasks."""

    metric: str
    header: str
    percent: bool = False
    justify: Literal["left", "right"] = "right"


@dataclass
class Build:
    """A compiled candidate, not loaded: nothing of it has run. ``artifact`` is the backend's own (a shared
    library's path, a cubin, a built engine); ``seconds`` is the compile time (0 for a cache hit)."""

    genome: Genome
    artifact: Any
    seconds: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)  # e.g. compile_cached, ptxas' figures


@dataclass
class Measurement:
    """What timing (or a duel) found: the fitness (``None``: measured but not an elite, e.g. over a latency
    budget), the metrics it adds (``vs_reference`` for a timing, ``duel_ratio`` for a duel) and the stage
    timings (``lock_wait_s``, ``time_s``, ...)."""

    fitness: float | None
    metrics: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)


class Program(abc.ABC):
    """A loaded candidate: the only handle through which the cascade calls its code."""

    calls_s: float = 0.0
    """Seconds spent inside the candidate's and the reference's calls so far (not overhead)."""

    @abc.abstractmethod
    def check(self, trials: int) -> dict[str, Any]:
        """Checks correctness on fresh inputs (``trials`` rounds of the small cases, then the full one);
        returns the metrics it adds. Raises :class:`Failure` (``wrong``, ``invalid``)."""

    @abc.abstractmethod
    def time(self) -> Measurement:
        """Times the candidate side by side with the task's reference, under the timing lock; called after
        :meth:`check`. The measurement's metrics hold ``vs_reference``."""

    @abc.abstractmethod
    def confirm(self) -> None:
        """Checks again on fresh inputs (after an implausible speed-up); raises :class:`Failure`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the candidate (unloads its library, frees its buffers, stops its engine)."""


class RunsGivenInputs(abc.ABC):
    """A program that can run once on the caller's inputs (stage ``run``, serving's kernel invoke)."""

    @abc.abstractmethod
    def run(self, case: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> tuple[Outputs, str | None]:
        """The outputs of one call on ``inputs`` for ``case``, and how they differ from the reference (``None``:
        within tolerance). Breaking a rule raises :class:`Failure` as usual."""


class Profiles(abc.ABC):
    """A program that can say where its time goes (stage ``profile``: the factory plans its searches by it)."""

    @abc.abstractmethod
    def profile(self) -> Measurement:
        """Measures where its time goes on the task's texts, pinned and under the lock (after the cascade checked
        it); the metrics hold ``profile`` (:meth:`runtime.engine.profile.Profile.to_dict`), the fitness is ``None``."""


class Duels(abc.ABC):
    """A program that can be timed side by side with a rival of the same task (stage ``duel``)."""

    @abc.abstractmethod
    def duel(self, open_rival: Callable[[], Program]) -> Measurement:
        """Checks this candidate again and times it interleaved with the rival under the lock; calls
        ``open_rival`` (the cascade's loader, raising :class:`Failure`) where the backend needs the rival.
        Both are checked against the task's reference on every round; a rival that breaks a rule raises
        :class:`RivalFailure`. The metrics hold ``duel_ratio`` (> 1: this candidate is faster); the fitness
        is this candidate's from this timing (``None`` when over a budget)."""


class Backend(abc.ABC, Generic[T]):
    """Evaluates one kind of candidate. One instance per process (see :func:`runtime.backends.backend_for`),
    so it may keep state across evaluations in a worker (e.g. the engine's reference figures)."""

    name: ClassVar[str]
    program: ClassVar[type[Program]]
    """The type :meth:`load` returns: its base classes say which optional stages the backend offers."""
    check_columns: ClassVar[tuple[Column, ...]] = ()
    whole_node: ClassVar[bool] = False
    """On a cluster, one slot per node with every CPU of the node reserved (a load test wants the machine)."""
    per_gpu: ClassVar[bool] = False
    """On a cluster, one slot per GPU of a node."""

    @property
    def stages(self) -> frozenset[Stage]:
        """The request stages this backend offers."""
        extra: set[Stage] = set()
        if issubclass(self.program, RunsGivenInputs):
            extra.add("run")
        if issubclass(self.program, Duels):
            extra.add("duel")
        if issubclass(self.program, Profiles):
            extra.add("profile")
        return _CORE_STAGES | extra

    def supports(self, stage: str) -> bool:
        return stage in self.stages

    def require(self, stage: str) -> None:
        """Raises :class:`UnsupportedStage` unless this backend offers ``stage``."""
        if stage not in self.stages:
            raise UnsupportedStage(self.name, stage, self.stages)

    # --- in the controller ----------------------------------------------------------------------

    def preflight(self, task: T, settings: EvalSettings, *, compile_only: bool = False) -> None:
        """Raises :class:`BackendUnavailable` when this machine cannot evaluate ``task`` (or, with
        ``compile_only``, compile it). The default needs nothing."""

    def worker_gpu(self, slot: int) -> str | None:
        """The GPU (``CUDA_VISIBLE_DEVICES``) a worker in pool slot ``slot`` gets; ``None``: none."""
        return None

    # --- in a worker ----------------------------------------------------------------------------

    def prepare_worker(self, task: T, lock: TimingLock) -> None:
        """Runs once in a worker before it drops privileges: loads every module and file ``task``'s
        evaluations will need, and opens any lock file beside ``lock`` (later they may not be readable)."""

    def sandboxed(self, task: T, ctx: WorkerContext) -> None:
        """Runs once in a worker right after it entered its sandbox, before its first evaluation (e.g. to
        fork a clean template process for candidate hosts). The default does nothing."""

    def hardware(self, task: T, ctx: WorkerContext) -> dict[str, Any] | None:
        """The hardware fingerprint results carry (the default: the worker's)."""
        return ctx.hardware

    @abc.abstractmethod
    def compile(self, task: T, genome: Genome, settings: EvalSettings, ctx: WorkerContext) -> Build:
        """Renders and builds ``genome`` (cached in ``ctx.cache_dir``); runs none of it. Raises
        :class:`Failure` (``invalid`` for a genome that cannot be rendered, ``compile_error``)."""

    @abc.abstractmethod
    def load(self, task: T, build: Build, settings: EvalSettings, ctx: WorkerContext) -> Program:
        """Loads ``build`` into this process as a :class:`Program` (of type :attr:`program`)."""

"""The C backend: a candidate is C source, compiled by the system compiler, loaded with ctypes, called on
guarded numpy buffers and timed against the task's numpy reference on a pinned core.

This is the example to copy for a new backend: a :class:`Backend` with ``compile`` and ``load``, and a
:class:`Program` whose methods are the cascade's stages (see :mod:`runtime.backends.base`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
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
    RunsGivenInputs,
    WorkerContext,
)
from runtime.backends.kernels import CallClock, Instance, compare, compare_sampled, fresh_rng, timing_metrics
from runtime.result import Status
from runtime.settings import EvalSettings
from runtime.task import Case, KernelTask
from runtime.timing import pinned, time_interleaved
from runtime.toolchain.cc import CKernel, CompileError, CompilerNotFound, compile_source, compiler_version, load_kernel

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
    return Build(genome, built.path, built.seconds, {"compile_cached": built.cached})


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


def _prepared(task: KernelTask, clock: CallClock, case: Case, given: Mapping[str, np.ndarray] | None = None,
              ) -> Instance:
    """Fresh inputs for ``case`` (or ``given``) in guarded buffers, with the reference's outputs."""
    inst = Instance.fresh(task, case, given)
    inst.guard(task)
    inst.expect(task, clock)
    return inst


class CProgram(Program, RunsGivenInputs, Duels):
    """A loaded C kernel and the task it is checked against."""

    def __init__(self, task: KernelTask, kernel: CKernel, settings: EvalSettings, ctx: WorkerContext) -> None:
        self.task, self.kernel, self.settings, self.ctx = task, kernel, settings, ctx
        self.clock = CallClock()
        self._full: Instance | None = None  # the full case of the last check: what is timed

    @property
    def calls_s(self) -> float:  # type: ignore[override]
        return self.clock.calls

    def _call(self, inst: Instance) -> None:
        call = self.kernel.bind(self.task.kernel_args(inst.case, inst.arrays))
        inst.poison()
        self.clock.run(call)
        inst.verify_integrity()

    def _check_case(self, case: Case) -> Instance:
        inst = _prepared(self.task, self.clock, case)
        self._call(inst)
        compare(self.task, inst)
        return inst

    def check(self, trials: int) -> dict[str, Any]:
        for _ in range(trials):
            for case in self.task.check_cases(fresh_rng()[1]):
                self._check_case(case)
        self._full = self._check_case(self.task.full_case())
        return {}

    def time(self) -> Measurement:
        task, inst, timing = self.task, self._full, self.settings.timing
        assert inst is not None, "time() follows check()"
        t0 = time.perf_counter()
        call = self.kernel.bind(task.kernel_args(inst.case, inst.arrays))
        ref_out = {name: np.empty_like(a) for name, a in inst.expected.items()}
        rng = fresh_rng()[1]

        def reference() -> None:
            task.reference(inst.case, inst.inputs, ref_out)

        def round_end() -> None:  # this round's output, against the reference's on the same inputs
            inst.verify_integrity()
            compare_sampled(task, inst, ref_out, rng)

        timings: dict[str, float] = {}
        with Failure.timed(timings):
            with self.ctx.lock.held() as waited, pinned(timing.core, task.args.threads) as cores:  # type: ignore[union-attr]
                timings["lock_wait_s"] = waited
                try:  # fresh inputs every round: a kernel never sees the same inputs twice (no memoisation)
                    run = time_interleaved(call, reference, timing, round_start=lambda: inst.refill(task, rng),
                                           round_end=round_end)  # fmt: skip
                finally:
                    timings["time_s"] = time.perf_counter() - t0 - waited
        self.clock.calls += run.call_seconds
        with Failure.timed(timings):
            for name in inst.outputs:  # the last round's output, in full
                inst.expected[name][...] = ref_out[name]
            compare(task, inst)
        fitness, metrics = timing_metrics(run, task.work(inst.case))
        return Measurement(fitness, {**metrics, "cores": sorted(cores)}, timings)

    def confirm(self) -> None:
        self._check_case(self.task.full_case())

    def run(self, case: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> tuple[Outputs, str | None]:
        inst = _prepared(self.task, self.clock, dict(case), given=inputs)
        self._call(inst)
        try:
            compare(self.task, inst)
            mismatch = None
        except Failure as exc:
            mismatch = str(exc)
        return {name: inst.arrays[name].copy() for name in inst.outputs}, mismatch

    def duel(self, open_rival: Callable[[], Program]) -> Measurement:
        rival = open_rival()
        assert isinstance(rival, CProgram)
        task, timing = self.task, self.settings.timing
        full_case = task.full_case()
        mine = self._check_case(full_case)
        theirs = _prepared(task, self.clock, full_case, given=mine.inputs)
        call = self.kernel.bind(task.kernel_args(full_case, mine.arrays))
        rival_call = rival.kernel.bind(task.kernel_args(full_case, theirs.arrays))
        rng = fresh_rng()[1]

        def round_start() -> None:  # fresh inputs every round, the same for both
            mine.refill(task, rng)
            for name, arr in mine.inputs.items():
                theirs.inputs[name] = arr
                theirs.arrays[name][...] = arr
            theirs.poison()

        def round_end() -> None:  # the rival, the best so far, is the yardstick of the challenger's outputs
            mine.verify_integrity()
            compare_sampled(task, mine, {n: theirs.arrays[n] for n in mine.outputs}, rng)

        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        with Failure.timed(timings):
            with self.ctx.lock.held() as waited, pinned(timing.core, task.args.threads):  # type: ignore[union-attr]
                timings["lock_wait_s"] = waited
                try:
                    run = time_interleaved(call, rival_call, timing, round_start=round_start, round_end=round_end)
                finally:
                    timings["time_s"] = time.perf_counter() - t0 - waited
        self.clock.calls += run.call_seconds
        with Failure.timed(timings):
            mine.expect(task, self.clock)  # the last round's inputs, in full
            compare(task, mine)
        median = max(run.candidate.median, 1e-12)
        metrics = {"duel_ratio": run.reference.median / median, "time_median_s": median,
                   "rival_time_median_s": run.reference.median, "n_repeats": run.candidate.n}  # fmt: skip
        return Measurement(task.work(full_case) / median, metrics, timings)

    def close(self) -> None:
        self.kernel.close()


class CBackend(Backend[KernelTask]):
    """C kernels through the system compiler (``evaluation.compiler``)."""

    name = "c"
    program = CProgram

    def preflight(self, task: KernelTask, settings: EvalSettings, *, compile_only: bool = False) -> None:
        try:
            compiler_version(settings.compiler.cc)
        except CompilerNotFound as exc:
            raise BackendUnavailable(str(exc)) from None

    def prepare_worker(self, task: KernelTask) -> None:
        prime_kernel_task(task)

    def compile(self, task: KernelTask, genome: Genome, settings: EvalSettings, ctx: WorkerContext) -> Build:
        return compile_kernel(task, genome, settings, ctx)

    def load(self, task: KernelTask, build: Build, settings: EvalSettings, ctx: WorkerContext) -> CProgram:
        try:
            kernel = load_kernel(build.artifact, task.kernel_name)
        except CompileError as exc:  # e.g. the library defines no such function
            raise Failure(Status.COMPILE_ERROR, exc.stderr) from None
        return CProgram(task, kernel, settings, ctx)

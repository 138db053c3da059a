"""The evaluation cascade, run inside a sandboxed worker: render -> compile -> check small -> check full -> time.

Each stage may end the candidate (see :class:`runtime.result.Status`). Integrity rules hold on every
call of the candidate: outputs are poisoned (NaN) before the call, every array the kernel sees sits
between guard zones that must be intact afterwards, and inputs must come back unchanged. None of this
happens inside the timed region.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.backends.c import CKernel, CompileError, compile_source, load_kernel
from runtime.executor import EvalRequest
from runtime.result import EvalResult, Status
from runtime.task import Case, Task
from runtime.timing import TimingLock, pinned, time_interleaved

__all__ = ["GUARD_BYTES", "Failure", "WorkerContext", "evaluate", "guarded_empty"]

GUARD_BYTES = 256  # 64 floats of sentinel before and after every array the kernel sees
_SENTINEL = 0xA5
_ALIGN = 64


@dataclass
class WorkerContext:
    """What a worker holds across evaluations."""

    cache_dir: str  # the compile cache (a /proc/self/fd path once the worker dropped privileges)
    work_dir: str
    lock: TimingLock
    hardware: dict[str, Any] | None = None


class Failure(Exception):
    """Ends the cascade with ``status`` and ``message``."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Done(Exception):
    """A partial cascade (``request.stages``) reached its last stage."""


def guarded_empty(shape: tuple[int, ...], dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """A 64-byte-aligned array between two sentinel guard zones: ``(raw bytes, the array)``."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    block = np.empty(nbytes + 2 * GUARD_BYTES + _ALIGN, np.uint8)
    start = -block.ctypes.data % _ALIGN
    raw = block[start : start + nbytes + 2 * GUARD_BYTES]
    raw[:GUARD_BYTES] = _SENTINEL
    raw[-GUARD_BYTES:] = _SENTINEL
    return raw, raw[GUARD_BYTES : GUARD_BYTES + nbytes].view(dtype).reshape(shape)


def _guards_intact(raw: np.ndarray) -> bool:
    return bool((raw[:GUARD_BYTES] == _SENTINEL).all() and (raw[-GUARD_BYTES:] == _SENTINEL).all())


def _poison(a: np.ndarray) -> None:
    if np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.complexfloating):
        a.fill(np.nan)
    else:
        a.view(np.uint8).fill(0x5A)


@dataclass
class _Clock:
    """Seconds spent inside kernel and reference calls (not overhead)."""

    calls: float = 0.0

    def run(self, fn: Any) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            self.calls += time.perf_counter() - t0


@dataclass
class _Instance:
    """One case with its inputs, the kernel's guarded arrays, and the expected outputs."""

    case: Case
    seed: int
    inputs: dict[str, np.ndarray]
    raws: dict[str, np.ndarray] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # what the kernel sees (guarded)
    expected: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()

    def poison(self) -> None:
        for name in self.outputs:
            _poison(self.arrays[name])

    def verify_written(self) -> None:
        """Cheap check after a timed call: no poisoned (NaN) value is left in a float output."""
        for name in self.outputs:
            out, expected = self.arrays[name], self.expected[name]
            if np.issubdtype(out.dtype, np.floating) and np.isnan(out).any() and not np.isnan(expected).any():
                raise Failure(Status.WRONG, f"left output {name!r} unwritten on a timed call, case {self.case}")

    def verify_integrity(self) -> None:
        for name, raw in self.raws.items():
            if not _guards_intact(raw):
                raise Failure(
                    Status.INVALID, f"wrote out of bounds of {name!r} (guard zone overwritten), case {self.case}"
                )
        for name, original in self.inputs.items():
            if not np.array_equal(self.arrays[name].view(np.uint8), original.view(np.uint8)):
                raise Failure(Status.INVALID, f"modified its inputs ({name!r}), case {self.case}")


def _instance(task: Task, case: Case, clock: _Clock, given: Mapping[str, np.ndarray] | None = None) -> _Instance:
    """Fresh random inputs for ``case`` (or the ``given`` ones), guarded, with the reference's outputs."""
    seed = int.from_bytes(os.urandom(8), "little")
    rng = np.random.default_rng(seed)
    inputs = {k: np.ascontiguousarray(v) for k, v in (given if given is not None else task.inputs(case, rng)).items()}
    inst = _Instance(case, seed, inputs)
    for name, arr in inputs.items():
        inst.raws[name], inst.arrays[name] = guarded_empty(arr.shape, arr.dtype)
        inst.arrays[name][...] = arr
    shapes = task.outputs(case)
    inst.outputs = tuple(shapes)
    for name, (shape, dtype) in shapes.items():
        inst.raws[name], inst.arrays[name] = guarded_empty(shape, dtype)
        inst.expected[name] = np.empty(shape, dtype)
    clock.run(lambda: task.reference(case, inputs, inst.expected))
    return inst


def _compare(task: Task, inst: _Instance) -> None:
    rtol, atol = task.tolerance(inst.case)
    for name in inst.outputs:
        got, exp = inst.arrays[name], inst.expected[name]
        g, e = got.astype(np.float64, copy=False), exp.astype(np.float64, copy=False)
        err = np.abs(g - e)
        bad = ~(err <= atol + rtol * np.abs(e)) & ~(np.isnan(g) & np.isnan(e))
        if not bad.any():
            continue
        nan = np.isnan(g) & ~np.isnan(e)
        if nan.any():
            where = int(np.argmax(nan))
        else:
            where = int(np.argmax(np.where(bad, np.nan_to_num(err, nan=np.inf), -1.0)))
        idx = tuple(int(i) for i in np.unravel_index(where, got.shape))
        what = "NaN in output" if nan.any() else f"max error {float(err.flat[where]):.4g} in output"
        raise Failure(
            Status.WRONG,
            f"{what} {name!r} at index {idx}: expected {exp.flat[where].item()!r}, got {got.flat[where].item()!r} "
            f"({int(bad.sum())} of {bad.size} elements outside rtol={rtol:g}, atol={atol:g}); "
            f"case {inst.case}, input seed {inst.seed}",
        )


def _check(task: Task, kernel: CKernel, case: Case, clock: _Clock) -> _Instance:
    """Runs the kernel once on fresh inputs for ``case`` and raises :class:`Failure` if it broke a rule."""
    inst = _instance(task, case, clock)
    call = kernel.bind(task.kernel_args(case, inst.arrays))
    inst.poison()
    clock.run(call)
    inst.verify_integrity()
    _compare(task, inst)
    return inst


def _run_given(
    task: Task, kernel: CKernel, request: EvalRequest, clock: _Clock
) -> tuple[dict[str, np.ndarray], str | None]:
    """One call on the request's own inputs (stages="run"): the outputs, and how they differ from the
    reference (``None`` when within tolerance). Breaking a rule raises :class:`Failure` as usual."""
    case = dict(request.case or {})
    inst = _instance(task, case, clock, given=request.inputs or {})
    call = kernel.bind(task.kernel_args(case, inst.arrays))
    inst.poison()
    clock.run(call)
    inst.verify_integrity()
    try:
        _compare(task, inst)
        mismatch = None
    except Failure as exc:
        mismatch = str(exc)
    return {name: inst.arrays[name].copy() for name in inst.outputs}, mismatch


class _Dueled(Exception):
    """A duel (``request.stages == "duel"``) is over; its figures are in the metrics."""


def _duel(
    task: Task, kernel: CKernel, request: EvalRequest, ctx: WorkerContext, clock: _Clock,
    metrics: dict[str, Any], timings: dict[str, float],
) -> float:
    """Times ``kernel`` side by side with the rival's on the full case (same inputs, interleaved, under the
    lock); returns the kernel's fitness from this timing and puts ``duel_ratio`` (rival time / kernel
    time) in ``metrics``. The kernel is checked again first and its timed output compared after."""
    if request.rival is None:
        raise Failure(Status.INVALID, "a duel needs a rival genome")
    settings = request.settings
    built = compile_source(task.render(request.rival), compiler=settings.compiler,
                           extra_flags=task.compile_flags(), cache_dir=ctx.cache_dir, work_dir=ctx.work_dir)
    rival = load_kernel(built.path, task.kernel_name)
    try:
        full_case = task.full_case()
        mine = _check(task, kernel, full_case, clock)
        theirs = _instance(task, full_case, clock, given=mine.inputs)
        call = kernel.bind(task.kernel_args(full_case, mine.arrays))
        rival_call = rival.bind(task.kernel_args(full_case, theirs.arrays))
        t0 = time.perf_counter()
        with ctx.lock.held() as waited, pinned(settings.timing.core, task.args.threads):
            run = time_interleaved(call, rival_call, settings.timing, before=mine.poison, after=mine.verify_written)
        timings["lock_wait_s"] = waited
        timings["time_s"] = time.perf_counter() - t0 - waited
        clock.calls += run.call_seconds
        mine.verify_integrity()
        _compare(task, mine)
    finally:
        rival.close()
    median = max(run.candidate.median, 1e-12)
    metrics.update(duel_ratio=run.reference.median / median, duel_rival=request.rival.id, time_median_s=median,
                   rival_time_median_s=run.reference.median, n_repeats=run.candidate.n)
    return task.work(full_case) / median


def evaluate(request: EvalRequest, task: Task, ctx: WorkerContext) -> EvalResult:
    """Runs the whole cascade for one request; a failing stage ends it with its status."""
    if task.backend == "engine":  # an engine configuration, measured under load (runtime.engine)
        from runtime.engine.evaluate import evaluate_engine

        return evaluate_engine(request, task, ctx)  # type: ignore[arg-type]
    if task.backend == "cuda":  # a CUDA kernel, on this worker's GPU (runtime.cuda_cascade)
        from runtime.cuda_cascade import evaluate_cuda

        return evaluate_cuda(request, task, ctx)  # type: ignore[arg-type]
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    metrics: dict[str, Any] = {}
    clock = _Clock()
    settings = request.settings
    kernel: CKernel | None = None
    outputs: dict[str, np.ndarray] | None = None
    try:
        try:
            source = task.render(request.genome)
        except Exception as exc:  # noqa: BLE001 - a bad genome, not a worker bug
            raise Failure(Status.INVALID, f"cannot render the genome: {exc}") from None
        try:
            built = compile_source(
                source,
                compiler=settings.compiler,
                extra_flags=task.compile_flags(),
                cache_dir=ctx.cache_dir,
                work_dir=ctx.work_dir,
            )
            metrics["compile_cached"] = built.cached
            timings["compile_s"] = built.seconds
            kernel = load_kernel(built.path, task.kernel_name)
        except CompileError as exc:
            raise Failure(Status.COMPILE_ERROR, exc.stderr) from None
        if request.stages == "compile":
            raise _Done
        if request.stages == "run":
            outputs, mismatch = _run_given(task, kernel, request, clock)
            metrics["matches_reference"] = mismatch is None
            if mismatch is not None:
                metrics["reference_mismatch"] = mismatch
            raise _Done

        if request.stages == "duel":
            fitness = _duel(task, kernel, request, ctx, clock, metrics, timings)
            raise _Dueled

        t0 = time.perf_counter()
        for _ in range(settings.check_trials):
            rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
            for case in task.check_cases(rng):
                _check(task, kernel, case, clock)
        full_case = task.full_case()
        inst = _check(task, kernel, full_case, clock)
        timings["check_s"] = time.perf_counter() - t0
        if request.stages == "check":
            raise _Done

        t0 = time.perf_counter()
        call = kernel.bind(task.kernel_args(full_case, inst.arrays))
        ref_out = {name: np.empty_like(a) for name, a in inst.expected.items()}

        def reference() -> None:
            task.reference(full_case, inst.inputs, ref_out)

        with ctx.lock.held() as waited, pinned(settings.timing.core, task.args.threads) as cores:
            run = time_interleaved(call, reference, settings.timing, before=inst.poison, after=inst.verify_written)
        clock.calls += run.call_seconds
        timings["lock_wait_s"] = waited
        timings["time_s"] = time.perf_counter() - t0 - waited
        inst.verify_integrity()
        _compare(task, inst)  # the last timed call's output must be right too

        cand, ref = run.candidate, run.reference
        median = max(cand.median, 1e-12)
        work = task.work(full_case)
        vs_reference = ref.median / median
        metrics.update(
            vs_reference=vs_reference,
            time_median_s=cand.median,
            time_min_s=cand.min,
            time_mean_s=cand.mean,
            time_std_s=cand.std,
            n_repeats=cand.n,
            ref_time_median_s=ref.median,
            ref_time_min_s=ref.min,
            ref_fitness=work / max(ref.median, 1e-12),
            rel_uncertainty=run.rel_uncertainty if math.isfinite(run.rel_uncertainty) else None,
            cores=sorted(cores),
            flagged=False,
        )
        if vs_reference > settings.implausible_speedup:
            try:
                _check(task, kernel, full_case, clock)
            except Failure as exc:
                note = f"(on re-verifying an implausible {vs_reference:.1f}x speed-up)"
                raise Failure(exc.status, f"{exc} {note}") from None
            metrics["flagged"] = True
        status, fitness, error = Status.OK, work / median, None
    except _Done:
        status, fitness, error = Status.OK, None, None
    except _Dueled:
        status, error = Status.OK, None
    except Failure as exc:
        status, fitness, error = exc.status, None, str(exc)
    finally:
        if kernel is not None:
            kernel.close()
    total = time.perf_counter() - t_start
    timings["total_s"] = total
    timings["calls_s"] = clock.calls
    timings["overhead_s"] = max(
        0.0, total - timings.get("compile_s", 0.0) - clock.calls - timings.get("lock_wait_s", 0.0)
    )
    return EvalResult(
        status=status,
        fitness=fitness,
        unit=task.unit,
        metrics=metrics if status is Status.OK else {k: v for k, v in metrics.items() if k == "compile_cached"},
        error=error,
        timings=timings,
        hardware=ctx.hardware,
        outputs=outputs,
    )

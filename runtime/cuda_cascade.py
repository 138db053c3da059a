"""The evaluation cascade for CUDA tasks: render -> nvcc -> launch check -> check small -> check full -> time.

The same stages, statuses and integrity rules as :mod:`runtime.cascade`, on the GPU: every device
buffer sits between guard zones, outputs are poisoned (NaN) before each call, inputs must come back
unchanged, and outputs are compared on the host with the task's tolerances. Timing uses CUDA events
through the one harness (:func:`runtime.timing.time_interleaved`), interleaved with the GPU reference
(cuBLAS, torch) under this GPU's timing lock. A kernel that faults leaves the context unusable: the
worker reports the error and exits, and the pool starts a fresh worker (with a fresh context).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from genome import Genome
from runtime.backends.c import CompileError
from runtime.backends.cuda import CudaCompileResult, PtxasInfo, compile_cuda
from runtime.backends.cuda_device import (
    CudaUnavailable,
    Device,
    DeviceBuffer,
    Kernel,
    host_time,
    is_sticky,
    open_device,
)
from runtime.backends.cuda_launch import ArchLimits, Launch, LaunchError, arch_limits, occupancy, validate_launch
from runtime.backends.cuda_reference import gpu_reference
from runtime.cascade import _SENTINEL, GUARD_BYTES, Failure, WorkerContext, _Clock, _compare, _Done, _Instance
from runtime.cuda_task import CudaTask
from runtime.executor import EvalRequest
from runtime.result import EvalResult, Status
from runtime.settings import EvalSettings
from runtime.task import Case
from runtime.timing import time_interleaved

__all__ = ["compile_candidate", "evaluate_cuda", "launch_for"]

_FAULT_EXIT = 70  # the worker's exit code after a kernel fault (the pool reports it as a crash)


def launch_for(task: CudaTask, params: Mapping[str, Any], case: Case, limits: ArchLimits, info: PtxasInfo) -> Launch:
    """The task's launch for ``case``, validated against ``limits``; an unrunnable one is ``invalid``."""
    try:
        launch = task.launch(params, case)
        validate_launch(launch, limits, registers=info.registers, static_smem=info.smem_bytes)
    except LaunchError as exc:
        raise Failure(Status.INVALID, f"invalid launch for case {case}: {exc}") from None
    return launch


def compile_candidate(
    task: CudaTask, genome: Genome, settings: EvalSettings, *, arch: str, cache_dir: str, work_dir: str | None = None
) -> tuple[CudaCompileResult, dict[str, Any]]:
    """The compile stage (also ``evo check --compile-only``): render, nvcc, and the full case's launch
    checked against ``arch``; returns the cubin and its metrics (ptxas figures, occupancy estimate)."""
    try:
        source = task.render(genome)
    except Exception as exc:  # noqa: BLE001 - a bad genome, not a worker bug
        raise Failure(Status.INVALID, f"cannot render the genome: {exc}") from None
    try:
        built = compile_cuda(
            source,
            settings=settings.cuda,
            arch=arch,
            kernel=task.kernel_name,
            extra_flags=task.compile_flags(),
            cache_dir=cache_dir,
            work_dir=work_dir,
        )
    except CompileError as exc:
        raise Failure(Status.COMPILE_ERROR, exc.stderr) from None
    limits = arch_limits(arch)
    launch = launch_for(task, genome.params, task.full_case(), limits, built.info)
    smem = built.info.smem_bytes + launch.shared_bytes
    occ = occupancy(limits, launch.threads, built.info.registers, smem)
    metrics = {"compile_cached": built.cached, **built.info.metrics(), "threads_per_block": launch.threads,
               "smem_bytes": smem, "occupancy": occ.occupancy, "occupancy_limited_by": occ.limited_by}  # fmt: skip
    return built, metrics


class _Run:
    """One candidate on the device: its kernel and the buffers of the case being checked or timed."""

    def __init__(self, task: CudaTask, dev: Device, kernel: Kernel, params: Mapping[str, Any], limits: ArchLimits,
                 info: PtxasInfo, clock: _Clock) -> None:  # fmt: skip
        self.task, self.dev, self.kernel, self.params = task, dev, kernel, params
        self.limits, self.info, self.clock = limits, info, clock
        self.buffers: dict[str, DeviceBuffer] = {}

    def free(self) -> None:
        for b in self.buffers.values():
            b.free()
        self.buffers = {}

    def check(self, case: Case) -> tuple[_Instance, Callable[[], None]]:
        """Runs the kernel once on fresh inputs for ``case``; raises :class:`Failure` if it broke a rule."""
        self.free()
        task, dev = self.task, self.dev
        seed = int.from_bytes(os.urandom(8), "little")
        inputs = {k: np.ascontiguousarray(v) for k, v in task.inputs(case, np.random.default_rng(seed)).items()}
        inst = _Instance(case, seed, inputs)
        inst.outputs = tuple(task.outputs(case))
        for name, (shape, dtype) in task.outputs(case).items():
            inst.expected[name] = np.empty(shape, dtype)
            self.buffers[name] = dev.buffer(shape, dtype, guard=GUARD_BYTES, sentinel=_SENTINEL)
        for name, arr in inputs.items():
            self.buffers[name] = dev.buffer(arr.shape, arr.dtype, guard=GUARD_BYTES, sentinel=_SENTINEL)
            self.buffers[name].upload(arr)
        self.clock.run(lambda: task.reference(case, inputs, inst.expected))
        launch = launch_for(task, self.params, case, self.limits, self.info)
        call = self.kernel.bind(launch, task.kernel_args(case, self.buffers))
        self.poison(inst)
        self.clock.run(lambda: (call(), dev.synchronize()))
        self.verify(inst)
        return inst, call

    def poison(self, inst: _Instance) -> None:
        for name in inst.outputs:
            self.buffers[name].poison()

    def verify(self, inst: _Instance) -> None:
        """Guard zones intact, inputs unchanged, outputs right (downloaded into ``inst.arrays``)."""
        for name, buf in self.buffers.items():
            if not buf.guards_intact():
                raise Failure(
                    Status.INVALID, f"wrote out of bounds of {name!r} (guard zone overwritten), case {inst.case}"
                )
        for name, original in inst.inputs.items():
            if not np.array_equal(self.buffers[name].download().view(np.uint8), original.view(np.uint8)):
                raise Failure(Status.INVALID, f"modified its inputs ({name!r}), case {inst.case}")
        for name in inst.outputs:
            inst.arrays[name] = self.buffers[name].download()
        _compare(self.task, inst)


def _hardware(ctx: WorkerContext, dev: Device) -> dict[str, Any]:
    info = {k: v for k, v in (ctx.hardware or {}).items() if k != "id"}
    info.update(dev.info())
    info["id"] = hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return info


def _is_driver_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("pycuda")


def evaluate_cuda(request: EvalRequest, task: CudaTask, ctx: WorkerContext) -> EvalResult:
    """Runs the CUDA cascade for one request; a failing stage ends it with its status."""
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    metrics: dict[str, Any] = {}
    clock = _Clock()
    settings = request.settings
    run: _Run | None = None
    hardware = ctx.hardware
    try:
        try:
            dev = open_device()
        except CudaUnavailable as exc:
            raise Failure(Status.INVALID, f"no usable GPU in the worker: {exc}") from None
        hardware = _hardware(ctx, dev)
        arch = settings.cuda.arch or dev.arch
        built, compiled = compile_candidate(task, request.genome, settings, arch=arch, cache_dir=ctx.cache_dir,
                                            work_dir=ctx.work_dir)  # fmt: skip
        metrics.update(compiled)
        timings["compile_s"] = built.seconds
        try:
            kernel = dev.load(built.path, task.kernel_name)
        except CompileError as exc:
            raise Failure(Status.COMPILE_ERROR, exc.stderr) from None
        except Exception as exc:
            if not _is_driver_error(exc):  # e.g. a cubin built for another arch than this GPU's
                raise
            raise Failure(Status.COMPILE_ERROR, f"the driver cannot load the cubin ({arch}): {exc}") from None
        if request.stages == "compile":
            raise _Done
        run = _Run(task, dev, kernel, request.genome.params, arch_limits(arch), built.info, clock)
        try:
            _check_and_time(request, task, run, task.full_case(), metrics, timings)
        except (Failure, _Done):
            raise
        except Exception as exc:
            if not _is_driver_error(exc):
                raise
            if is_sticky(exc):  # the context is lost: report, and let the pool start a fresh worker
                print(f"evoforge: kernel fault, the CUDA context is lost: {exc}", file=sys.stderr, flush=True)
                os._exit(_FAULT_EXIT)
            raise Failure(Status.INVALID, f"the GPU refused the launch: {exc}") from None
        status, fitness, error = Status.OK, metrics.pop("_fitness"), None
    except _Done:
        status, fitness, error = Status.OK, None, None
    except Failure as exc:
        status, fitness, error = exc.status, None, str(exc)
    finally:
        if run is not None:
            run.free()
    total = time.perf_counter() - t_start
    timings.update(total_s=total, calls_s=clock.calls)
    timings["overhead_s"] = max(
        0.0, total - timings.get("compile_s", 0.0) - clock.calls - timings.get("lock_wait_s", 0.0)
    )
    kept = metrics if status is Status.OK else {k: metrics[k] for k in ("compile_cached",) if k in metrics}
    return EvalResult(status=status, fitness=fitness, unit=task.unit, metrics=kept, error=error, timings=timings,
                      hardware=hardware)  # fmt: skip


def _check_and_time(request: EvalRequest, task: CudaTask, run: _Run, case: Case, metrics: dict[str, Any],
                    timings: dict[str, float]) -> None:  # fmt: skip
    settings, dev = request.settings, run.dev
    t0 = time.perf_counter()
    for _ in range(settings.check_trials):
        for small in task.check_cases(np.random.default_rng(int.from_bytes(os.urandom(8), "little"))):
            run.check(small)
    inst, call = run.check(case)
    timings["check_s"] = time.perf_counter() - t0
    if request.stages == "check":
        raise _Done

    t0 = time.perf_counter()
    inputs = {k: run.buffers[k] for k in inst.inputs}
    ref_out = {
        k: dev.buffer(b.shape, b.dtype, guard=0, sentinel=0) for k, b in run.buffers.items() if k in inst.outputs
    }
    run.buffers.update({f"_ref_{k}": b for k, b in ref_out.items()})  # freed with the others
    found = gpu_reference(task.gpu_reference, case, inputs, ref_out) if task.gpu_reference else None
    host_out = {k: np.empty_like(v) for k, v in inst.expected.items()}
    ref_call, impl = found or ((lambda: task.reference(case, inst.inputs, host_out)), "numpy (host)")

    def timer(fn: Callable[[], object]) -> float:
        if found is None and fn is ref_call:
            return host_time(fn)
        return dev.time_call(fn, l2_flush=settings.cuda.l2_flush)

    with dev.lock(settings.timing.lock_file).held() as waited:
        timed = time_interleaved(call, ref_call, settings.timing, before=lambda: run.poison(inst), timer=timer)
    run.clock.calls += timed.call_seconds
    timings["lock_wait_s"] = waited
    timings["time_s"] = time.perf_counter() - t0 - waited
    for k in ref_out:
        del run.buffers[f"_ref_{k}"]
        ref_out[k].free()
    run.verify(inst)  # the last timed call's output must be right too

    cand, ref = timed.candidate, timed.reference
    median = max(cand.median, 1e-12)
    work = task.work(case)
    vs_reference = ref.median / median
    metrics.update(
        vs_reference=vs_reference, time_median_s=cand.median, time_min_s=cand.min, time_mean_s=cand.mean,
        time_std_s=cand.std, n_repeats=cand.n, ref_time_median_s=ref.median, ref_time_min_s=ref.min,
        ref_fitness=work / max(ref.median, 1e-12), reference_impl=impl, l2_flush=settings.cuda.l2_flush,
        rel_uncertainty=timed.rel_uncertainty if math.isfinite(timed.rel_uncertainty) else None, flagged=False,
    )  # fmt: skip
    if vs_reference > settings.implausible_speedup:
        try:
            run.check(case)
        except Failure as exc:
            raise Failure(exc.status, f"{exc} (on re-verifying an implausible {vs_reference:.1f}x speed-up)") from None
        metrics["flagged"] = True
    metrics["_fitness"] = work / median

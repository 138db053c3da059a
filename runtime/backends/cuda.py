"""The CUDA backend: a candidate is CUDA C++ compiled by nvcc to a cubin, launched through pycuda on guarded
device buffers, and timed with CUDA events against the GPU reference (cuBLAS, torch) under this GPU's lock.

The same statuses and integrity rules as the C backend, on the GPU: every device buffer sits between guard
zones, outputs are poisoned (NaN) before each call, inputs must come back unchanged, and outputs are
compared on the host with the task's tolerances. A launch the genome makes impossible (too many
threads, too much shared memory) is ``invalid`` before anything runs. A kernel that faults leaves the
context unusable: the worker reports the error and exits, and the pool starts a fresh worker (with a
fresh context). The optional stages ``run`` and ``duel`` are not offered.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
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
    Column,
    Failure,
    Measurement,
    Program,
    WorkerContext,
)
from runtime.backends.c import prime_kernel_task
from runtime.backends.kernels import (
    GUARD_BYTES,
    SENTINEL,
    CallClock,
    Instance,
    check_plan,
    compare,
    timing_metrics,
)
from runtime.cuda_task import CudaTask
from runtime.result import Status
from runtime.settings import EvalSettings
from runtime.task import Case
from runtime.timing import time_interleaved
from runtime.toolchain.cc import CompileError
from runtime.toolchain.cuda_device import (
    CudaUnavailable,
    Device,
    DeviceBuffer,
    Kernel,
    host_time,
    is_sticky,
    open_device,
)
from runtime.toolchain.cuda_launch import ArchLimits, Launch, LaunchError, arch_limits, occupancy, validate_launch
from runtime.toolchain.cuda_reference import gpu_reference
from runtime.toolchain.nvcc import CudaCompileResult, NvccNotFound, PtxasInfo, compile_cuda, nvcc_version

__all__ = ["CudaBackend", "CudaProgram", "launch_for"]

_FAULT_EXIT = 70  # the worker's exit code after a kernel fault (the pool reports it as a crash)


def launch_for(task: CudaTask, params: Mapping[str, Any], case: Case, limits: ArchLimits, info: PtxasInfo) -> Launch:
    """The task's launch for ``case``, validated against ``limits``; an unrunnable one is ``invalid``."""
    try:
        launch = task.launch(params, case)
        validate_launch(launch, limits, registers=info.registers, static_smem=info.smem_bytes)
    except LaunchError as exc:
        raise Failure(Status.INVALID, f"invalid launch for case {case}: {exc}") from None
    return launch


@dataclass(frozen=True)
class _Cubin:
    """A CUDA build's artifact: the cubin with ptxas' report, and the target it was built for."""

    built: CudaCompileResult
    arch: str


def _is_driver_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("pycuda")


@contextlib.contextmanager
def _on_the_gpu() -> Iterator[None]:
    """Driver errors while the candidate runs: a lost context ends the worker; a refused launch is ``invalid``."""
    try:
        yield
    except Exception as exc:
        if not _is_driver_error(exc):
            raise
        if is_sticky(exc):  # the context is lost: report, and let the pool start a fresh worker
            print(f"evoforge: kernel fault, the CUDA context is lost: {exc}", file=sys.stderr, flush=True)
            os._exit(_FAULT_EXIT)
        raise Failure(Status.INVALID, f"the GPU refused the launch: {exc}") from None


class CudaProgram(Program):
    """A loaded cubin on the device, and the buffers of the case being checked or timed."""

    def __init__(self, task: CudaTask, dev: Device, kernel: Kernel, build: Build, settings: EvalSettings) -> None:
        self.task, self.dev, self.kernel, self.settings = task, dev, kernel, settings
        self.params = build.genome.params
        cubin: _Cubin = build.artifact
        self.limits, self.info = arch_limits(cubin.arch), cubin.built.info
        self.clock = CallClock()
        self.buffers: dict[str, DeviceBuffer] = {}
        self._full: tuple[Instance, Callable[[], None]] | None = None

    @property
    def calls_s(self) -> float:  # type: ignore[override]
        return self.clock.calls

    def _free(self) -> None:
        for b in self.buffers.values():
            b.free()
        self.buffers = {}

    def _check_case(self, case: Case, kind: str = "typical") -> tuple[Instance, Callable[[], None]]:
        """Runs the kernel once on fresh inputs for ``case`` (of the value distribution ``kind``); raises
        :class:`Failure` if it broke a rule."""
        self._free()
        task, dev = self.task, self.dev
        inst = Instance.fresh(task, case, kind=kind)
        for name in inst.outputs:
            exp = inst.expected[name]
            self.buffers[name] = dev.buffer(exp.shape, exp.dtype, guard=GUARD_BYTES, sentinel=SENTINEL)
        for name, arr in inst.inputs.items():
            self.buffers[name] = dev.buffer(arr.shape, arr.dtype, guard=GUARD_BYTES, sentinel=SENTINEL)
            self.buffers[name].upload(arr)
        inst.expect(task, self.clock)
        launch = launch_for(task, self.params, case, self.limits, self.info)
        call = self.kernel.bind(launch, task.kernel_args(case, self.buffers))
        self._poison(inst)
        self.clock.run(lambda: (call(), dev.synchronize()))
        self._verify(inst)
        return inst, call

    def _poison(self, inst: Instance) -> None:
        for name in inst.outputs:
            self.buffers[name].poison()

    def _verify(self, inst: Instance) -> None:
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
        compare(self.task, inst)

    def check(self, trials: int) -> dict[str, Any]:
        with _on_the_gpu():
            for small, kind in check_plan(self.task, trials):
                self._check_case(small, kind)
            self._full = self._check_case(self.task.full_case())
        return {}

    def time(self) -> Measurement:
        assert self._full is not None, "time() follows check()"
        with _on_the_gpu():
            return self._time(*self._full)

    def _time(self, inst: Instance, call: Callable[[], None]) -> Measurement:
        task, dev, settings, case = self.task, self.dev, self.settings, inst.case
        t0 = time.perf_counter()
        inputs = {k: self.buffers[k] for k in inst.inputs}
        ref_out = {
            k: dev.buffer(b.shape, b.dtype, guard=0, sentinel=0) for k, b in self.buffers.items() if k in inst.outputs
        }
        self.buffers.update({f"_ref_{k}": b for k, b in ref_out.items()})  # freed with the others
        found = gpu_reference(task.gpu_reference, case, inputs, ref_out) if task.gpu_reference else None
        host_out = {k: np.empty_like(v) for k, v in inst.expected.items()}
        ref_call, impl = found or ((lambda: task.reference(case, inst.inputs, host_out)), "numpy (host)")

        def timer(fn: Callable[[], object]) -> float:
            if found is None and fn is ref_call:
                return host_time(fn)
            return dev.time_call(fn, l2_flush=settings.cuda.l2_flush)

        with dev.lock(settings.timing.lock_file).held() as waited:
            timed = time_interleaved(call, ref_call, settings.timing, before=lambda: self._poison(inst), timer=timer)
        self.clock.calls += timed.call_seconds
        timings = {"lock_wait_s": waited, "time_s": time.perf_counter() - t0 - waited}
        for k in ref_out:
            del self.buffers[f"_ref_{k}"]
            ref_out[k].free()
        with Failure.timed(timings):
            self._verify(inst)  # the last timed call's output must be right too
        fitness, metrics = timing_metrics(timed, task.work(case))
        metrics.update(reference_impl=impl, l2_flush=settings.cuda.l2_flush)
        return Measurement(fitness, metrics, timings)

    def confirm(self) -> None:
        with _on_the_gpu():
            self._check_case(self.task.full_case())

    def close(self) -> None:
        self._free()


class CudaBackend(Backend[CudaTask]):
    """CUDA kernels through nvcc and pycuda, one GPU per worker."""

    name = "cuda"
    program = CudaProgram
    check_columns = (
        Column("registers", "regs"), Column("smem_bytes", "smem B"), Column("spill_bytes", "spill B"),
        Column("threads_per_block", "threads"), Column("occupancy", "occupancy", percent=True),
        Column("occupancy_limited_by", "limited by", justify="left"),
    )  # fmt: skip

    def preflight(self, task: CudaTask, settings: EvalSettings, *, compile_only: bool = False) -> None:
        from runtime.toolchain.cuda_device import require_gpu

        try:
            nvcc_version(settings.cuda.nvcc)
            if not compile_only:
                require_gpu()
        except (NvccNotFound, CudaUnavailable) as exc:
            where = "compiles with nvcc" if compile_only else "runs on an NVIDIA GPU"
            raise BackendUnavailable(f"task {task.name!r} {where}, and this machine cannot: {exc}",
                                     compile_only=isinstance(exc, CudaUnavailable)) from None

    def worker_gpu(self, slot: int) -> str | None:
        """Slots take the visible GPUs in turn."""
        from runtime.toolchain.cuda_device import visible_gpus

        gpus = visible_gpus()
        return gpus[slot % len(gpus)] if gpus else None

    def prepare_worker(self, task: CudaTask) -> None:
        """Opens the GPU (context, driver libraries) and loads the reference library, then the task's paths."""
        from runtime.toolchain.cuda_reference import preload

        open_device()
        if task.gpu_reference:
            preload(task.gpu_reference)
        prime_kernel_task(task)

    def _device(self) -> Device:
        try:
            return open_device()
        except CudaUnavailable as exc:
            raise Failure(Status.INVALID, f"no usable GPU in the worker: {exc}") from None

    def hardware(self, task: CudaTask, ctx: WorkerContext) -> dict[str, Any] | None:
        """The worker's fingerprint with the GPU's own figures."""
        info = {k: v for k, v in (ctx.hardware or {}).items() if k != "id"}
        info.update(self._device().info())
        info["id"] = hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return info

    def compile(self, task: CudaTask, genome: Genome, settings: EvalSettings, ctx: WorkerContext) -> Build:
        """Render, nvcc, and the full case's launch checked against the target (``evaluation.cuda.arch``,
        else this worker's GPU); the build's metrics are ptxas' figures and the occupancy estimate."""
        arch = settings.cuda.arch or self._device().arch
        try:
            source = task.render(genome)
        except Exception as exc:  # noqa: BLE001 - a bad genome, not a worker bug
            raise Failure(Status.INVALID, f"cannot render the genome: {exc}") from None
        try:
            built = compile_cuda(source, settings=settings.cuda, arch=arch, kernel=task.kernel_name,
                                 extra_flags=task.compile_flags(), cache_dir=ctx.cache_dir,
                                 work_dir=ctx.work_dir)  # fmt: skip
        except CompileError as exc:
            raise Failure(Status.COMPILE_ERROR, exc.stderr) from None
        limits = arch_limits(arch)
        launch = launch_for(task, genome.params, task.full_case(), limits, built.info)
        smem = built.info.smem_bytes + launch.shared_bytes
        occ = occupancy(limits, launch.threads, built.info.registers, smem)
        metrics = {"compile_cached": built.cached, **built.info.metrics(), "threads_per_block": launch.threads,
                   "smem_bytes": smem, "occupancy": occ.occupancy, "occupancy_limited_by": occ.limited_by}  # fmt: skip
        return Build(genome, _Cubin(built, arch), built.seconds, metrics)

    def load(self, task: CudaTask, build: Build, settings: EvalSettings, ctx: WorkerContext) -> CudaProgram:
        dev = self._device()
        cubin: _Cubin = build.artifact
        try:
            kernel = dev.load(cubin.built.path, task.kernel_name)
        except CompileError as exc:
            raise Failure(Status.COMPILE_ERROR, exc.stderr) from None
        except Exception as exc:
            if not _is_driver_error(exc):  # e.g. a cubin built for another arch than this GPU's
                raise
            raise Failure(Status.COMPILE_ERROR, f"the driver cannot load the cubin ({cubin.arch}): "
                          f"{exc}") from None
        return CudaProgram(task, dev, kernel, build, settings)

"""The CUDA backend: a candidate is CUDA C++ compiled by nvcc to a cubin, launched in a host process of its
own (:mod:`runtime.sandbox.cuda_host`: its own CUDA context, out of reach of the worker's) on guarded device
buffers, and timed with CUDA events against the GPU reference (cuBLAS, torch) under this GPU's lock.

The same statuses and integrity rules as the C backend, on the GPU: every device buffer sits between guard
zones, outputs are poisoned (NaN) before each call, inputs must come back unchanged, and outputs are
compared on the host with the task's tolerances. A launch the genome makes impossible (too many
threads, too much shared memory) is ``invalid`` before anything runs.

The boundary: the reference runs in the worker's context on buffers of its own; the candidate's device
code runs only in its host's context, so neither the reference's buffers nor its results are mapped
where it runs. Every timed round fills fresh inputs on both sides from one seed drawn after the last
round (the same fill kernel, so the same values) and checks the candidate's output against the
reference's on elements chosen afterwards. A kernel that faults loses its host's context, not the
worker's: it ends ``crash`` and the worker goes on. The optional stages ``run`` and ``duel`` are not offered.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
    fresh_rng,
    timing_metrics,
    within_tolerance,
)
from runtime.cuda_task import CudaTask
from runtime.result import Status
from runtime.sandbox.host import HostDied
from runtime.settings import EvalSettings
from runtime.task import Case
from runtime.timing import TimingLock, time_interleaved
from runtime.toolchain.cc import CompileError
from runtime.toolchain.cuda_device import CudaUnavailable, Device, DeviceBuffer, host_time, open_device
from runtime.toolchain.cuda_launch import ArchLimits, Launch, LaunchError, arch_limits, occupancy, validate_launch
from runtime.toolchain.cuda_reference import gpu_reference
from runtime.toolchain.nvcc import CudaCompileResult, NvccNotFound, PtxasInfo, compile_cuda, nvcc_version

if TYPE_CHECKING:
    from runtime.sandbox.cuda_host import CudaHost, CudaHostLauncher, RemoteBuffer

__all__ = ["CudaBackend", "CudaProgram", "launch_for"]

_SAMPLED = 512  # elements of each output compared after every timed round


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


@contextlib.contextmanager
def _on_the_gpu() -> Iterator[None]:
    """The host's driver errors: a fault (the host's context is lost) or its death is ``crash``."""
    try:
        yield
    except HostDied as exc:
        raise Failure(Status.CRASH, f"{exc} (the kernel faulted, or its host did)") from None
    except RuntimeError as exc:
        if not str(exc).startswith("the candidate's GPU process"):
            raise
        raise Failure(Status.CRASH, f"the kernel faulted; its context is lost: {exc}") from None


class _WorkerFill:
    """The fill kernel in the worker's context, so the reference gets the very values the candidate got."""

    def __init__(self, ptx: bytes) -> None:
        import pycuda.driver as drv

        self.fn = drv.module_from_buffer(ptx).get_function("evoforge_fill")

    def __call__(self, buf: DeviceBuffer, kind: int, seed: int, mean: float, std: float) -> None:
        count = buf.nbytes // (4 if kind == 0 else 2)
        self.fn(np.uintp(buf.ptr), np.uint64(count), np.uint32(kind), np.uint32(seed & 0xFFFFFFFF),
                np.float32(mean), np.float32(std), grid=(1024, 1, 1), block=(256, 1, 1))  # fmt: skip


class CudaProgram(Program):
    """A cubin loaded in its host, and the buffers (in the host's context) of the case being checked or timed."""

    def __init__(self, task: CudaTask, dev: Device, host: CudaHost, build: Build, settings: EvalSettings,
                 fill: _WorkerFill, lock: TimingLock) -> None:  # fmt: skip
        self.task, self.dev, self.host, self.settings, self.fill = task, dev, host, settings, fill
        self.lock = lock  # this GPU's timing lock
        self.params = build.genome.params
        cubin: _Cubin = build.artifact
        self.limits, self.info = arch_limits(cubin.arch), cubin.built.info
        self.clock = CallClock()
        self.buffers: dict[str, RemoteBuffer] = {}
        self._mark = host.mark()
        self._full: tuple[Instance, int] | None = None

    @property
    def calls_s(self) -> float:  # type: ignore[override]
        return self.clock.calls

    def _free(self) -> None:
        self.buffers = {}
        self.host.release(self._mark)  # the staging memory; the device buffers go with the host

    def _check_case(self, case: Case, kind: str = "typical") -> tuple[Instance, int]:
        """Runs the kernel once on fresh inputs for ``case`` (of the value distribution ``kind``); raises
        :class:`Failure` if it broke a rule. Returns the instance and the bound launch."""
        self._free()
        task, host = self.task, self.host
        inst = Instance.fresh(task, case, kind=kind)
        for name in inst.outputs:
            exp = inst.expected[name]
            self.buffers[name] = host.buffer(exp.shape, exp.dtype, guard=GUARD_BYTES, sentinel=SENTINEL)
        for name, arr in inst.inputs.items():
            self.buffers[name] = host.buffer(arr.shape, arr.dtype, guard=GUARD_BYTES, sentinel=SENTINEL)
            self.buffers[name].upload(arr)
        inst.expect(task, self.clock)
        launch = launch_for(task, self.params, case, self.limits, self.info)
        handle = host.bind_launch(launch, task.kernel_args(case, self.buffers))
        self._poison(inst)
        self.clock.run(lambda: host.run(handle))
        self._verify(inst)
        return inst, handle

    def _poison(self, inst: Instance) -> None:
        for name in inst.outputs:
            self.buffers[name].poison()

    def _guards(self, case: Case) -> None:
        for name, buf in self.buffers.items():
            if not buf.guards_intact():
                raise Failure(Status.INVALID, f"wrote out of bounds of {name!r} (guard zone overwritten), case {case}")

    def _verify(self, inst: Instance) -> None:
        """Guard zones intact, inputs unchanged, outputs right (downloaded into ``inst.arrays``)."""
        self._guards(inst.case)
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

    def _time(self, inst: Instance, handle: int) -> Measurement:
        task, dev, host, settings, case = self.task, self.dev, self.host, self.settings, inst.case
        t0 = time.perf_counter()
        flush = settings.cuda.l2_flush
        # The reference's own buffers, in the worker's context: the candidate's host has no way to them.
        ref_in = {k: dev.buffer(a.shape, a.dtype, guard=0, sentinel=0) for k, a in inst.inputs.items()}
        ref_out = {k: dev.buffer(e.shape, e.dtype, guard=0, sentinel=0) for k, e in inst.expected.items()}
        found = gpu_reference(task.gpu_reference, case, ref_in, ref_out) if task.gpu_reference else None
        host_in = dict(inst.inputs)
        host_out = {k: np.empty_like(v) for k, v in inst.expected.items()}
        ref_call, impl = found or ((lambda: task.reference(case, host_in, host_out)), "numpy (host)")
        fills = task.device_fill(case, inst.inputs)
        _, rng = fresh_rng()

        def call() -> None:
            host.run(handle)

        def fresh_inputs() -> None:
            """New values for the round, the same on both sides, from a seed drawn now."""
            if fills is not None:
                for name, (kind, mean, std) in fills.items():
                    seed = int(rng.integers(1, 1 << 32))
                    self.buffers[name].fill(kind, seed, mean, std)
                    self.fill(ref_in[name], kind, seed, mean, std)
                if found is None:
                    host_in.update({k: b.download() for k, b in ref_in.items()})
            else:
                drawn = task.inputs(case, rng)
                for name, arr in drawn.items():
                    self.buffers[name].upload(arr)
                    ref_in[name].upload(arr)
                host_in.update(drawn)

        def check_round() -> None:
            self._guards(case)
            for name, buf in ref_in.items():
                if not np.array_equal(self.buffers[name].download().view(np.uint8), buf.download().view(np.uint8)):
                    raise Failure(Status.INVALID, f"modified its inputs ({name!r}) on a timed call, case {case}")
            rtol, atol = task.tolerance(case)
            for name in inst.outputs:
                got = self.buffers[name].download().reshape(-1)
                exp = (ref_out[name].download() if found else host_out[name]).reshape(-1)
                if np.issubdtype(got.dtype, np.floating) and np.isnan(got).any() and not np.isnan(exp).any():
                    raise Failure(Status.WRONG, f"left output {name!r} unwritten on a timed call, case {case}")
                idx = rng.integers(0, got.size, _SAMPLED) if got.size else np.zeros(0, np.int64)
                g, e = got[idx], exp[idx]
                rms = float(np.sqrt(np.mean(np.square(e[np.isfinite(e)], dtype=np.float64)))) if e.size else 0.0
                bad = ~within_tolerance(g, e, rtol, atol, np.maximum(np.abs(e.astype(np.float64)), rms))
                if bad.any():
                    i = int(np.argmax(bad))
                    raise Failure(Status.WRONG, f"wrong output {name!r} on a timed call with fresh inputs, at flat "
                                  f"index {int(idx[i])}: expected {e[i].item()!r}, got {g[i].item()!r}; case {case}")

        def timer(fn: Callable[[], object]) -> float:
            if fn is call:
                return host.time_launch(handle, l2_flush=flush)
            if found is None:
                return host_time(fn)
            return dev.time_call(fn, l2_flush=flush)

        fresh_inputs()
        try:
            with self.lock.held() as waited:
                timed = time_interleaved(call, ref_call, settings.timing, before=lambda: self._poison(inst),
                                         timer=timer, round_start=fresh_inputs, round_end=check_round)  # fmt: skip
        finally:
            for b in (*ref_in.values(), *ref_out.values()):
                b.free()
        self.clock.calls += timed.call_seconds
        timings = {"lock_wait_s": waited, "time_s": time.perf_counter() - t0 - waited}
        fitness, metrics = timing_metrics(timed, task.work(case))
        metrics.update(reference_impl=impl, l2_flush=flush, fresh_inputs="device fill" if fills else "host")
        return Measurement(fitness, metrics, timings)

    def confirm(self) -> None:
        with _on_the_gpu():
            self._check_case(self.task.full_case())

    def close(self) -> None:
        self.host.close()


class CudaBackend(Backend[CudaTask]):
    """CUDA kernels through nvcc and pycuda, one GPU per worker."""

    name = "cuda"
    per_gpu = True
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

    def __init__(self) -> None:
        self._launcher: CudaHostLauncher | None = None
        self._fill: _WorkerFill | None = None

    def prepare_worker(self, task: CudaTask, lock: TimingLock) -> None:
        """Opens the GPU (context, driver libraries) and its timing lock beside the worker's (the lock file's
        folder may be closed to the worker once it dropped privileges), loads the reference library, then
        the task's paths."""
        from runtime.toolchain.cuda_reference import preload

        open_device().lock(lock.path)
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

    def _hosts(self, settings: EvalSettings, ctx: WorkerContext) -> tuple[CudaHostLauncher, _WorkerFill]:
        """What starts candidate hosts (built into the cache on first use), and the worker's fill kernel."""
        if self._launcher is None or self._fill is None:
            from runtime.sandbox.cuda_host import CudaHostLauncher

            try:
                self._launcher = CudaHostLauncher(ctx.cc, settings.cuda.nvcc, ctx.cache_dir, ctx.work_dir)
            except (CompileError, FileNotFoundError) as exc:
                raise Failure(Status.INVALID, f"the CUDA candidate host does not build here: {exc}") from None
            self._fill = _WorkerFill(self._launcher.ptx)
        return self._launcher, self._fill

    def load(self, task: CudaTask, build: Build, settings: EvalSettings, ctx: WorkerContext) -> CudaProgram:
        """The cubin in a host of its own (a fresh process and context)."""
        dev = self._device()
        launcher, fill = self._hosts(settings, ctx)
        cubin: _Cubin = build.artifact
        try:
            host = launcher.host(cubin.built.path, task.kernel_name, cpu_seconds=settings.sandbox.cpu_seconds)
        except CompileError as exc:  # the driver cannot load it (another arch), or no such kernel
            raise Failure(Status.COMPILE_ERROR, f"{exc.stderr} ({cubin.arch})") from None
        except HostDied as exc:
            raise Failure(Status.CRASH, f"{exc} while its cubin was loaded") from None
        assert ctx.lock is not None, "candidates run in a worker, which holds the timing lock"
        return CudaProgram(task, dev, host, build, settings, fill, dev.lock(ctx.lock.path))

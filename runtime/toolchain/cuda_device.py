"""The CUDA device side, through pycuda: one context per worker process, guarded device
buffers, cubin loading and launches, CUDA-event timing (optional L2 flush), one timing lock per GPU.

pycuda is imported lazily (it is the optional extra ``cuda``); :func:`probe` asks the driver through
ctypes, so the controller can say why there is no GPU without importing pycuda at all.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.timing import TimingLock
from runtime.toolchain.cc import CompileError
from runtime.toolchain.cuda_launch import Launch

__all__ = [
    "CudaUnavailable",
    "Device",
    "DeviceBuffer",
    "GpuInfo",
    "open_device",
    "probe",
    "require_gpu",
    "visible_gpus",
]

class CudaUnavailable(RuntimeError):
    """No usable GPU here: no driver, no device, or no pycuda. The message says which, and the fix."""


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    arch: str  # sm_XY
    memory_bytes: int
    pci_bus_id: str


def probe() -> list[GpuInfo]:
    """The GPUs the driver sees, asked through ``libcuda`` with ctypes (no pycuda, no context)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise CudaUnavailable("no NVIDIA driver on this machine (libcuda.so.1 not found)") from None
    rc = cuda.cuInit(0)
    if rc != 0:
        raise CudaUnavailable(f"the CUDA driver failed to initialise (cuInit error {rc}; is a GPU present?)")
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        raise CudaUnavailable("the CUDA driver sees no GPU (check CUDA_VISIBLE_DEVICES and nvidia-smi)")
    gpus = []
    for i in range(count.value):
        dev, name, bus = ctypes.c_int(), ctypes.create_string_buffer(256), ctypes.create_string_buffer(32)
        major, minor, mem = ctypes.c_int(), ctypes.c_int(), ctypes.c_size_t()
        cuda.cuDeviceGet(ctypes.byref(dev), i)
        cuda.cuDeviceGetName(name, 256, dev)
        cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
        cuda.cuDeviceTotalMem_v2(ctypes.byref(mem), dev)
        cuda.cuDeviceGetPCIBusId(bus, 32, dev)
        gpus.append(GpuInfo(i, name.value.decode(), f"sm_{major.value}{minor.value}", mem.value, bus.value.decode()))
    return gpus


def require_gpu() -> list[GpuInfo]:
    """The GPUs, once pycuda imports too; otherwise :class:`CudaUnavailable` naming the missing piece."""
    gpus = probe()
    try:
        import pycuda.driver  # noqa: F401
    except ImportError as exc:
        raise CudaUnavailable(
            f"pycuda is not installed ({exc}): pip install 'evoforge[cuda]' (offline: bench/gpu_check.sh)"
        ) from None
    return gpus


def visible_gpus() -> list[str]:
    """GPU ids to pin workers to (``CUDA_VISIBLE_DEVICES`` entries, else one per GPU the driver lists)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    return [str(i) for i in range(len(glob.glob("/proc/driver/nvidia/gpus/*")))]


def _drv() -> Any:
    import pycuda.driver as drv

    return drv


class DeviceBuffer:
    """A device allocation between two sentinel guard zones, like the host's ``guarded_empty``."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, *, guard: int, sentinel: int) -> None:
        drv = _drv()
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.guard, self.sentinel = guard, sentinel
        self._raw = drv.mem_alloc(self.nbytes + 2 * guard)
        drv.memset_d8(self._raw, sentinel, self.nbytes + 2 * guard)
        self.ptr = int(self._raw) + guard  # guard is a multiple of 256: vector loads stay aligned

    def upload(self, host: np.ndarray) -> None:
        _drv().memcpy_htod(self.ptr, np.ascontiguousarray(host, dtype=self.dtype))

    def download(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        if self.nbytes:
            _drv().memcpy_dtoh(out, self.ptr)
        return out

    def guards_intact(self) -> bool:
        drv, zone = _drv(), np.empty(self.guard, np.uint8)
        for start in (int(self._raw), self.ptr + self.nbytes):
            drv.memcpy_dtoh(zone, start)
            if not (zone == self.sentinel).all():
                return False
        return True

    def poison(self) -> None:
        """NaN for floats (all-ones bytes are NaN in every float format), 0x5A bytes otherwise."""
        byte = 0xFF if np.issubdtype(self.dtype, np.floating) else 0x5A
        if self.nbytes:
            _drv().memset_d8(self.ptr, byte, self.nbytes)

    def free(self) -> None:
        self._raw.free()


class Kernel:
    """A kernel function loaded from a cubin; :meth:`bind` fixes a launch and its arguments."""

    def __init__(self, path: str, name: str) -> None:
        drv = _drv()
        with open(path, "rb") as f:
            self.module = drv.module_from_buffer(f.read())
        try:
            self.fn = self.module.get_function(name)
        except drv.LogicError:
            raise CompileError(f'the cubin defines no kernel {name!r} (declare it extern "C")') from None
        attr = drv.function_attribute
        self.registers = int(self.fn.get_attribute(attr.NUM_REGS))
        self.static_smem = int(self.fn.get_attribute(attr.SHARED_SIZE_BYTES))

    def bind(self, launch: Launch, args: Sequence[Any]) -> Callable[[], None]:
        """A zero-argument callable launching the kernel asynchronously on the default stream."""
        fmt, values = "", []
        for a in args:
            if isinstance(a, DeviceBuffer):
                fmt, v = fmt + "P", np.uintp(a.ptr)
            elif isinstance(a, (bool, int, np.integer)):
                fmt, v = fmt + "i", np.int32(a)
            elif isinstance(a, (float, np.floating)):
                fmt, v = fmt + "f", np.float32(a)
            else:
                raise TypeError(f"unsupported kernel argument type {type(a).__name__}")
            values.append(v)
        if launch.shared_bytes > 48 * 1024:  # dynamic shared memory above 48 KiB is opt-in per function
            self.fn.set_attribute(_drv().function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, launch.shared_bytes)
        self.fn.prepare(fmt)
        fn, grid, block, smem = self.fn, launch.grid, launch.block, launch.shared_bytes

        def call() -> None:
            fn.prepared_call(grid, block, *values, shared_size=smem)

        return call


class Device:
    """This process's GPU (device 0 of what ``CUDA_VISIBLE_DEVICES`` shows) and its primary context.

    The primary context is the one the runtime API uses, so cuBLAS, torch and cupy share it.
    """

    def __init__(self) -> None:
        drv = _drv()
        drv.init()
        self.dev = drv.Device(0)
        self.context = self.dev.retain_primary_context()
        self.context.push()
        # pycuda aborts the interpreter at exit if a context is still pushed (a controller that asked the GPU).
        atexit.register(self._pop)
        major, minor = self.dev.compute_capability()
        self.arch = f"sm_{major}{minor}"
        self.name = self.dev.name()
        self.pci_bus_id = self.dev.pci_bus_id()
        self.l2_bytes = int(self.dev.get_attribute(drv.device_attribute.L2_CACHE_SIZE))
        self._locks: dict[str, TimingLock] = {}
        self._flush: DeviceBuffer | None = None
        self._events = (drv.Event(), drv.Event())

    def _pop(self) -> None:
        with contextlib.suppress(Exception):  # the driver may be gone already
            _drv().Context.pop()

    def info(self) -> dict[str, Any]:
        return {
            "gpu": self.name,
            "gpu_arch": self.arch,
            "gpu_pci_bus_id": self.pci_bus_id,
            "cuda_driver": _drv().get_driver_version(),
        }

    def lock(self, lock_file: str) -> TimingLock:
        """The machine-wide timing lock of this GPU: ``<lock_file>.gpu-<PCI bus id>``."""
        if lock_file not in self._locks:
            self._locks[lock_file] = TimingLock(f"{lock_file}.gpu-{re.sub(r'[^0-9A-Za-z]', '_', self.pci_bus_id)}")
        return self._locks[lock_file]

    def buffer(self, shape: tuple[int, ...], dtype: Any, *, guard: int, sentinel: int) -> DeviceBuffer:
        return DeviceBuffer(shape, dtype, guard=guard, sentinel=sentinel)

    def load(self, path: str, name: str) -> Kernel:
        return Kernel(path, name)

    def synchronize(self) -> None:
        _drv().Context.synchronize()

    def flush_l2(self) -> None:
        """Overwrites twice the L2's size, so the next call starts from cold caches."""
        if self._flush is None:
            self._flush = DeviceBuffer((2 * max(self.l2_bytes, 1 << 20),), np.uint8, guard=0, sentinel=0)
        _drv().memset_d8(self._flush.ptr, 0x3C, self._flush.nbytes)

    def time_call(self, fn: Callable[[], object], *, l2_flush: bool = False) -> float:
        """Seconds ``fn``'s GPU work took, between two CUDA events on the default stream."""
        if l2_flush:
            self.flush_l2()
        start, end = self._events
        start.record()
        fn()
        end.record()
        end.synchronize()
        return end.time_since(start) * 1e-3


def host_time(fn: Callable[[], object]) -> float:
    """Seconds of a host-side call (the reference when no GPU library is present)."""
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) * 1e-9


_DEVICE: Device | None = None


def open_device() -> Device:
    """This process's :class:`Device`, opened on first use (a worker does it before the privilege drop)."""
    global _DEVICE
    if _DEVICE is None:
        try:
            _drv()
        except ImportError as exc:
            raise CudaUnavailable(f"pycuda is not installed ({exc}): pip install 'evoforge[cuda]'") from None
        try:
            _DEVICE = Device()
        except Exception as exc:  # noqa: BLE001 - pycuda's errors are its own types
            raise CudaUnavailable(f"cannot open the GPU: {exc}") from None
    return _DEVICE

"""GPU references timed beside CUDA candidates, so ``vs_reference`` means "vs the vendor library".

``gemm``: cuBLAS (``cublasGemmEx``, fp32 compute, no TF32) through ctypes from the CUDA toolkit, else
torch (fp32 only), else cupy (fp32 only). ``softmax``: torch. Each runs on the worker's primary
context and the default stream, so the same CUDA events time it. Where none is present the cascade
times the task's host reference instead and says so in ``metrics.reference_impl``.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from collections.abc import Callable, Mapping
from typing import Any

from runtime.toolchain.cuda_device import DeviceBuffer

__all__ = ["GpuReference", "gpu_reference", "preload"]

GpuReference = tuple[Callable[[], None], str]
"""A zero-argument callable doing the reference's GPU work, and its name (``cublas``, ``torch``, ...)."""

_CUDA_R = {"float32": 0, "float16": 2, "uint16": 14}  # cudaDataType: R_32F, R_16F, R_16BF (bf16 is uint16 here)
_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F: plain fp32, never TF32
_GEMM_DEFAULT = -1


@functools.cache
def _cublas() -> tuple[ctypes.CDLL, ctypes.c_void_p] | None:
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    names = ["libcublas.so", *sorted(glob.glob("/usr/local/cuda*/lib64/libcublas.so*"), reverse=True)]
    names += [os.path.join(r, "lib64", "libcublas.so") for r in roots if r]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        handle = ctypes.c_void_p()
        if lib.cublasCreate_v2(ctypes.byref(handle)) == 0:
            return lib, handle
    return None


def _torch() -> Any | None:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def preload(op: str) -> None:
    """Loads the library ``op`` will use (in a worker, before it drops privileges)."""
    if op == "gemm" and _cublas() is None or op == "softmax":
        _torch()


class _CudaArray:
    """Exposes a device buffer through ``__cuda_array_interface__`` (for torch and cupy)."""

    def __init__(self, buf: DeviceBuffer, typestr: str | None = None) -> None:
        self.__cuda_array_interface__ = {
            "shape": buf.shape, "typestr": typestr or buf.dtype.str, "data": (buf.ptr, False), "version": 3,
            "strides": None, "stream": 1,
        }  # fmt: skip


def _gemm(case: Mapping[str, int], a: DeviceBuffer, b: DeviceBuffer, c: DeviceBuffer) -> GpuReference | None:
    m, n, k = case["m"], case["n"], case["k"]
    found = _cublas()
    if found is not None and a.dtype.name in _CUDA_R:
        lib, handle = found
        t_in = _CUDA_R[a.dtype.name]
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        # Row-major C = A B is column-major C^T = B^T A^T: pass B first, with the dims swapped.
        argv = (handle, 0, 0, n, m, k, ctypes.byref(alpha), ctypes.c_void_p(b.ptr), t_in, n,
                ctypes.c_void_p(a.ptr), t_in, k, ctypes.byref(beta), ctypes.c_void_p(c.ptr), 0, n,
                _COMPUTE_32F, _GEMM_DEFAULT)  # fmt: skip

        def cublas() -> None:
            rc = lib.cublasGemmEx(*argv)
            if rc != 0:
                raise RuntimeError(f"cublasGemmEx failed with status {rc}")

        return cublas, "cublas"
    if a.dtype.name != "float32":
        return None
    torch = _torch()
    if torch is not None:
        ta, tb, tc = (torch.as_tensor(_CudaArray(x), device="cuda") for x in (a, b, c))
        return (lambda: torch.matmul(ta, tb, out=tc)), "torch"
    try:
        import cupy
    except ImportError:
        return None
    ca, cb, cc = (cupy.asarray(_CudaArray(x)) for x in (a, b, c))
    return (lambda: cupy.matmul(ca, cb, out=cc)), "cupy"


def _softmax(x: DeviceBuffer, y: DeviceBuffer) -> GpuReference | None:
    torch = _torch()
    if torch is None:
        return None
    tx, ty = (torch.as_tensor(_CudaArray(b), device="cuda") for b in (x, y))
    # torch.softmax's own kernel, writing into y: every timed round checks the candidate against what is there.
    return (lambda: torch.ops.aten._softmax.out(tx, -1, False, out=ty)), "torch"


def gpu_reference(
    op: str, case: Mapping[str, int], inputs: Mapping[str, DeviceBuffer], outputs: Mapping[str, DeviceBuffer]
) -> GpuReference | None:
    """The GPU reference for ``op`` writing into ``outputs``, or ``None`` when no library provides it."""
    ins, outs = list(inputs.values()), list(outputs.values())
    if op == "gemm" and len(ins) == 2 and len(outs) == 1:
        return _gemm(case, ins[0], ins[1], outs[0])
    if op == "softmax" and len(ins) == 1 and len(outs) == 1:
        return _softmax(ins[0], outs[0])
    return None

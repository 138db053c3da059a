"""Helpers of the CUDA tests: what this machine has (nvcc, a GPU), captured ptxas reports."""

from __future__ import annotations

import functools
import os

import pytest

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def ptxas_report(name: str) -> str:
    """A real ``nvcc -Xptxas -v`` output captured with CUDA 13.0 (see data/)."""
    with open(os.path.join(DATA, name)) as f:
        return f.read()


@functools.cache
def nvcc_missing() -> str | None:
    """Why nvcc cannot run here, or None."""
    from runtime.toolchain.nvcc import NvccNotFound, nvcc_version

    try:
        nvcc_version("nvcc")
    except NvccNotFound as exc:
        return str(exc)
    return None


@functools.cache
def gpu_missing() -> str | None:
    """Why no GPU test can run here (no driver, no GPU, no pycuda, no nvcc), or None."""
    from runtime.toolchain.cuda_device import CudaUnavailable, require_gpu

    try:
        require_gpu()
    except CudaUnavailable as exc:
        return str(exc)
    return nvcc_missing()


needs_nvcc = pytest.mark.skipif(nvcc_missing() is not None, reason=f"needs nvcc: {nvcc_missing()}")
needs_gpu = pytest.mark.skipif(gpu_missing() is not None, reason=f"needs a GPU with pycuda: {gpu_missing()}")

"""``CudaTask``: the base of tasks whose candidates are CUDA kernels (evaluated by :mod:`runtime.backends.cuda`).

A CUDA task is a :class:`runtime.task.KernelTask` whose template is CUDA C++ with an ``extern "C"`` kernel,
plus a :meth:`CudaTask.launch` that derives the launch configuration from a genome's params. Inputs,
outputs, the reference, tolerances and work are host-side numpy, exactly as for a C task: the runtime
copies arrays to the GPU (between guard zones), runs the kernel, copies back and compares on the host.
``kernel_args`` returns device buffers where the C task returns arrays.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Mapping
from importlib import resources
from typing import Any, ClassVar

import numpy as np

from runtime.task import Case, Descriptor, KernelTask
from runtime.toolchain.cuda_launch import Launch, LaunchError

__all__ = ["CudaTask", "Launch", "LaunchError", "load_cuda_source", "need"]


@functools.cache
def load_cuda_source(name: str) -> str:
    """The text of ``runtime/tasks/cuda/<name>`` (package data)."""
    return resources.files("runtime.tasks").joinpath("cuda", name).read_text(encoding="utf-8")


def need(params: Mapping[str, Any], *names: str) -> list[int]:
    """The int values of ``names`` in ``params``; a missing or non-positive one is a :class:`LaunchError`."""
    values = []
    for name in names:
        v = params.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise LaunchError(f"the launch needs a positive int param {name!r} (got {v!r})")
        values.append(v)
    return values


class CudaTask(KernelTask):
    """Base class of CUDA tasks: subclasses implement :meth:`launch` on top of the :class:`Task` methods."""

    backend: ClassVar[str] = "cuda"
    gpu_reference: ClassVar[str] = ""
    """The GPU library operation timed as the reference (``gemm``, ``softmax``; see
    ``runtime.toolchain.cuda_reference``); empty: the host ``reference`` is timed instead."""

    @abc.abstractmethod
    def launch(self, params: Mapping[str, Any], case: Case) -> Launch:
        """Grid, block and dynamic shared memory for ``case``; raises :class:`LaunchError` on bad params."""

    def device_fill(self, case: Case, inputs: Mapping[str, np.ndarray]) -> dict[str, tuple[int, float, float]] | None:
        """How timed rounds draw fresh inputs on the GPU: input -> (fill kind, mean, std), here the mean and
        spread of ``inputs`` (the typical ones) for fp32 and fp16 inputs (kinds in
        :data:`runtime.sandbox.cuda_host.FILL_KINDS`). ``None`` (any other dtype): :meth:`inputs` draws them on the
        host each round instead, slower. Override for inputs held in another dtype (bf16 as uint16)."""
        from runtime.sandbox.cuda_host import FILL_KINDS

        out = {}
        for name, arr in inputs.items():
            kind = FILL_KINDS.get(arr.dtype.name)
            if kind is None:
                return None
            x = arr.astype(np.float64)
            out[name] = (kind, float(x.mean()), float(x.std()))
        return out

    def descriptors(self) -> dict[str, Descriptor]:
        """ptxas' and the occupancy estimate's figures (in every ok result's metrics) as descriptors."""

        def metric(name: str, scale: float = 1.0) -> Any:
            return lambda g, m: float(m.get(name) or 0) * scale

        return {
            **super().descriptors(),
            "registers": Descriptor("registers", "registers per thread (ptxas)", metric("registers"), 0.0, 256.0),
            "occupancy": Descriptor(
                "occupancy", "estimated resident warps over the SM's maximum", metric("occupancy"), 0.0, 1.0
            ),
            "smem_kib": Descriptor(
                "smem_kib", "shared memory per block, static + dynamic, KiB", metric("smem_bytes", 1 / 1024), 0.0, 228.0
            ),
            "spill_bytes": Descriptor(
                "spill_bytes", "register spill stores + loads (ptxas)", metric("spill_bytes"), 0.0, 1024.0
            ),
            "threads_per_block": Descriptor(
                "threads_per_block", "threads per block of the timed launch", metric("threads_per_block"), 0.0, 1024.0
            ),
        }

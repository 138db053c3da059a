"""Backends: one module per kind of candidate, all behind one protocol (:mod:`runtime.backends.base`).

| backend | module | candidates |
| --- | --- | --- |
| ``c`` | :mod:`runtime.backends.c` | C kernels: cc, ctypes, guarded numpy buffers, timed vs the numpy reference |
| ``cuda`` | :mod:`runtime.backends.cuda` | CUDA kernels: nvcc, pycuda, guarded device buffers, timed vs cuBLAS |
| ``engine`` | :mod:`runtime.backends.engine` | engine configurations, measured under closed-loop load |
| ``chat_engine`` | :mod:`runtime.backends.chat_engine` | chat engines, served and measured under streaming load |

A task names its backend (``Task.backend``); :func:`backend_for` is the one place that name is read.
Modules are imported on first use, so a C run never imports pycuda or the engine. To add a backend,
write one module with a :class:`Backend` subclass (copy :mod:`runtime.backends.c`) and add it to
:data:`BACKENDS`, or let a task name it directly as ``module:Class``.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

from runtime.backends.base import (
    STAGES,
    Backend,
    BackendUnavailable,
    Build,
    Column,
    Duels,
    Failure,
    Measurement,
    Profiles,
    Program,
    RivalFailure,
    RunsGivenInputs,
    Stage,
    UnsupportedStage,
    WorkerContext,
)

if TYPE_CHECKING:
    from runtime.task import Task

__all__ = [
    "BACKENDS",
    "STAGES",
    "Backend",
    "BackendUnavailable",
    "Build",
    "Column",
    "Duels",
    "Failure",
    "Measurement",
    "Profiles",
    "Program",
    "RivalFailure",
    "RunsGivenInputs",
    "Stage",
    "UnsupportedStage",
    "WorkerContext",
    "backend_for",
    "is_backend_ref",
]

BACKENDS: dict[str, str] = {
    "c": "runtime.backends.c:CBackend",
    "cuda": "runtime.backends.cuda:CudaBackend",
    "engine": "runtime.backends.engine:EngineBackend",
    "chat_engine": "runtime.backends.chat_engine:ChatEngineBackend",
}


def is_backend_ref(ref: str) -> bool:
    """Whether ``ref`` names a backend: a registered name, or ``module:Class`` (checked when first used)."""
    return ref in BACKENDS or ":" in ref


def backend_for(task: Task | type[Task]) -> Backend:
    """The backend that evaluates ``task`` (an instance or a class): one instance per process."""
    return _backend(task.backend)


@functools.cache
def _backend(ref: str) -> Backend:
    target = BACKENDS.get(ref, ref)
    module_name, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"unknown backend {ref!r}: use one of {', '.join(sorted(BACKENDS))} or 'module:Class'")
    cls = getattr(importlib.import_module(module_name), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ValueError(f"{target!r} is not a subclass of runtime.backends.Backend")
    return cls()

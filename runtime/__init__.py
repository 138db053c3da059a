"""How a candidate is *run*: tasks, backends, the sandboxed worker pool, the evaluation cascade, timing.

- :mod:`runtime.task`: :class:`Task` (what every task has) and :class:`KernelTask` (what kernel tasks add).
- :mod:`runtime.backends`: one protocol, one module per kind of candidate (C, CUDA, engine), a registry.
- :mod:`runtime.cascade`: the one skeleton every evaluation runs through, inside a sandboxed worker.
- :mod:`runtime.executors`: where evaluations run, behind one protocol (:class:`Executor`): the local workers
  (:class:`LocalPool`) or a Ray cluster; :mod:`runtime.sandbox`: the trust boundary (the workers' processes
  and limits, the candidates' host processes, the system-call filters).
- :mod:`runtime.timing`: the one timing harness; :mod:`runtime.toolchain`: compilers and loaders.
- :mod:`runtime.engine`: the embedded inference engine; :mod:`runtime.tasks`: the built-in kernel tasks.
"""

from runtime import isa

try:  # before numpy and the BLAS load: a run under EVOFORGE_CPU_ISA caps them, and its workers inherit it
    isa.cap_libraries()
except isa.IsaError:
    pass  # said in one line by the command that runs (evo's entry point checks the level)

from runtime.backends import Backend, BackendUnavailable, UnsupportedStage, backend_for
from runtime.executors import EvalRequest, Executor, LocalPool
from runtime.hardware import fingerprint
from runtime.result import EvalResult, Status, TimingStats
from runtime.settings import CompilerSettings, EvalSettings, SandboxSettings, TaskSpec, TimingSettings
from runtime.task import (
    BUILTIN_TASKS,
    Case,
    Descriptor,
    KernelTask,
    Task,
    TaskArgs,
    TaskLoadError,
    load_task_class,
)
from runtime.toolchain import CompileError, CompilerNotFound

__all__ = [
    "BUILTIN_TASKS",
    "Backend",
    "BackendUnavailable",
    "Case",
    "CompileError",
    "CompilerNotFound",
    "CompilerSettings",
    "Descriptor",
    "EvalRequest",
    "EvalResult",
    "EvalSettings",
    "Executor",
    "KernelTask",
    "LocalPool",
    "SandboxSettings",
    "Status",
    "Task",
    "TaskArgs",
    "TaskLoadError",
    "TaskSpec",
    "TimingSettings",
    "TimingStats",
    "UnsupportedStage",
    "backend_for",
    "fingerprint",
    "load_task_class",
]

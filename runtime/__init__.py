"""How a candidate is *run*: tasks, the C backend, the sandboxed worker pool, the cascade, timing."""

from runtime.backends import CompileError, CompilerNotFound
from runtime.executor import EvalRequest, Executor
from runtime.hardware import fingerprint
from runtime.pool import LocalPool
from runtime.result import EvalResult, Status, TimingStats
from runtime.settings import CompilerSettings, EvalSettings, SandboxSettings, TaskSpec, TimingSettings
from runtime.task import BUILTIN_TASKS, Case, Descriptor, Task, TaskArgs, TaskLoadError, load_task_class

__all__ = [
    "BUILTIN_TASKS",
    "Case",
    "CompileError",
    "CompilerNotFound",
    "CompilerSettings",
    "Descriptor",
    "EvalRequest",
    "EvalResult",
    "EvalSettings",
    "Executor",
    "LocalPool",
    "SandboxSettings",
    "Status",
    "Task",
    "TaskArgs",
    "TaskLoadError",
    "TaskSpec",
    "TimingSettings",
    "TimingStats",
    "fingerprint",
    "load_task_class",
]

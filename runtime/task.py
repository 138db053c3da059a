"""The task interface: what a candidate is, how it may vary, and how it is checked and measured.

A task is a Python class. Built-in tasks are named (``matmul``, ``engine``); a user's task is referenced
as ``module:Class``. The runtime calls a task's methods inside sandboxed workers, the search calls them
in the controller, so a task must be importable from both (the run's config directory is put on
``sys.path`` for that).

Two levels:

- :class:`Task`: what every task has (name, unit, arguments, parameter space, seeds, how a genome is
  shown, descriptors) and the name of the backend that evaluates it (:mod:`runtime.backends`).
- :class:`KernelTask`: what kernel tasks add: a source template, problem cases, inputs and outputs, a
  reference implementation, tolerances, the kernel's arguments and a work measure. A user's C kernel
  task subclasses this (a CUDA one subclasses :class:`runtime.cuda_task.CudaTask`).
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from genome import Genome, ParamSpace, render_source
from runtime.backends import BACKENDS, is_backend_ref

__all__ = [
    "BUILTIN_TASKS", "VALUE_KINDS", "Case", "Descriptor", "KernelTask", "Task", "TaskArgs", "TaskLoadError",
    "load_task_class",
]  # fmt: skip

Case = dict[str, int]
"""The sizes of one problem instance, e.g. ``{"m": 1024, "n": 1024, "k": 1024}``."""


class TaskArgs(BaseModel):
    """Arguments every task accepts; a task extends this with its own (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    threads: int = Field(1, ge=1, description="threads the kernel and the reference may use")


@dataclass(frozen=True)
class Descriptor:
    """A behaviour descriptor a task offers to the archive: a number computed from a genome and its metrics."""

    name: str
    doc: str
    fn: Callable[[Genome, Mapping[str, Any]], float]
    low: float  # a suggested range for a grid archive; a config may override it
    high: float


class Task(abc.ABC):
    """Base class of every task: subclasses set the class attributes and implement :meth:`space`,
    :meth:`seeds` and :meth:`render`. How a candidate is evaluated is the backend's business."""

    name: ClassVar[str]
    """Short name, used in run summaries and the memory of discoveries."""
    unit: ClassVar[str]
    """Unit of the fitness (higher is better), e.g. ``GFLOP/s`` or ``sentences/s``."""
    description: ClassVar[str] = ""
    signature: ClassVar[str]
    """What every candidate must provide, e.g. the C prototype ``void kernel(int n, const float *x, float *y)``."""
    backend: ClassVar[str]
    """The backend that evaluates this task's candidates: a name from :data:`runtime.backends.BACKENDS`
    (``c``, ``cuda``, ``engine``) or ``module:Class`` of a :class:`runtime.backends.Backend`."""
    Args: ClassVar[type[TaskArgs]] = TaskArgs

    def __init__(self, args: Mapping[str, Any] | None = None) -> None:
        self.args = self.Args.model_validate(dict(args or {}))

    @classmethod
    def resolve_args(cls, args: Mapping[str, Any], cwd: str) -> dict[str, Any]:
        """``args`` as a run stores them: file paths made absolute against ``cwd`` (workers run in their own
        directories). The default task takes none: ``args`` unchanged. A task that reads other runs reads
        them in :meth:`runtime.followed_runs.FollowsRuns.read_runs`."""
        return dict(args)

    # --- what may vary --------------------------------------------------------------------------

    @abc.abstractmethod
    def space(self) -> ParamSpace:
        """The parameter space of the genome."""

    @abc.abstractmethod
    def seeds(self) -> list[Genome]:
        """Starting genomes, e.g. a naive kernel (a code genome) and a known-good template point."""

    @abc.abstractmethod
    def render(self, genome: Genome) -> str:
        """What ``genome`` is, as text: the source a backend builds, and what ``evo archive show`` and
        ``export`` print. Raises (any exception) for a genome the task cannot render."""

    def descriptors(self) -> dict[str, Descriptor]:
        """Descriptors this task offers; the config picks which ones span the archive."""
        return {
            "source_lines": Descriptor(
                "source_lines",
                "lines of the rendered source (how much code the candidate is)",
                lambda g, m: float(self.render(g).count("\n") + 1),
                0.0,
                400.0,
            ),
        }

    def ceiling(self, fma_gflops: float) -> float | None:
        """The highest fitness the machine can physically reach, given one core's measured fp32 FMA peak in
        GFLOP/s (:mod:`runtime.peak`): a fitness above it (with a margin for the core's clock) is ``invalid``,
        forged whatever the path. ``None`` (the default): no bound is known."""
        return None


class KernelTask(Task):
    """Base class of kernel tasks: a parametric source, checked against a reference on fresh inputs and
    timed side by side with it. Candidates are C kernels (backend ``c``) unless a subclass says otherwise.

    A task whose elites the engine may call is a :class:`runtime.slots.SlotTask`."""

    kernel_name: ClassVar[str] = "kernel"
    backend: ClassVar[str] = "c"
    # --- what may vary --------------------------------------------------------------------------

    @abc.abstractmethod
    def template(self) -> str:
        """C source of the parametric kernel; parameters arrive as ``#define``s (see genome.render_defines)."""

    def compile_flags(self) -> list[str]:
        """Flags this task adds to the configured ones (e.g. ``-fopenmp`` when ``threads > 1``)."""
        return []

    def render(self, genome: Genome) -> str:
        """The source to compile for ``genome``: its own source, or else the template, with params defined."""
        return render_source(genome.params, genome.source if genome.source is not None else self.template())

    # --- how it is checked ----------------------------------------------------------------------

    @abc.abstractmethod
    def full_case(self) -> Case:
        """The configured problem size: checked for correctness, then timed."""

    @abc.abstractmethod
    def check_cases(self, rng: np.random.Generator) -> list[Case]:
        """Small and odd-sized cases checked before the full one (fresh ones may be drawn each time)."""

    @abc.abstractmethod
    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Fresh random inputs for ``case``."""

    @abc.abstractmethod
    def outputs(self, case: Case) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Shape and dtype of each output buffer; the runtime allocates, guards and poisons them."""

    @abc.abstractmethod
    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """Computes the expected outputs into ``outputs`` (numpy); also what ``vs_reference`` is timed against."""

    @abc.abstractmethod
    def kernel_args(self, case: Case, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        """The C call's arguments in order: ints, floats, and arrays (inputs and outputs by name)."""

    def tolerance(self, case: Case) -> tuple[float, float]:
        """``(rtol, atol)``: an element passes when ``|out - ref| <= atol + rtol * scale``, where the scale is
        :meth:`error_scale` (by default ``|ref|``)."""
        return (1e-4, 1e-5)

    def error_scale(self, case: Case, inputs: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray],
                    ) -> Mapping[str, np.ndarray] | None:  # fmt: skip
        """Per output, the magnitude each element's error is measured against (``None``: ``|ref|``). Where the
        reference's own rounding depends on more than its result, say so here: a sum's error grows with its
        terms, not with what is left after they cancel (matmul gives ``|A| @ |B|``)."""
        return None

    def rms_tolerance(self, case: Case) -> float | None:
        """The largest ``rms(out - ref) / rms(ref)`` over all elements of an output together, on typical values;
        ``None`` (the default): no such bound. Each element may pass :meth:`tolerance` while all together show
        arithmetic of fewer bits than the task's (inputs rounded to 14 bits, an int16 fixed-point GEMM)."""
        return None

    def twin_rows(self, case: Case) -> Mapping[str, Sequence[tuple[int, int]]]:
        """Per output, pairs of rows (indices on its first axis) that must be equal bit for bit: one computation
        reached two ways in the same call, such as a query alone and within a batch (empty by default)."""
        return {}

    judged: ClassVar[tuple[str, ...]] = ()
    """Outputs no element-wise tolerance can judge (the ids of a top list, where two near-equal values may come in
    either order): :meth:`judge` does, and they are left out of the element-wise comparison."""

    def judge(self, case: Case, inputs: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray],
              got: Mapping[str, np.ndarray]) -> str | None:  # fmt: skip
        """Why the outputs ``got`` are wrong by the task's own rules (``None``: they are not), after every output
        not :attr:`judged` passed the element-wise comparison. The default has no rules."""
        return None

    def value_kinds(self) -> tuple[str, ...]:
        """The value distributions the kernel must be correct on (see :data:`VALUE_KINDS`). Besides the
        typical checks, each is checked on every check case of one draw (subnormals but the largest ones:
        :func:`runtime.backends.kernels.check_plan`); the full case and the timing see ``typical`` values.
        The default, ``("typical",)``, is what :meth:`inputs` draws and nothing more."""
        return ("typical",)

    def inputs_of_kind(self, case: Case, rng: np.random.Generator, kind: str) -> dict[str, np.ndarray]:
        """Inputs for ``case`` of the value distribution ``kind``: :meth:`inputs`'s, with every float array
        reshaped to ``kind`` (integer arrays as they are). Override for a task whose inputs need care."""
        drawn = self.inputs(case, rng)
        if kind == "typical":
            return drawn
        if kind not in VALUE_KINDS:
            raise ValueError(f"unknown value kind {kind!r}: use one of {', '.join(VALUE_KINDS)}")
        return {name: _of_kind(np.asarray(a), rng, kind) for name, a in drawn.items()}

    # --- how it is measured ---------------------------------------------------------------------

    @abc.abstractmethod
    def work(self, case: Case) -> float:
        """Work of one call in the numerator of ``unit`` (e.g. GFLOP for GFLOP/s); fitness = work / seconds."""


VALUE_KINDS: tuple[str, ...] = ("typical", "large", "small", "zeros", "signed_zeros", "denormals")
"""Value distributions a kernel task may declare (:meth:`KernelTask.value_kinds`): ``typical`` is what the
task draws; ``large`` and ``small`` scale it by 2**40 and 2**-40; ``zeros`` sets a third of the elements
to 0; ``signed_zeros`` to -0 or +0; ``denormals`` replaces a third by subnormals of either sign."""


def _of_kind(a: np.ndarray, rng: np.random.Generator, kind: str) -> np.ndarray:
    if not np.issubdtype(a.dtype, np.floating):
        return a
    a = a.copy()
    if kind in ("large", "small"):
        a *= a.dtype.type(2.0 ** (40 if kind == "large" else -40))
        return a
    pick = rng.random(a.shape) < 1 / 3
    if kind == "zeros":
        a[pick] = 0
    elif kind == "signed_zeros":
        a[pick] = np.copysign(np.zeros(int(pick.sum()), a.dtype), rng.standard_normal(int(pick.sum())))
    else:  # denormals: below the smallest normal, of either sign
        tiny = np.finfo(a.dtype).smallest_normal
        a[pick] = (rng.uniform(-1.0, 1.0, int(pick.sum())) * tiny).astype(a.dtype)
    return a


class TaskLoadError(ValueError):
    """A task name or ``module:Class`` reference that cannot be loaded."""


BUILTIN_TASKS: dict[str, str] = {
    "matmul": "runtime.tasks.matmul:Matmul",
    "softmax": "runtime.tasks.softmax:Softmax",
    "layernorm": "runtime.tasks.layernorm:LayerNorm",
    "gelu": "runtime.tasks.gelu:Gelu",
    "linear_bf16": "runtime.tasks.linear_bf16:LinearBf16",
    "linear_int8": "runtime.tasks.linear_int8:LinearInt8",
    "linear_int8_avx2": "runtime.tasks.linear_int8_avx2:LinearInt8Avx2",
    "linear_f32": "runtime.tasks.linear_f32:LinearF32",
    "linear_q8": "runtime.tasks.linear_q8:LinearQ8",
    "linear_q8_vnni": "runtime.tasks.linear_q8_vnni:LinearQ8Vnni",
    "lm_head_topk": "runtime.tasks.lm_head_topk:LmHeadTopk",
    "lm_head_topk_vnni": "runtime.tasks.lm_head_topk_vnni:LmHeadTopkVnni",
    "attention_decode": "runtime.tasks.attention_decode:AttentionDecode",
    "attention_decode_f16": "runtime.tasks.attention_decode:AttentionDecodeF16",
    "rmsnorm": "runtime.tasks.rmsnorm:RMSNorm",
    "matmul_cuda": "runtime.tasks.matmul_cuda:MatmulCuda",
    "softmax_cuda": "runtime.tasks.softmax_cuda:SoftmaxCuda",
    "engine": "runtime.engine.task:EngineTask",
    "chat_engine": "runtime.decoder.engine_task:ChatEngineTask",
}


def load_task_class(ref: str) -> type[Task]:
    """Resolves a built-in task name or a ``module:Class`` reference to a :class:`Task` subclass."""
    target = BUILTIN_TASKS.get(ref, ref)
    if ":" not in target:
        known = ", ".join(sorted(BUILTIN_TASKS))
        raise TaskLoadError(f"unknown task {ref!r}: use a built-in task ({known}) or 'module:Class'")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskLoadError(f"cannot import module {module_name!r} for task {ref!r}: {exc}") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TaskLoadError(f"{target!r} is not a task: subclass runtime.KernelTask (a kernel) or runtime.Task")
    backend = getattr(cls, "backend", None)
    if not isinstance(backend, str):
        raise TaskLoadError(f"{target!r} names no backend: subclass runtime.KernelTask for a C kernel task, "
                            "or set the class attribute `backend`")
    if not is_backend_ref(backend):
        raise TaskLoadError(f"{target!r} names an unknown backend {backend!r}: use one of "
                            f"{', '.join(sorted(BACKENDS))} or 'module:Class' of a runtime.backends.Backend")
    return cls

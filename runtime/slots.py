"""What a kernel task adds to fill one of the engine's operator slots (``runtime.engine.ops.SLOTS``): the slot
it fills, what its kernels need there, and how the slot calls them. A task that fills a slot is a
:class:`SlotTask` (a :class:`runtime.task.KernelTask` with these hooks); nothing else needs to know its C
argument order."""

from __future__ import annotations

import abc
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from runtime.task import BUILTIN_TASKS, KernelTask, load_task_class

__all__ = ["Slot", "SlotTask", "slot_tasks"]


@dataclass(frozen=True)
class Slot:
    """An operator slot of the engine that a kernel task's elites fill, and what they need there: the CPU flags
    without any of which the slot leaves them out, and the multiples of a GEMM's inner and output sizes they
    take (the ``linear`` slot; other shapes run in numpy). A task that needs fewer instructions than another
    of the slot ``stands_in_for`` it: it is searched only on a CPU that cannot run the other."""

    name: str
    cpu_flags: tuple[str, ...] = ()
    k_multiple: int = 1
    n_multiple: int = 1
    stands_in_for: str | None = None

    def missing(self, flags: Collection[str]) -> list[str]:
        """The flags this slot's kernels need that ``flags`` (a CPU's) lack."""
        return [f for f in self.cpu_flags if f not in flags]


class SlotTask(KernelTask):
    """A kernel task whose elites fill an engine slot: the slot they fill (:attr:`slot`; ``None``: a subclass
    that fills none) and how the slot calls them (:meth:`slot_args`, and :meth:`slot_pack` for a GEMM's
    weights)."""

    slot: ClassVar[Slot | None] = None

    @abc.abstractmethod
    def slot_args(self, operands: Mapping[str, Any], out: np.ndarray) -> list[Any]:
        """The C call's arguments for one call from the engine's slot: ``operands`` as the slot passes them
        (``layernorm``: x, gamma, beta, eps; ``softmax``: x; ``gelu``: x, bias; ``linear``: x, the packed
        weight arrays as ``packed``, bias), ``out`` the array to write."""

    def slot_pack(self, w: np.ndarray) -> tuple[np.ndarray, ...]:
        """A GEMM weight ``w[k, n]`` (fp32) packed once into the arrays the kernel takes (``linear`` slot)."""
        raise NotImplementedError(f"the {type(self).__name__} task takes no packed weights")


def slot_tasks(slot: str) -> tuple[str, ...]:
    """The built-in tasks whose elites fill ``slot`` (each declares its :attr:`SlotTask.slot`)."""
    out = []
    for name in BUILTIN_TASKS:
        cls = load_task_class(name)
        declared = cls.slot if issubclass(cls, SlotTask) else None
        if declared is not None and declared.name == slot:
            out.append(name)
    return tuple(out)

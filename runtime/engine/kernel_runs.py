"""An engine's kernels from kernel runs: the elites a run offers, rendered ready to compile; compiling and
loading them into an operator table.

The runs are read where a task is resolved (the controller), through a :class:`runtime.followed_runs.RunReader`
handed in (``runtime`` may not import ``archive``, which owns the store); what they offer then travels
inside the task's arguments, so a worker, a Ray node or a server never reads a kernel run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.engine.ops import SLOTS, Ops, c_slot, slot_task
from runtime.followed_runs import RunNotFound, RunReader
from runtime.settings import CompilerSettings, TaskSpec
from runtime.task import load_task_class
from runtime.toolchain.cc import CompileError, CompileResult, compile_source, load_kernel

__all__ = ["KernelSource", "RunNotFound", "build_ops", "compile_kernels", "kernel_offer"]


@dataclass(frozen=True)
class KernelSource:
    """A kernel elite made ready to compile: its rendered source and the flags its task asks for."""

    slot: str
    id: str
    source: str
    flags: tuple[str, ...]
    task: str = ""  # the task that evolved it (empty: the slot's first built-in one)
    sha256: str = ""  # the hash its library must have when it is loaded (empty: not checked)
    args: dict[str, Any] = field(default_factory=dict)  # the task's arguments it was rendered (and checked) with


def kernel_offer(run: RunReader, slot: str, ids: list[str] | None, top: int,
                 fills: Callable[[str, str], None] | None = None) -> list[KernelSource]:  # fmt: skip
    """The kernels ``run`` offers ``slot``: the listed ``ids``, or its ``top`` fittest ok elites, each rendered
    with the run's own task. ``fills(slot, task)`` raises ValueError where the run's task cannot fill the slot
    (default: the encoder's slots). Raises :class:`RunNotFound` (a missing candidate, no ok elite yet) and
    ValueError (the run's task does not fit the slot, a candidate that is not ok)."""
    spec = TaskSpec.model_validate({"name": run.task_name, "args": run.task_args})
    try:
        (fills or _encoder_fills)(slot, spec.name)
    except ValueError as exc:
        raise ValueError(f"{run.path} evolved {spec.name!r} kernels: {exc}") from None
    chosen = ids if ids is not None else run.elite_ids(top)
    if not chosen:
        raise RunNotFound(f"{run.path} has no ok candidate yet")
    task = load_task_class(spec.name)(spec.args)
    out = []
    for cid in chosen:
        cand = run.stored(cid)
        if cand.status != "ok":
            raise ValueError(f"candidate {cand.id[:12]} in {run.path} is {cand.status}, not ok")
        out.append(KernelSource(slot, cand.id, task.render(cand.genome), tuple(task.compile_flags()), spec.name,
                                args=task.args.model_dump(mode="json")))  # fmt: skip
    return out


def _encoder_fills(slot: str, task: str) -> None:
    if slot not in SLOTS:
        raise ValueError(f"unknown slot {slot!r} (slots: {', '.join(SLOTS)})")
    slot_task(slot, task)


def compile_kernels(
    kernels: dict[str, KernelSource], *, compiler: CompilerSettings, cache_dir: str, work_dir: str | None = None
) -> dict[str, CompileResult]:
    """Compiles the kernels into the cache without loading them (nothing of them runs): each slot's library,
    with its hash and the seconds the compiler took. Raises :class:`runtime.toolchain.CompileError`."""
    return {slot: compile_source(ks.source, compiler=compiler, extra_flags=ks.flags, cache_dir=cache_dir,
                                 work_dir=work_dir) for slot, ks in kernels.items()}  # fmt: skip


def build_ops(
    kernels: dict[str, KernelSource], *, compiler: CompilerSettings, cache_dir: str, work_dir: str | None = None
) -> Ops:
    """An operator table with the given slots filled by compiled kernels (the rest numpy).

    Raises :class:`runtime.toolchain.CompileError` when a kernel does not compile, or when its library is not the
    one its ``sha256`` names (the build that was measured).
    """
    ops = Ops()
    try:
        for slot, ks in kernels.items():
            built = compile_source(ks.source, compiler=compiler, extra_flags=ks.flags, cache_dir=cache_dir,
                                   work_dir=work_dir)
            if ks.sha256 and built.sha256 != ks.sha256:
                raise CompileError(f"the {slot} kernel's library is not the build that was measured (sha256 "
                                   f"{built.sha256[:16]}, measured {ks.sha256[:16]}): refused")  # fmt: skip
            kernel = load_kernel(built.path, "kernel")
            ops.kernels[slot] = kernel
            fn = c_slot(slot, kernel, ks.task or None)
            setattr(ops, slot, fn)
            if slot == "linear":  # the bias-free GEMM ahead of the fused bias + GELU runs on it too
                ops.matmul = fn
    except BaseException:
        ops.close()
        raise
    return ops

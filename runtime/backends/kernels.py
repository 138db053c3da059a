"""What the kernel backends (C and CUDA) share: guarded buffers, problem instances, the output comparison,
and the metrics of a timing against the reference.

Integrity rules hold on every call of a kernel: outputs are poisoned (NaN) before the call, every array
the kernel sees sits between guard zones that must be intact afterwards, and inputs must come back
unchanged. None of this happens inside the timed region.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.backends.base import Failure
from runtime.result import Status
from runtime.task import Case, KernelTask
from runtime.timing import TimingRun

__all__ = [
    "GUARD_BYTES",
    "SENTINEL",
    "Alloc",
    "CallClock",
    "Instance",
    "check_plan",
    "check_rms",
    "compare",
    "fresh_rng",
    "guarded_empty",
    "poison",
    "rms_error",
    "timing_metrics",
    "within_tolerance",
]

GUARD_BYTES = 256  # 64 floats of sentinel before and after every array the kernel sees
SENTINEL = 0xA5
_ALIGN = 64


def fresh_rng() -> tuple[int, np.random.Generator]:
    """A generator seeded from the OS (inputs a kernel cannot have seen before), and its seed."""
    seed = int.from_bytes(os.urandom(8), "little")
    return seed, np.random.default_rng(seed)


Alloc = Callable[[int], np.ndarray]
"""``alloc(nbytes)``: a 64-byte-aligned uint8 block of at least ``nbytes`` (e.g. in shared memory)."""


def _aligned(nbytes: int) -> np.ndarray:
    block = np.empty(nbytes + _ALIGN, np.uint8)
    start = -block.ctypes.data % _ALIGN
    return block[start : start + nbytes]


def guarded_empty(shape: tuple[int, ...], dtype: Any, alloc: Alloc = _aligned) -> tuple[np.ndarray, np.ndarray]:
    """A 64-byte-aligned array between two sentinel guard zones: ``(raw bytes, the array)``."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = alloc(nbytes + 2 * GUARD_BYTES)[: nbytes + 2 * GUARD_BYTES]
    raw[:GUARD_BYTES] = SENTINEL
    raw[-GUARD_BYTES:] = SENTINEL
    return raw, raw[GUARD_BYTES : GUARD_BYTES + nbytes].view(dtype).reshape(shape)


def guards_intact(raw: np.ndarray) -> bool:
    return bool((raw[:GUARD_BYTES] == SENTINEL).all() and (raw[-GUARD_BYTES:] == SENTINEL).all())


def poison(a: np.ndarray) -> None:
    """Fills an output with values no correct kernel leaves behind (NaN, or 0x5A bytes for integers)."""
    if np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.complexfloating):
        a.fill(np.nan)
    else:
        a.view(np.uint8).fill(0x5A)


@dataclass
class CallClock:
    """Seconds spent inside kernel and reference calls (not overhead)."""

    calls: float = 0.0

    def run(self, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            self.calls += time.perf_counter() - t0


@dataclass
class Instance:
    """One case with its inputs, the kernel's guarded arrays, and the expected outputs."""

    case: Case
    seed: int
    inputs: dict[str, np.ndarray]
    raws: dict[str, np.ndarray] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # what the kernel sees (guarded)
    expected: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()
    kind: str = "typical"  # the inputs' value distribution (runtime.task.VALUE_KINDS)

    def describe(self) -> str:
        """The case, and the value distribution when it is not the typical one (for messages)."""
        return f"case {self.case}" + ("" if self.kind == "typical" else f" with {self.kind} values")

    @classmethod
    def fresh(cls, task: KernelTask, case: Case, given: Mapping[str, np.ndarray] | None = None,
              kind: str = "typical") -> Instance:  # fmt: skip
        """Fresh random inputs for ``case`` of the value distribution ``kind`` (or the ``given`` ones); the
        expected outputs allocated, not computed (see :meth:`expect`)."""
        seed, rng = fresh_rng()
        drawn = given if given is not None else task.inputs_of_kind(case, rng, kind)
        inputs = {k: np.ascontiguousarray(v) for k, v in drawn.items()}
        inst = cls(case, seed, inputs, kind=kind)
        shapes = task.outputs(case)
        inst.outputs = tuple(shapes)
        for name, (shape, dtype) in shapes.items():
            inst.expected[name] = np.empty(shape, dtype)
        return inst

    def guard(self, task: KernelTask, alloc: Alloc = _aligned) -> None:
        """Guarded copies of the inputs and guarded output buffers (in blocks from ``alloc``, e.g. a candidate
        host's shared memory): what a kernel is called on. ``inputs`` stay a copy the kernel cannot reach."""
        for name, arr in self.inputs.items():
            self.raws[name], self.arrays[name] = guarded_empty(arr.shape, arr.dtype, alloc)
            self.arrays[name][...] = arr
        for name in self.outputs:
            exp = self.expected[name]
            self.raws[name], self.arrays[name] = guarded_empty(exp.shape, exp.dtype, alloc)

    def expect(self, task: KernelTask, clock: CallClock) -> None:
        """Computes the expected outputs with the task's reference."""
        clock.run(lambda: task.reference(self.case, self.inputs, self.expected))

    def poison(self) -> None:
        for name in self.outputs:
            poison(self.arrays[name])

    def verify_integrity(self) -> None:
        for name, raw in self.raws.items():
            if not guards_intact(raw):
                raise Failure(
                    Status.INVALID, f"wrote out of bounds of {name!r} (guard zone overwritten), case {self.case}"
                )
        for name, original in self.inputs.items():
            if not np.array_equal(self.arrays[name].view(np.uint8), original.view(np.uint8)):
                raise Failure(Status.INVALID, f"modified its inputs ({name!r}), case {self.case}")


EDGE_WORK_SHARE = 1 / 16
"""Subnormal values skip the largest quarter of the check cases over this share of the timed case's work:
subnormal arithmetic can be a hundred times slower (microcode assists), so not at the largest shapes."""


def check_plan(task: KernelTask, trials: int) -> list[tuple[Case, str]]:
    """The check cases of ``trials`` fresh draws on typical values, then each other value distribution of the
    task's :meth:`~runtime.task.KernelTask.value_kinds` on every case of the first draw (``denormals`` on all but
    its largest quarter above :data:`EDGE_WORK_SHARE` of the timed case's work): a kernel must be right on zeros,
    subnormals, huge and tiny values at every size it may switch paths at, not only the smallest ones."""
    rng = fresh_rng()[1]
    draws = [task.check_cases(rng) for _ in range(trials)]
    plan = [(case, "typical") for cases in draws for case in cases]
    cap = task.work(task.full_case()) * EDGE_WORK_SHARE
    ranked = sorted(draws[0], key=task.work)
    lower = ranked[: max(1, (3 * len(ranked) + 3) // 4)]
    for kind in task.value_kinds():
        if kind == "typical":
            continue
        for case in draws[0]:
            if kind != "denormals" or task.work(case) <= cap or any(case is c for c in lower):
                plan.append((case, kind))
    return plan


def rms_error(got: np.ndarray, expected: np.ndarray) -> float:
    """``rms(got - expected) / rms(expected)`` over the finite expected elements (0 when they are all zero and
    so is the difference)."""
    with np.errstate(invalid="ignore", over="ignore"):
        g, e = got.astype(np.float64, copy=False).ravel(), expected.astype(np.float64, copy=False).ravel()
        keep = np.isfinite(e)
        diff = float(np.sqrt(np.mean(np.square(g[keep] - e[keep])))) if keep.any() else 0.0
        size = float(np.sqrt(np.mean(np.square(e[keep])))) if keep.any() else 0.0
    if diff == 0.0:
        return 0.0
    return diff / size if size > 0 else float("inf")


def check_rms(task: KernelTask, case: Case, name: str, got: np.ndarray, expected: np.ndarray, where: str) -> None:
    """Raises ``wrong`` when the output's relative RMS error is over the task's :meth:`rms_tolerance`."""
    bound = task.rms_tolerance(case)
    if bound is None:
        return
    err = rms_error(got, expected)
    if not err <= bound:
        raise Failure(Status.WRONG, f"relative RMS error {err:.3g} in output {name!r} is over {bound:g} (each element "
                      f"may pass alone; all together they show arithmetic of fewer bits); {where}")  # fmt: skip


def compare(task: KernelTask, inst: Instance) -> None:
    """Raises ``wrong`` when an output of ``inst.arrays`` is outside the task's tolerance of the expected one
    (measured against the task's :meth:`~runtime.task.KernelTask.error_scale`), or, on typical values, when all
    its elements together are over the task's :meth:`~runtime.task.KernelTask.rms_tolerance`, or when two rows it
    requires to be equal bit for bit differ (:func:`compare_twins`)."""
    rtol, atol = task.tolerance(inst.case)
    scales = task.error_scale(inst.case, inst.inputs, inst.expected) or {}
    for name in inst.outputs:
        if name in task.judged:
            continue
        got, exp = inst.arrays[name], inst.expected[name]
        scale = scales.get(name)
        bad = ~within_tolerance(got, exp, rtol, atol, scale)
        if not bad.any():
            if inst.kind == "typical":
                check_rms(task, inst.case, name, got, exp, f"{inst.describe()}, input seed {inst.seed}")
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            g, e = got.astype(np.float64, copy=False), exp.astype(np.float64, copy=False)
            err = np.abs(g - e)
        nan = np.isnan(g) & ~np.isnan(e)
        if nan.any():
            where = int(np.argmax(nan))
        else:
            where = int(np.argmax(np.where(bad, np.nan_to_num(err, nan=np.inf), -1.0)))
        idx = tuple(int(i) for i in np.unravel_index(where, got.shape))
        what = "NaN in output" if nan.any() else f"max error {float(err.flat[where]):.4g} in output"
        against = "" if scale is None else f" of the error scale {float(np.asarray(scale).flat[where]):.4g}"
        raise Failure(
            Status.WRONG,
            f"{what} {name!r} at index {idx}: expected {exp.flat[where].item()!r}, got {got.flat[where].item()!r} "
            f"({int(bad.sum())} of {bad.size} elements outside rtol={rtol:g}{against}, atol={atol:g}); "
            f"{inst.describe()}, input seed {inst.seed}",
        )
    why = task.judge(inst.case, inst.inputs, inst.expected, {name: inst.arrays[name] for name in inst.outputs})
    if why is not None:
        raise Failure(Status.WRONG, f"{why}; {inst.describe()}, input seed {inst.seed}")
    compare_twins(task, inst)


def compare_twins(task: KernelTask, inst: Instance) -> None:
    """Raises ``wrong`` when two rows the task requires to be equal bit for bit (:meth:`twin_rows`) differ."""
    for name, pairs in task.twin_rows(inst.case).items():
        out = inst.arrays[name]
        for a, b in pairs:
            if not np.array_equal(out[a].view(np.uint8), out[b].view(np.uint8)):
                diff = np.abs(out[a].astype(np.float64) - out[b].astype(np.float64))
                raise Failure(Status.WRONG, f"rows {a} and {b} of output {name!r} are one computation reached two "
                              f"ways and must be equal bit for bit; they differ by up to {np.nanmax(diff):.3g} (the "
                              f"result depends on the batch around it); {inst.describe()}, input seed {inst.seed}")


def within_tolerance(got: np.ndarray, expected: np.ndarray, rtol: float, atol: float,
                     scale: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """Element-wise ``|got - expected| <= atol + rtol * scale`` (``scale`` defaults to ``|expected|``); NaN
    where NaN is expected passes, and so does the exact value (an infinity where one is expected)."""
    with np.errstate(invalid="ignore", over="ignore"):  # a kernel's garbage may hold signalling NaNs
        g, e = got.astype(np.float64, copy=False), expected.astype(np.float64, copy=False)
        s = np.abs(e) if scale is None else np.asarray(scale, np.float64)
        return (np.abs(g - e) <= atol + rtol * s) | (np.isnan(g) & np.isnan(e)) | (g == e)


def timing_metrics(run: TimingRun, work: float) -> tuple[float, dict[str, Any]]:
    """The fitness (``work`` per median second) and the metrics of a timing against the reference."""
    cand, ref = run.candidate, run.reference
    median = max(cand.median, 1e-12)
    return work / median, {
        "vs_reference": ref.median / median,
        "time_median_s": cand.median,
        "time_min_s": cand.min,
        "time_mean_s": cand.mean,
        "time_std_s": cand.std,
        "n_repeats": cand.n,
        "ref_time_median_s": ref.median,
        "ref_time_min_s": ref.min,
        "ref_fitness": work / max(ref.median, 1e-12),
        "rel_uncertainty": run.rel_uncertainty if math.isfinite(run.rel_uncertainty) else None,
    }

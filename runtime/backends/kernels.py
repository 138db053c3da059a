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
    "CallClock",
    "Instance",
    "compare",
    "compare_sampled",
    "fresh_rng",
    "guarded_empty",
    "poison",
    "timing_metrics",
]

GUARD_BYTES = 256  # 64 floats of sentinel before and after every array the kernel sees
SENTINEL = 0xA5
_ALIGN = 64


def fresh_rng() -> tuple[int, np.random.Generator]:
    """A generator seeded from the OS (inputs a kernel cannot have seen before), and its seed."""
    seed = int.from_bytes(os.urandom(8), "little")
    return seed, np.random.default_rng(seed)


def guarded_empty(shape: tuple[int, ...], dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """A 64-byte-aligned array between two sentinel guard zones: ``(raw bytes, the array)``."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    block = np.empty(nbytes + 2 * GUARD_BYTES + _ALIGN, np.uint8)
    start = -block.ctypes.data % _ALIGN
    raw = block[start : start + nbytes + 2 * GUARD_BYTES]
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

    @classmethod
    def fresh(cls, task: KernelTask, case: Case, given: Mapping[str, np.ndarray] | None = None) -> Instance:
        """Fresh random inputs for ``case`` (or the ``given`` ones); the expected outputs allocated, not
        computed (see :meth:`expect`)."""
        seed, rng = fresh_rng()
        drawn = given if given is not None else task.inputs(case, rng)
        inputs = {k: np.ascontiguousarray(v) for k, v in drawn.items()}
        inst = cls(case, seed, inputs)
        shapes = task.outputs(case)
        inst.outputs = tuple(shapes)
        for name, (shape, dtype) in shapes.items():
            inst.expected[name] = np.empty(shape, dtype)
        return inst

    def guard(self, task: KernelTask) -> None:
        """Guarded host copies of the inputs and guarded output buffers: what a C kernel is called on."""
        for name, arr in self.inputs.items():
            self.raws[name], self.arrays[name] = guarded_empty(arr.shape, arr.dtype)
            self.arrays[name][...] = arr
        for name in self.outputs:
            exp = self.expected[name]
            self.raws[name], self.arrays[name] = guarded_empty(exp.shape, exp.dtype)

    def refill(self, task: KernelTask, rng: np.random.Generator) -> None:
        """Fresh inputs, drawn now, written into the kernel's buffers; outputs poisoned."""
        for name, arr in task.inputs(self.case, rng).items():
            self.inputs[name] = np.ascontiguousarray(arr)
            self.arrays[name][...] = arr
        self.poison()

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


def compare(task: KernelTask, inst: Instance) -> None:
    """Raises ``wrong`` when an output of ``inst.arrays`` is outside the task's tolerance of the expected one."""
    rtol, atol = task.tolerance(inst.case)
    for name in inst.outputs:
        got, exp = inst.arrays[name], inst.expected[name]
        g, e = got.astype(np.float64, copy=False), exp.astype(np.float64, copy=False)
        err = np.abs(g - e)
        bad = ~(err <= atol + rtol * np.abs(e)) & ~(np.isnan(g) & np.isnan(e))
        if not bad.any():
            continue
        nan = np.isnan(g) & ~np.isnan(e)
        if nan.any():
            where = int(np.argmax(nan))
        else:
            where = int(np.argmax(np.where(bad, np.nan_to_num(err, nan=np.inf), -1.0)))
        idx = tuple(int(i) for i in np.unravel_index(where, got.shape))
        what = "NaN in output" if nan.any() else f"max error {float(err.flat[where]):.4g} in output"
        raise Failure(
            Status.WRONG,
            f"{what} {name!r} at index {idx}: expected {exp.flat[where].item()!r}, got {got.flat[where].item()!r} "
            f"({int(bad.sum())} of {bad.size} elements outside rtol={rtol:g}, atol={atol:g}); "
            f"case {inst.case}, input seed {inst.seed}",
        )


def compare_sampled(task: KernelTask, inst: Instance, expected: Mapping[str, np.ndarray], rng: np.random.Generator,
                    k: int = 256) -> None:
    """After a timed call: no output left unwritten, and ``k`` elements of each output, chosen now, within
    tolerance of ``expected`` (the reference's outputs for the same inputs); else ``wrong``."""
    rtol, atol = task.tolerance(inst.case)
    for name in inst.outputs:
        got, exp = inst.arrays[name].reshape(-1), expected[name].reshape(-1)
        if np.issubdtype(got.dtype, np.floating) and np.isnan(got).any() and not np.isnan(exp).any():
            raise Failure(Status.WRONG, f"left output {name!r} unwritten on a timed call, case {inst.case}")
        idx = rng.integers(0, got.size, min(k, got.size))
        g, e = got[idx].astype(np.float64), exp[idx].astype(np.float64)
        bad = ~(np.abs(g - e) <= atol + rtol * np.abs(e)) & ~(np.isnan(g) & np.isnan(e))
        if bad.any():
            j = int(np.argmax(bad))
            where = tuple(int(i) for i in np.unravel_index(int(idx[j]), inst.arrays[name].shape))
            raise Failure(Status.WRONG, f"wrong output {name!r} on a timed call with fresh inputs, at index {where}: "
                          f"expected {exp[idx[j]].item()!r}, got {got[idx[j]].item()!r} ({int(bad.sum())} of "
                          f"{idx.size} sampled elements outside rtol={rtol:g}, atol={atol:g}); case {inst.case}")


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

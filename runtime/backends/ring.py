"""A ring of input sets: what a kernel is timed on, so that no timed call sees inputs it has seen before.

``size`` instances of one case sit side by side in blocks from an allocator (a candidate host's shared
memory), every array between guard zones. Before every timed round the worker draws fresh inputs for
all of them and copies them in just before the request (both outside the timed region); one timed
request calls the kernel once on each. After the
round, every instance's guards and inputs must be intact and its outputs must match the reference's on
elements chosen then. Each of these is one numpy operation per array over the whole ring, so a
microsecond kernel can be timed over dozens of fresh sets per request at little cost.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from runtime.backends.base import Failure
from runtime.backends.kernels import GUARD_BYTES, SENTINEL, Alloc, Instance, check_rms, poison, within_tolerance
from runtime.result import Status
from runtime.task import KernelTask

__all__ = ["Ring"]


class _Block:
    """``size`` guarded arrays of one shape: row ``j`` is ``guard | array j | guard (and padding)``."""

    def __init__(self, size: int, shape: tuple[int, ...], dtype: np.dtype, alloc: Alloc) -> None:
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        row = (2 * GUARD_BYTES + self.nbytes + 63) // 64 * 64
        self.raw = alloc(size * row)[: size * row].reshape(size, row)
        self.raw[:, :GUARD_BYTES] = SENTINEL
        self.raw[:, GUARD_BYTES + self.nbytes :] = SENTINEL
        self.flat = self.raw[:, GUARD_BYTES : GUARD_BYTES + self.nbytes].view(dtype)  # (size, elements), strided
        self.arrays = [self.flat[j].reshape(shape) for j in range(size)]  # each C-contiguous

    def intact(self) -> bool:
        return bool((self.raw[:, :GUARD_BYTES] == SENTINEL).all() and (self.raw[:, GUARD_BYTES + self.nbytes :] ==
                                                                       SENTINEL).all())  # fmt: skip


class Ring:
    """``size`` instances of ``case``: ``arrays(j)`` is what instance ``j``'s kernel call sees, ``inputs`` the
    worker's own copies (what the reference reads), ``expected`` the reference's outputs."""

    def __init__(self, task: KernelTask, like: Instance, size: int, alloc: Alloc) -> None:
        """``size`` instances of ``like``'s case, with its arrays' shapes (inputs are drawn by :meth:`draw`)."""
        self.task, self.case, self.size = task, like.case, size
        shapes = task.outputs(like.case)
        self.outputs = tuple(shapes)
        self.blocks: dict[str, _Block] = {}
        self.inputs: dict[str, np.ndarray] = {}
        for name, arr in like.inputs.items():
            self.blocks[name] = _Block(size, arr.shape, arr.dtype, alloc)
            self.inputs[name] = np.empty((size, *arr.shape), arr.dtype)
        self.expected: dict[str, np.ndarray] = {}
        for name, (shape, dtype) in shapes.items():
            self.blocks[name] = _Block(size, tuple(shape), np.dtype(dtype), alloc)
            self.expected[name] = np.empty((size, *shape), dtype)

    def arrays(self, j: int) -> dict[str, np.ndarray]:
        return {name: block.arrays[j] for name, block in self.blocks.items()}

    def draw(self, rng: np.random.Generator, like: Ring | None = None) -> None:
        """Fresh inputs, drawn now, for every instance (or ``like``'s, for a rival), in the worker's copies."""
        if like is not None:
            for name, mine in self.inputs.items():
                mine[...] = like.inputs[name]
            return
        for j in range(self.size):
            for name, arr in self.task.inputs(self.case, rng).items():
                self.inputs[name][j] = arr

    def load(self) -> None:
        """The drawn inputs into the kernel's buffers, outputs poisoned. Right before a timed request, so the
        kernel finds its inputs in cache as the reference does, whichever of them runs first in a round."""
        for name, mine in self.inputs.items():
            self.blocks[name].flat[...] = mine.reshape(self.size, -1)
        for name in self.outputs:
            poison(self.blocks[name].flat)

    def compute_expected(self) -> None:
        """The reference's outputs for every instance, from the worker's copies of the inputs."""
        for j in range(self.size):
            self.task.reference(self.case, {n: a[j] for n, a in self.inputs.items()},
                                {n: a[j] for n, a in self.expected.items()})  # fmt: skip

    def verify(self, rng: np.random.Generator, expected: Mapping[str, np.ndarray] | None = None, k: int = 512) -> None:
        """After a round: guards and inputs intact everywhere, no output left unwritten, and ``k`` elements of
        each output, chosen now across the ring, within tolerance of ``expected`` (default: the reference's)."""
        expected = self.expected if expected is None else expected
        for name, block in self.blocks.items():
            if not block.intact():
                raise Failure(Status.INVALID, f"wrote out of bounds of {name!r} (guard zone overwritten) on a "
                              f"timed call, case {self.case}")  # fmt: skip
        for name, mine in self.inputs.items():
            if not np.array_equal(self.blocks[name].flat.view(np.uint8), mine.reshape(self.size, -1).view(np.uint8)):
                raise Failure(Status.INVALID, f"modified its inputs ({name!r}) on a timed call, case {self.case}")
        rtol, atol = self.task.tolerance(self.case)
        for name in self.outputs:
            got = self.blocks[name].flat
            exp = np.asarray(expected[name]).reshape(self.size, -1)
            if np.issubdtype(got.dtype, np.floating) and np.isnan(got).any() and not np.isnan(exp).any():
                raise Failure(Status.WRONG, f"left output {name!r} unwritten on a timed call, case {self.case}")
            rows = rng.integers(0, self.size, k)
            cols = rng.integers(0, got.shape[1], k)
            g, e = got[rows, cols], exp[rows, cols]
            # Against |e|, but no less than the outputs' typical size: a task whose error scale is not |ref|
            # (a sum's grows with its terms) is not failed here for an honest rounding of a small element,
            # while a remembered or stale answer is off by about that size everywhere.
            rms = float(np.sqrt(np.mean(np.square(e[np.isfinite(e)], dtype=np.float64)))) if e.size else 0.0
            bad = ~within_tolerance(g, e, rtol, atol, np.maximum(np.abs(e.astype(np.float64)), rms))
            if bad.any():
                i = int(np.argmax(bad))
                where = tuple(int(x) for x in np.unravel_index(int(cols[i]), self.blocks[name].arrays[0].shape))
                raise Failure(Status.WRONG, f"wrong output {name!r} on a timed call with fresh inputs, at index "
                              f"{where}: expected {e[i].item()!r}, got {g[i].item()!r} ({int(bad.sum())} of {k} "
                              f"sampled elements outside rtol={rtol:g}, atol={atol:g}); case {self.case}")  # fmt: skip
            check_rms(self.task, self.case, name, g, e, f"{k} elements sampled on a timed call, case {self.case}")

    def instance(self, j: int, seed: int) -> Instance:
        """Instance ``j`` as an :class:`Instance` (for a full comparison with the reference's outputs);
        ``seed`` is the one the ring's inputs were drawn from, for the message."""
        inst = Instance(self.case, seed, {n: a[j] for n, a in self.inputs.items()})
        inst.outputs = self.outputs
        inst.arrays = self.arrays(j)
        inst.expected = {n: self.expected[n][j] for n in self.outputs}
        return inst

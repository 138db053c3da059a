"""The one timing harness: a machine-wide lock, core pinning, and interleaved candidate/reference repeats.

Stopping rule. After ``warmup`` untimed calls of each function, candidate and reference are called
alternately (the order flips every round, so neither always runs on a cache warmed by the other) and
each call is timed with ``perf_counter_ns``. Timing stops when, for both functions, the relative
uncertainty of the median is below ``target_rel_spread`` (and at least ``min_repeats`` were taken), or
after ``max_repeats`` rounds, or once ``max_seconds`` have passed (at least one round always runs),
or, after ``min_repeats``, once the time spent outside the timed calls (the fresh inputs written and the
outputs checked between them) exceeds ``overhead_budget_s`` plus twice the time inside them: a
microsecond kernel then ends with the uncertainty it reached, which the result records;
the uncertainty is checked at ``min_repeats`` rounds and every 4th round after.
The uncertainty is the half-width of the boxplot notch, ``1.58 * IQR / sqrt(n)``, divided by the
median: a robust ~95% interval of the median that ignores the outliers a noisy machine produces.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from runtime.result import TimingStats
from runtime.settings import TimingSettings

__all__ = ["TimingLock", "TimingRun", "pinned", "relative_uncertainty", "time_interleaved"]


class TimingLock:
    """Timing holds the whole machine; everything else a worker does (compile, check, verify) shares it.

    Two ``flock``-ed files shared by every worker on the machine: the lock file, held exclusively while a
    worker times and shared while it does anything else, and a gate beside it (``<path>.gate``) that a
    timer takes before the lock and a sharer passes through on its way in. Sharers that arrive while a
    timer waits queue behind it, so a stream of compiles never starves a timing, and no compile or check
    runs on another core while a candidate is timed. The files are opened at construction (a worker does
    it before dropping privileges) and created world-writable, so workers of any user can share them.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = _open_lock_file(path)
        self._gate = _open_lock_file(f"{path}.gate")
        self._sharing = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[float]:
        """Shares the machine (no timing runs meanwhile); re-entrant. Yields the seconds spent waiting."""
        t0 = time.perf_counter()
        if self._sharing == 0:
            fcntl.flock(self._gate, fcntl.LOCK_EX)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_SH)
            finally:
                fcntl.flock(self._gate, fcntl.LOCK_UN)
        self._sharing += 1
        try:
            yield time.perf_counter() - t0
        finally:
            self._sharing -= 1
            if self._sharing == 0:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def held(self) -> Iterator[float]:
        """Holds the machine alone; yields the seconds spent waiting. Inside :meth:`shared`, this process's
        share is given up for the while (a timer waiting on its own share would wait for ever) and taken
        back before any other sharer may enter."""
        t0 = time.perf_counter()
        sharing = self._sharing > 0
        if sharing:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield time.perf_counter() - t0
            finally:
                # Converting is not atomic, but no sharer passes the gate we hold meanwhile.
                fcntl.flock(self._fd, fcntl.LOCK_SH if sharing else fcntl.LOCK_UN)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)
        os.close(self._gate)


def _open_lock_file(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    with contextlib.suppress(OSError):  # not ours to change when another user created it
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, 0o666)
    return fd


@contextlib.contextmanager
def pinned(core: int | None, count: int = 1, *, also: Sequence[int] = ()) -> Iterator[set[int]]:
    """Pins every thread of this process to ``count`` cores, from ``core`` on (default: the last allowed ones),
    and each thread of the processes ``also`` (a candidate's host) to one of them, in turn, and restores each
    thread's affinity after. Yields the cores.

    One core per host thread: left free to move, a woken thread of a kernel's team often joined its waker's
    core until the scheduler moved it, so the same kernel took 3.2 ms in one timing and 7.8 in the next."""
    allowed = sorted(os.sched_getaffinity(0))
    count = max(1, min(count, len(allowed)))
    if core is None:
        target = set(allowed[-count:])
    else:
        later = [c for c in allowed if c >= core]
        target = set(later[:count]) if len(later) >= count else set(allowed[-count:])
    before: dict[int, set[int]] = {}
    order = sorted(target)
    placed = [(tid, target) for tid in _threads()]
    for pid in also:
        placed += [(tid, {order[i % len(order)]}) for i, tid in enumerate(_threads(pid))]  # in thread-id order
    for tid, cpus in placed:
        with contextlib.suppress(OSError):  # a thread may end meanwhile
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cpus)
    try:
        yield target
    finally:
        for tid, cpus in before.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)


def _threads(pid: int | str = "self") -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [0] if pid == "self" else []


def relative_uncertainty(samples: list[float]) -> float:
    """``1.58 * IQR / sqrt(n) / median``: the relative half-width of the median's notch (inf if n < 2)."""
    n = len(samples)
    if n < 2:
        return math.inf
    s = sorted(samples)
    q1, q3 = _quantile(s, 0.25), _quantile(s, 0.75)
    med = _quantile(s, 0.5)
    return math.inf if med <= 0 else 1.58 * (q3 - q1) / math.sqrt(n) / med


def _quantile(s: list[float], q: float) -> float:
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class TimingRun:
    candidate: TimingStats
    reference: TimingStats
    call_seconds: float  # time spent inside the two functions (warm-up included): not overhead
    seconds: float  # wall time of the whole run
    rel_uncertainty: float  # of the candidate's median (see relative_uncertainty)


def time_interleaved(
    candidate: Callable[[], object],
    reference: Callable[[], object],
    settings: TimingSettings,
    *,
    before: Callable[[], object] | None = None,
    timer: Callable[[Callable[[], object]], float] | None = None,
    round_start: Callable[[], object] | None = None,
    round_end: Callable[[], object] | None = None,
) -> TimingRun:
    """Times ``candidate`` and ``reference`` side by side (see the module docstring for when it stops).

    ``before`` runs untimed before every timed candidate call (the CUDA backend poisons the outputs).
    ``timer(fn)`` runs ``fn`` and returns its seconds (default: ``perf_counter`` around the call); the
    CUDA backend passes one that times with CUDA events, the C backend one that times a request to the
    candidate's host. ``round_start`` and ``round_end`` run untimed around each round (both calls): the
    C backend draws fresh inputs before and checks every call's outputs against the reference's after.
    """
    clock = time.perf_counter_ns
    start = clock()
    for _ in range(settings.warmup):
        candidate()
        reference()
    cand: list[float] = []
    ref: list[float] = []
    deadline = start + int(settings.max_seconds * 1e9)
    pair = ((candidate, cand), (reference, ref))
    loop_start, inside = clock(), 0  # ns spent in the timed calls (a timer's own work included)
    for i in range(settings.max_repeats):
        if round_start is not None:
            round_start()
        for fn, out in pair if i % 2 == 0 else pair[::-1]:
            is_candidate = fn is candidate
            if is_candidate and before is not None:
                before()
            t0 = clock()
            if timer is None:
                fn()
                out.append((clock() - t0) * 1e-9)
            else:
                out.append(timer(fn))
            inside += clock() - t0
        if round_end is not None:
            round_end()
        now = clock()
        if now >= deadline:
            break
        outside = (now - loop_start - inside) * 1e-9
        if i + 1 >= settings.min_repeats and outside > settings.overhead_budget_s + 2e-9 * inside:
            break
        if (
            i + 1 >= settings.min_repeats
            and now - start >= settings.min_seconds * 1e9
            and (i + 1 - settings.min_repeats) % 4 == 0  # the check sorts: not every round
            and relative_uncertainty(cand) < settings.target_rel_spread
            and relative_uncertainty(ref) < settings.target_rel_spread
        ):
            break
    seconds = (clock() - start) * 1e-9
    timed = sum(cand) + sum(ref)
    # Warm-up calls are not timed one by one; count them at the measured medians.
    c, r = TimingStats.of(cand), TimingStats.of(ref)
    warm = settings.warmup * (c.median + r.median)
    return TimingRun(
        c, r, call_seconds=min(seconds, timed + warm), seconds=seconds, rel_uncertainty=relative_uncertainty(cand)
    )

"""The timing harness: statistics, the stopping rule, the machine-wide lock, pinning."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from runtime.result import TimingStats
from runtime.sandbox.limits import scrubbed_env
from runtime.settings import TimingSettings
from runtime.timing import TimingLock, pinned, relative_uncertainty, time_interleaved

pytestmark = pytest.mark.exclusive  # it measures time


def test_timing_stats_math():
    s = TimingStats.of([4.0, 1.0, 3.0, 2.0])
    assert (s.n, s.min, s.median, s.mean) == (4, 1.0, 2.5, 2.5)
    assert s.std == pytest.approx(math.sqrt(1.25))
    odd = TimingStats.of([5.0, 1.0, 3.0])
    assert odd.median == 3.0 and odd.std == pytest.approx(math.sqrt(8 / 3))


def test_relative_uncertainty():
    assert relative_uncertainty([1.0]) == math.inf
    assert relative_uncertainty([2.0] * 10) == 0.0
    # quartiles of 1..9 are 3 and 7, the median 5: 1.58 * 4 / 3 / 5
    assert relative_uncertainty([float(i) for i in range(1, 10)]) == pytest.approx(1.58 * 4 / 3 / 5)


def test_steady_functions_stop_at_min_repeats():
    settings = TimingSettings(warmup=1, min_repeats=5, max_repeats=1000, target_rel_spread=10.0, min_seconds=0)
    run = time_interleaved(lambda: None, lambda: None, settings)
    assert run.candidate.n == run.reference.n == 5
    assert run.call_seconds <= run.seconds


def test_the_spread_stops_timing_only_after_min_seconds():
    """A ratio from one quiet moment is luck: a steady pair is still timed for ``min_seconds``."""
    settings = TimingSettings(warmup=0, min_repeats=5, max_repeats=10_000, target_rel_spread=10.0, min_seconds=0.1)
    t0 = time.perf_counter()
    run = time_interleaved(lambda: time.sleep(0.002), lambda: time.sleep(0.002), settings)
    assert time.perf_counter() - t0 >= 0.1 and run.candidate.n > 5


def test_max_repeats_and_max_seconds_cap_the_run():
    capped = time_interleaved(lambda: None, lambda: None, TimingSettings(max_repeats=7, target_rel_spread=1e-9))
    assert capped.candidate.n == 7
    slow = TimingSettings(min_repeats=100, max_repeats=1000, max_seconds=0.05, target_rel_spread=1e-9)
    t0 = time.perf_counter()
    run = time_interleaved(lambda: time.sleep(0.01), lambda: None, slow)
    assert time.perf_counter() - t0 < 0.5 and 1 <= run.candidate.n < 10
    assert run.candidate.median >= 0.01 > run.reference.median


def test_the_overhead_budget_stops_a_timing_whose_rounds_cost_far_more_than_its_calls():
    settings = TimingSettings(warmup=0, min_repeats=5, max_repeats=1000, max_seconds=10.0, target_rel_spread=1e-9,
                              overhead_budget_s=0.02)  # fmt: skip
    run = time_interleaved(lambda: None, lambda: None, settings, round_start=lambda: time.sleep(0.004))
    assert 5 <= run.candidate.n <= 7, run.candidate.n  # ~4 ms outside per round: spent by the 6th round
    # rounds whose outside work is cheaper than twice their calls are not cut short
    calls = time_interleaved(lambda: time.sleep(0.002), lambda: None, settings.model_copy(update={"max_repeats": 30}),
                             round_start=lambda: time.sleep(0.003))  # fmt: skip
    assert calls.candidate.n == 30


def test_lock_excludes_another_process(tmp_path):
    path = str(tmp_path / "timing.lock")
    lock = TimingLock(path)
    assert os.stat(path).st_mode & 0o777 == 0o666
    probe = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
        "except BlockingIOError:\n    print('held')\n"
    )

    def probe_says() -> str:
        return subprocess.run([sys.executable, "-c", probe, path], capture_output=True, text=True).stdout.strip()

    with lock.held() as waited:
        assert waited < 1.0
        assert probe_says() == "held"
    assert probe_says() == "free"
    lock.close()


_HOLDER = """
import sys, time
from runtime.sandbox.limits import scrubbed_env
from runtime.timing import TimingLock
lock = TimingLock(sys.argv[1])
mode, hold = sys.argv[2], float(sys.argv[3])
with (lock.held() if mode == "time" else lock.shared()):
    print("in", time.monotonic(), flush=True)
    time.sleep(hold)
    print("out", time.monotonic(), flush=True)
"""


def _hold(path: str, mode: str, seconds: float) -> subprocess.Popen:
    argv = [sys.executable, "-c", _HOLDER, path, mode, str(seconds)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def _entered(proc: subprocess.Popen) -> float:
    word, at = proc.stdout.readline().split()  # type: ignore[union-attr]
    assert word == "in"
    return float(at)


def _finish(proc: subprocess.Popen) -> dict[str, float]:
    """When the holder still to be read went in and came out."""
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0
    return {word: float(at) for word, at in (line.split() for line in out.splitlines())}


def test_a_timing_holds_the_machine_against_compiles_elsewhere(tmp_path):
    path = str(tmp_path / "timing.lock")
    lock = TimingLock(path)
    compiling = _hold(path, "share", 0.5)  # another worker compiles or checks
    _entered(compiling)
    with lock.held() as waited:
        assert waited >= 0.4, "a timing started while another worker was compiling"
    _finish(compiling)
    timing = _hold(path, "time", 0.5)  # another worker times
    _entered(timing)
    with lock.shared() as waited:
        assert waited >= 0.4, "a compile ran while another worker was timing"
    _finish(timing)
    lock.close()


def test_a_waiting_timing_is_not_overtaken_by_compiles(tmp_path):
    path = str(tmp_path / "timing.lock")
    first = _hold(path, "share", 0.6)
    _entered(first)
    timing = _hold(path, "time", 0.3)
    time.sleep(0.2)  # the timer now waits for the first compile
    second = _hold(path, "share", 0.0)
    first_left = _finish(first)["out"]
    timer = _finish(timing)
    assert timer["in"] >= first_left - 0.01
    assert _finish(second)["in"] >= timer["out"] - 0.01, "a compile that came after the timer went before it"


def test_timing_inside_a_share_gives_it_up_and_takes_it_back(tmp_path):
    path = str(tmp_path / "timing.lock")
    lock = TimingLock(path)
    probe = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "for how in (fcntl.LOCK_SH, fcntl.LOCK_EX):\n"
        "    try:\n        fcntl.flock(fd, how | fcntl.LOCK_NB); fcntl.flock(fd, fcntl.LOCK_UN)\n"
        "        print('free', end=' ')\n"
        "    except BlockingIOError:\n        print('held', end=' ')\n"
    )

    def probe_says() -> str:  # can another process share the lock, and hold it?
        return subprocess.run([sys.executable, "-c", probe, path], capture_output=True, text=True).stdout.strip()

    with lock.shared():
        assert probe_says() == "free held"
        with lock.shared(), lock.held() as waited:  # a timing inside the evaluation sharing the machine
            assert waited < 1.0
            assert probe_says() == "held held"
        assert probe_says() == "free held"
    assert probe_says() == "free free"
    lock.close()


def test_pinned_restores_affinity():
    before = os.sched_getaffinity(0)
    with pinned(None) as cores:
        assert os.sched_getaffinity(0) == cores == {max(before)}
    assert os.sched_getaffinity(0) == before
    with pinned(min(before), count=2) as cores:
        assert len(cores) == min(2, len(before)) and os.sched_getaffinity(0) == cores
    assert os.sched_getaffinity(0) == before


_TWO_THREADS = """
import sys, threading
threading.Thread(target=sys.stdin.read, daemon=True).start()  # a second thread, waiting like a team's
sys.stdin.read()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to spread a host over")
def test_pinned_gives_each_of_a_hosts_threads_its_own_core():
    """A kernel's two threads each get a core: free to move, a woken team thread joined its waker's core."""
    allowed = sorted(os.sched_getaffinity(0))
    host = subprocess.Popen([sys.executable, "-c", _TWO_THREADS], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{host.pid}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        tids = sorted(int(t) for t in os.listdir(f"/proc/{host.pid}/task"))
        before = {tid: os.sched_getaffinity(tid) for tid in tids}
        with pinned(allowed[0], count=2, also=[host.pid]) as cores:
            placed = [os.sched_getaffinity(tid) for tid in tids]
            assert all(len(p) == 1 for p in placed) and set().union(*placed) == cores == set(allowed[:2])
            assert os.sched_getaffinity(0) == cores  # this process may use either
        assert {tid: os.sched_getaffinity(tid) for tid in tids} == before
    finally:
        host.kill()
        host.wait()


_SPIN_PROBE = """
import time, numpy as np
a = np.random.default_rng(0).random((384, 384))
for _ in range(5):
    a @ a  # big enough for OpenBLAS to run it on its threads
cpu, wall = time.process_time(), time.perf_counter()
time.sleep(0.1)
print(round((time.process_time() - cpu) / (time.perf_counter() - wall), 3))
"""


def test_the_workers_blas_threads_sleep_after_a_call(tmp_path):
    """A reference's BLAS call leaves no thread spinning on the cores the candidate is timed on next."""
    env = scrubbed_env(2, str(tmp_path))
    out = subprocess.run([sys.executable, "-c", _SPIN_PROBE], env=env, capture_output=True, text=True, check=True)
    assert float(out.stdout) < 0.05, f"the worker's process used {out.stdout.strip()} of a core while idle"

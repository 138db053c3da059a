"""Channels out of a candidate's process, attacked: the worker's pipe to the controller, the worker's log,
the calibration its timings subtract, code written to memory. Evaluated by real sandboxed workers.

Each kernel here is a matmul that computes honestly, so that a hole shows as a forged or inflated result,
a file written, or a log rewritten, never as a wrong answer.
"""

from __future__ import annotations

import os
import pickle
import uuid

import pytest
from runtime_helpers import MATMUL_COMPUTE as COMPUTE
from runtime_helpers import MATMUL_HONEST as HONEST
from runtime_helpers import MATMUL_SIGNATURE as SIGNATURE
from runtime_helpers import make_settings, request, run

from runtime import safe_pickle
from runtime.result import EvalResult, Status
from runtime.sandbox.filters import filter_available
from runtime.settings import TaskSpec

pytestmark = pytest.mark.exclusive  # it measures time

MATMUL = TaskSpec(name="matmul", args={"m": 96, "n": 96, "k": 96})


def _matmul(workdir: str, source: str):
    settings = make_settings(workdir).model_copy(update={"check_trials": 1})
    timing = settings.timing.model_copy(update={"max_seconds": 0.2, "max_repeats": 30})
    return request(workdir, source, settings=settings.model_copy(update={"timing": timing}), task=MATMUL)


def _framed_pickle(marker: str) -> bytes:
    """What ``multiprocessing.Connection.recv`` reads: a big-endian length, then a pickle that runs
    ``touch MARKER`` when it is loaded."""
    payload = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    return len(payload).to_bytes(4, "big") + payload


def _c_bytes(data: bytes) -> str:
    return "".join(f"\\x{b:02x}" for b in data)


# Writes a framed pickle to every descriptor it might have inherited: the worker's pipe to the controller
# would unpickle it there (as root, in `evo run`), and the run's next result would be this one.
WRITES_TO_EVERY_DESCRIPTOR = r"""
#include <string.h>
#include <unistd.h>
static const char forged[] = "%s";
__attribute__((constructor)) static void forge(void) {
    for (int fd = 4; fd < 1024; fd++) (void)!write(fd, forged, sizeof forged - 1);
}
"""


def test_a_kernel_cannot_reach_the_workers_channel_to_the_controller(workdir, pool):
    marker = f"/tmp/evoforge-forged-{uuid.uuid4().hex}"
    cheat = WRITES_TO_EVERY_DESCRIPTOR % _c_bytes(_framed_pickle(marker)) + HONEST
    r = run(pool, _matmul(workdir, cheat), timeout=120)
    after = run(pool, _matmul(workdir, HONEST + "/* after */"), timeout=120)
    assert not os.path.exists(marker), "a candidate's pickle ran in the controller"
    assert r.status is Status.OK and after.status is Status.OK, (r.error, after.error)
    assert after.fitness < 10 * r.fitness, "a forged result shifted the run's results by one"


def test_the_controller_unpickles_only_what_an_answer_is_made_of():
    marker = f"/tmp/evoforge-forged-{uuid.uuid4().hex}"
    with pytest.raises(safe_pickle.UnsafePickle, match="posix.system|os.system"):
        safe_pickle.loads(_framed_pickle(marker)[4:])
    assert not os.path.exists(marker)
    import numpy as np

    result = EvalResult(status=Status.OK, fitness=2.5, metrics={"n": np.float64(3.0)},
                        outputs={"C": np.arange(6, dtype=np.float32).reshape(2, 3)})  # fmt: skip
    back = safe_pickle.loads(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    assert back.fitness == 2.5 and back.metrics["n"] == 3.0 and back.outputs["C"][1, 2] == 5.0


# Clears O_APPEND on what it prints to and overwrites the start of that file: were it the worker's log, the
# output of every candidate before it would be gone.
OVERWRITES_ITS_LOG = r"""
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
__attribute__((constructor)) static void overwrite(void) {
    static const char junk[] = "EVOFORGE-LOG-OVERWRITTEN\n";
    fcntl(1, F_SETFL, 0);
    for (int i = 0; i < 64; i++) (void)!pwrite(1, junk, sizeof junk - 1, i * (sizeof junk - 1));
    printf("EVOFORGE-PRINTED-AFTER\n");
    fflush(stdout);
}
"""


def test_a_kernel_cannot_overwrite_the_workers_log(workdir, pool):
    first = run(pool, _matmul(workdir, HONEST + '/* first */\n#include <stdio.h>\n'
                              '__attribute__((constructor)) static void hi(void) { printf("EVOFORGE-EARLIER\\n"); }'))
    assert first.status is Status.OK, first.error
    r = run(pool, _matmul(workdir, OVERWRITES_ITS_LOG + HONEST), timeout=120)
    assert r.status is Status.OK, r.error
    logs = "".join(open(os.path.join(pool.log_dir, f), errors="replace").read() for f in os.listdir(pool.log_dir))
    assert "EVOFORGE-EARLIER" in logs, "an earlier candidate's output was overwritten"
    assert "EVOFORGE-PRINTED-AFTER" in logs  # what a kernel prints still reaches the log


# Stretches the round trips the worker calibrates on, and no other: it asks for a signal whenever the worker
# writes to its socket, and its handler spins 200 us between its first full-size call (the check's) and the
# next one (timing starts). Were the round trip measured on its own process, the worker would subtract the
# stretch from every timed request and credit the kernel with it.
STRETCHES_ROUND_TRIPS = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
static volatile int full_calls;
static void stall(int sig) {
    (void)sig;
    if (full_calls != 1) return;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do clock_gettime(CLOCK_MONOTONIC, &t);
    while ((t.tv_sec - t0.tv_sec) * 1000000000L + t.tv_nsec - t0.tv_nsec < 200000);
}
__attribute__((constructor)) static void arm(void) {
    struct sigaction sa; memset(&sa, 0, sizeof sa); sa.sa_handler = stall; sa.sa_flags = SA_RESTART;
    sigaction(SIGIO, &sa, 0);
    fcntl(3, F_SETOWN, getpid());
    fcntl(3, F_SETFL, fcntl(3, F_GETFL) | O_ASYNC);
}
"""


def test_a_kernel_cannot_stretch_the_round_trip_its_timings_subtract(workdir, pool):
    honest = run(pool, _matmul(workdir, HONEST + "/* honest */"), timeout=120)
    kernel = f"{SIGNATURE} {{\n    if (M == 96) full_calls++;\n{COMPUTE}}}\n"
    cheat = run(pool, _matmul(workdir, STRETCHES_ROUND_TRIPS + kernel), timeout=120)
    assert honest.status is Status.OK, honest.error
    if cheat.status is Status.OK:  # else it was caught using the CPU outside its calls
        # The stall (200 us) would enter the round trip that every request's time is reduced by. Its fitness is
        # no witness: a naive call lasts about a millisecond, so the stall would lift it 1.25x, and one naive
        # figure drifts up to 2x between evaluations on this kind of shared core.
        assert cheat.metrics["round_trip_s"] < 1e-4, cheat.metrics["round_trip_s"]
    else:
        assert cheat.status is Status.INVALID, cheat


# Its constructor writes code into a memfd and maps it executable: code that is in no source the archive
# keeps. The filter is in force before the library loads, so its constructor cannot.
MAPS_WRITTEN_CODE = r"""
#define _GNU_SOURCE
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>
static int mapped;
__attribute__((constructor)) static void map_code(void) {
    static const unsigned char ret[] = {0xC3};
    int fd = memfd_create("code", 0);
    if (fd < 0) return;
    (void)!write(fd, ret, sizeof ret);
    void *code = mmap(0, 4096, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
    if (code != MAP_FAILED) { ((void (*)(void))code)(); mapped = 1; }
}
"""


@pytest.mark.skipif(not filter_available(), reason="libseccomp is not installed")
def test_a_library_constructor_cannot_map_code_it_wrote(workdir, pool):
    kernel = f"{SIGNATURE} {{\n{COMPUTE}    if (mapped) C[0] = 0.0f / 0.0f;\n}}\n"
    r = run(pool, _matmul(workdir, MAPS_WRITTEN_CODE + kernel), timeout=120)
    assert r.status is Status.OK, r.error


def _landlock() -> bool:
    import ctypes

    return ctypes.CDLL(None, use_errno=True).syscall(444, None, 0, 1) >= 1  # landlock_create_ruleset(VERSION)


# Reads what it can of the files around it: its worker's working directory (where other candidates compile
# and print, as the same user), /tmp (other workers', other runs'), the test's own directory (a run's files).
READS_AROUND = r"""
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
static int seen, tried;
static void try_dir(const char *path) {
    DIR *d = opendir(path);
    if (d) { seen++; printf("EVOFORGE-LISTED %s\n", path); fflush(stdout); closedir(d); }
}
static void around(void) {
    char cwd[512];
    if (getcwd(cwd, sizeof cwd)) try_dir(cwd);
    try_dir(".");
    try_dir("/tmp");
    try_dir("WORKDIR");
    int fd = open("WORKDIR/cache", O_RDONLY | O_DIRECTORY);
    if (fd >= 0) { seen++; close(fd); }
}
"""


@pytest.mark.skipif(not _landlock(), reason="this kernel has no Landlock: files are closed to candidates only by owner")
def test_a_kernel_reads_no_file_outside_the_systems_own_directories(workdir, pool):
    body = f"    if (!tried) {{ tried = 1; around(); }}\n{COMPUTE}    if (seen) C[0] = 0.0f / 0.0f;\n"
    source = READS_AROUND.replace("WORKDIR", workdir) + f"{SIGNATURE} {{\n{body}}}\n"
    r = run(pool, _matmul(workdir, source), timeout=120)
    assert r.status is Status.OK, r.error  # (a kernel still loads libm and reads /proc: see the door test)


# Spins from a timer's handler whenever it is not inside a call, until its first call at the timed size: while
# it is checked, and its worker waits for the timing lock, it takes a core other workers time on; once timed,
# it is quiet. It spins 25 ms in each of its first 8 gaps between calls: on a busy machine a handler can run late,
# in the next request's window (where its CPU counts as the call's), but not in every gap.
SPINS_WHILE_IDLE = r"""
#include <signal.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
static volatile int called, inside, timed, spins, spun_after;
static void spin(int sig) {  /* 25 ms of CPU however busy the machine */
    (void)sig;
    if (!called || inside || timed || spins >= 8 || spun_after == called) return;  /* before a call: constructors' */
    spun_after = called;
    spins++;
    struct timespec t0, t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    do clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    while ((t.tv_sec - t0.tv_sec) * 1000000000L + t.tv_nsec - t0.tv_nsec < 25000000);
}
__attribute__((constructor)) static void arm(void) {
    struct sigaction sa; memset(&sa, 0, sizeof sa); sa.sa_handler = spin; sa.sa_flags = SA_RESTART;
    sigaction(SIGALRM, &sa, 0);
    struct itimerval every = {{0, 1000}, {0, 1000}};
    setitimer(ITIMER_REAL, &every, 0);
}
"""


def test_a_kernel_that_runs_between_its_calls_is_invalid(workdir, pool):
    kernel = (f"{SIGNATURE} {{\n    called++; inside = 1;\n    if (M == 96 && N == 96) timed = 1;\n"
              f"{COMPUTE}    inside = 0;\n}}\n")  # fmt: skip
    r = run(pool, _matmul(workdir, SPINS_WHILE_IDLE + kernel), timeout=120)
    assert r.status is Status.INVALID and "outside its calls" in r.error, r

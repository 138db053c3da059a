"""The trust boundary around candidate code, attacked as a model looking for holes would attack it.

Candidate code runs in a host process of its own (runtime/sandbox/c_host.py, c_host.c): a fresh executable,
under a system-call filter, timed from the worker. Each kernel here tries one way out: read the worker's memory
for the answer, rewrite its own process's clock, slow the reference with a helper thread, leave work
running, write files (the compile cache), open sockets, fork, rewrite code. Each must end non-``ok``,
or ``ok`` with figures no better than the honest kernel's, and an honest kernel evaluated after the
cheats must measure as it did before them. Evaluated by real sandboxed workers (the ``pool`` fixture).
"""

from __future__ import annotations

import os
import platform

import pytest
from runtime_helpers import MATMUL_COMPUTE as COMPUTE
from runtime_helpers import MATMUL_HONEST as HONEST
from runtime_helpers import MATMUL_SIGNATURE as SIGNATURE
from runtime_helpers import make_settings, request, run

from runtime.result import Status
from runtime.sandbox.filters import filter_available
from runtime.settings import TaskSpec

pytestmark = pytest.mark.exclusive  # it measures time

MATMUL = TaskSpec(name="matmul", args={"m": 128, "n": 128, "k": 128})

# Tries every door out of its process once, on its first call (after its library is loaded, so under the
# whole filter); any door that opens is printed to the log and spoils the output.
PROBE = (
    r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <mqueue.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/ipc.h>
#include <sys/mman.h>
#include <sys/msg.h>
#include <sys/sem.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

static int opened;

static void door(const char *what, int ok) {
    if (ok) { opened++; printf("EVOFORGE-DOOR-OPEN %s\n", what); fflush(stdout); }
}

static int parent_of(int pid) {
    char path[64], buf[512]; snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY); if (fd < 0) return -1;
    int n = read(fd, buf, sizeof buf - 1); close(fd); if (n <= 0) return -1; buf[n] = 0;
    char *p = strrchr(buf, ')'); int ppid = -1; if (p) sscanf(p + 2, "%*c %d", &ppid); return ppid;
}

static void *spin(void *arg) { (void)arg; for (;;) {} return 0; }

static void try_doors(void) {
    int worker = getppid(), controller = parent_of(worker);
    char path[64];
    for (int i = 0; i < 2; i++) {
        int pid = i ? controller : worker;
        snprintf(path, sizeof path, "/proc/%d/mem", pid);
        int fd = open(path, O_RDONLY); door(i ? "read the controller's memory" : "read the worker's memory", fd >= 0);
        if (fd >= 0) close(fd);
        char buf[16]; struct iovec local = {buf, sizeof buf}, remote = {(void *)0x400000, sizeof buf};
        door("process_vm_readv", process_vm_readv(pid, &local, 1, &remote, 1, 0) >= 0 || errno != EPERM);
        door("ptrace attach", ptrace(PTRACE_ATTACH, pid, 0, 0) == 0);
        door("signal another process", kill(pid, 0) == 0);
    }
    int s = socket(AF_INET, SOCK_STREAM, 0); door("open a socket", s >= 0);
    int u = socket(AF_UNIX, SOCK_STREAM, 0); door("open a unix socket", u >= 0);
    int f = open("/tmp/evoforge-probe-write", O_WRONLY | O_CREAT, 0600); door("open a file for writing", f >= 0);
    if (f >= 0) { close(f); unlink("/tmp/evoforge-probe-write"); }
    pid_t child = fork(); if (child == 0) _exit(0); door("fork", child > 0);
    if (child > 0) waitpid(child, 0, 0);
    pthread_t t; int started = pthread_create(&t, 0, spin, 0) == 0; door("start a thread", started);
    long page = sysconf(_SC_PAGESIZE);
    void *mem = mmap(0, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    door("make memory executable", mprotect(mem, page, PROT_READ | PROT_EXEC) == 0);
    door("map executable memory",
         mmap(0, page, PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) != MAP_FAILED);
    door("make itself dumpable", prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) == 0);
    /* the machine-wide timing lock opens read-only; holding it (or its gate) would stall every worker */
    int lk = open("/dev/null", O_RDONLY);
    door("take a file lock", lk >= 0 && flock(lk, LOCK_EX | LOCK_NB) == 0);
    if (lk >= 0) close(lk);
    /* descriptors: none but its socket (3) and what it prints to (1, 2) */
    for (int fd = 4; fd < 1024; fd++) if (fcntl(fd, F_GETFD) != -1) { door("an inherited descriptor", 1); break; }
    /* signal-driven I/O on its socket: a handler that runs whenever the worker writes to it */
    door("own its socket's signals", fcntl(3, F_SETOWN, getpid()) == 0);
    door("choose its socket's signal", fcntl(3, F_SETSIG, SIGUSR1) == 0);
    door("asynchronous I/O on its socket", fcntl(3, F_SETFL, fcntl(3, F_GETFL) | O_ASYNC) == 0);
    int on = 1, me = getpid();
    door("FIOASYNC", ioctl(3, FIOASYNC, &on) == 0);
    door("FIOSETOWN", ioctl(3, FIOSETOWN, &me) == 0);
    /* state that outlives it: message queues, System V IPC, code written to memory */
    mqd_t q = mq_open("/evoforge-probe", O_RDWR | O_CREAT, 0600, 0); door("open a message queue", q != (mqd_t)-1);
    if (q != (mqd_t)-1) { mq_close(q); mq_unlink("/evoforge-probe"); }
    int m = msgget(IPC_PRIVATE, 0600); door("a System V message queue", m >= 0);
    if (m >= 0) msgctl(m, IPC_RMID, 0);
    int sem = semget(IPC_PRIVATE, 1, 0600); door("a System V semaphore", sem >= 0);
    if (sem >= 0) semctl(sem, 0, IPC_RMID);
    int mfd = memfd_create("code", 0); door("create a memfd", mfd >= 0);
    if (mfd >= 0) close(mfd);
    /* the page cache as a message board: evicting a shared file's pages, or probing which are in */
    int lib = open("/proc/self/exe", O_RDONLY);
    door("evict pages (fadvise)", lib >= 0 && posix_fadvise(lib, 0, 4096, POSIX_FADV_DONTNEED) == 0);
    char block[4096]; struct iovec one = {block, sizeof block};
    door("probe pages (preadv2)", lib >= 0 && (preadv2(lib, &one, 1, 0, 0) >= 0 || errno != EPERM));
    void *mapped = lib >= 0 ? mmap(0, 4096, PROT_READ, MAP_SHARED, lib, 0) : MAP_FAILED;
    unsigned char resident;
    door("probe pages (mincore)", mapped != MAP_FAILED && (mincore(mapped, 4096, &resident) == 0 || errno != EPERM));
    door("evict pages (madvise)", mapped != MAP_FAILED && madvise(mapped, 4096, MADV_PAGEOUT) == 0);
    if (lib >= 0) close(lib);
    if (syscall(444, 0, 0, 1) >= 1) {  /* Landlock: no file outside the system's directories */
        DIR *here = opendir("."); door("list its worker's working directory", here != 0); if (here) closedir(here);
        DIR *tmp = opendir("/tmp"); door("list /tmp", tmp != 0); if (tmp) closedir(tmp);
    }
    char *argv[] = {"/bin/true", 0};
    door("exec", execv("/bin/true", argv) == 0);
}

static int tried;
"""
    + f"""{SIGNATURE} {{
    if (!tried) {{ tried = 1; try_doors(); }}
{COMPUTE}
    if (opened) C[0] = 0.0f / 0.0f;
}}
"""
)

# Its constructor rewrites its process's clock_gettime so that time runs at 40%, then it computes as the
# honest kernel does. In the worker's process this made every call look 2.5x faster; in its own it must
# change nothing.
CLOCK_PATCH = (
    r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static struct timespec base;
static int patched;

static int slow_clock(clockid_t id, struct timespec *ts) {
    long r = syscall(SYS_clock_gettime, id, ts);
    if (r == 0 && base.tv_sec) {
        double t = (ts->tv_sec - base.tv_sec) + (ts->tv_nsec - base.tv_nsec) * 1e-9;
        t *= 0.4;
        ts->tv_sec = base.tv_sec + (time_t)t;
        ts->tv_nsec = base.tv_nsec + (long)((t - (time_t)t) * 1e9);
        if (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
    }
    return (int)r;
}

__attribute__((constructor)) static void patch_clock(void) {
    syscall(SYS_clock_gettime, CLOCK_MONOTONIC, &base);
    unsigned char *target = (unsigned char *)dlsym(RTLD_DEFAULT, "clock_gettime");
    if (!target) return;
    long page = sysconf(_SC_PAGESIZE);
    unsigned char *start = (unsigned char *)((uintptr_t)target & ~(uintptr_t)(page - 1));
    if (mprotect(start, 2 * page, PROT_READ | PROT_WRITE | PROT_EXEC) != 0) return;
    unsigned char jump[12] = {0x48, 0xB8, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xE0};  /* movabs rax, fn; jmp rax */
    uintptr_t fn = (uintptr_t)slow_clock;
    memcpy(jump + 2, &fn, 8);
    memcpy(target, jump, sizeof jump);
    mprotect(start, 2 * page, PROT_READ | PROT_EXEC);
    patched = 1;
}
"""
    + HONEST
)

# A helper thread that spins whenever the kernel is not running: the reference gets half the core.
SLOW_THE_RIVAL = (
    r"""
#include <pthread.h>
#include <stdatomic.h>

static atomic_int running;
static void *spin(void *arg) {
    (void)arg;
    volatile unsigned long x = 0;
    for (;;) if (!atomic_load(&running)) x++;
    return 0;
}
__attribute__((constructor)) static void start(void) { pthread_t t; pthread_create(&t, 0, spin, 0); }
"""
    + f"""{SIGNATURE} {{
    atomic_store(&running, 1);
{COMPUTE}
    atomic_store(&running, 0);
}}
"""
)


def _matmul(workdir: str, source: str, threads: int = 1):
    task = MATMUL if threads == 1 else TaskSpec(name="matmul", args={**MATMUL.args, "threads": threads})
    settings = make_settings(workdir).model_copy(update={"check_trials": 1})
    timing = settings.timing.model_copy(update={"max_seconds": 0.3, "max_repeats": 40})
    return request(workdir, source, settings=settings.model_copy(update={"timing": timing}), task=task)


needs_filter = pytest.mark.skipif(not filter_available(), reason="libseccomp is not installed")


@needs_filter
def test_every_door_out_of_the_host_is_shut(workdir, pool):
    r = run(pool, _matmul(workdir, PROBE), timeout=120)
    logs = "".join(open(os.path.join(pool.log_dir, f)).read() for f in os.listdir(pool.log_dir))
    opened = [line for line in logs.splitlines() if "EVOFORGE-DOOR-OPEN" in line]
    assert not opened and r.status is Status.OK, (opened, r.error)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the clock patch is x86-64 machine code")
def test_a_rewritten_clock_in_the_candidates_process_changes_nothing(workdir, pool):
    def median_vs_reference(source: str) -> float:
        """Of three evaluations, interleaved with the other kernel's: one evaluation's speed swings by 1.7x on
        a shared 2-core machine, its ratio to the reference timed beside it far less."""
        results = [run(pool, _matmul(workdir, source + f"/* {i} */"), timeout=120) for i in range(3)]
        assert all(r.status is Status.OK for r in results), [r.error for r in results]
        return sorted(r.metrics["vs_reference"] for r in results)[1]

    honest, cheat = median_vs_reference(HONEST), median_vs_reference(CLOCK_PATCH)
    # a clock at 40% would show 2.5x; measured from the worker it is the honest kernel's speed
    assert cheat < 1.6 * honest, (cheat, honest)


def test_a_thread_slowing_the_reference_is_invalid_or_cannot_start(workdir, pool):
    one = run(pool, _matmul(workdir, SLOW_THE_RIVAL), timeout=120)
    if filter_available():  # with threads: 1, no thread can start: the kernel runs alone, honestly
        assert one.status is Status.OK, one.error
    else:
        assert one.status is Status.INVALID, one
    two = run(pool, _matmul(workdir, SLOW_THE_RIVAL + "/* threads: 2 */", threads=2), timeout=120)
    assert two.status is Status.INVALID and "outside its calls" in two.error, two


def test_an_honest_kernel_measures_the_same_after_the_cheats(workdir, pool):
    def honest(tag: str) -> float:
        """The median ``vs_reference`` of three evaluations: one timing of this ~40 us reference varies
        by half from one evaluation to the next on a busy 2-core machine."""
        results = [run(pool, _matmul(workdir, HONEST + f"/* {tag} {i} */"), timeout=120) for i in range(3)]
        assert all(r.status is Status.OK for r in results), [r.error for r in results]
        return sorted(r.metrics["vs_reference"] for r in results)[1]

    before = honest("before")
    for cheat in (PROBE, CLOCK_PATCH, SLOW_THE_RIVAL):
        run(pool, _matmul(workdir, cheat + "/* again */"), timeout=120)
    after = honest("after")
    assert 0.6 < after / before < 1.6, (before, after)

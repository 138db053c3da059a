"""Hostile kernels: each ends with the right status, and the pool keeps serving afterwards."""

from __future__ import annotations

import os
import time

import pytest
from runtime_helpers import CORRECT, VECADD, kernel, make_settings, request, run

from runtime.result import Status
from runtime.sandbox.processes import group_members
from runtime.settings import TaskSpec


@pytest.fixture
def still_serving(pool, workdir):
    """After the test: a good kernel is still evaluated fine."""
    yield
    r = run(pool, request(workdir, kernel(CORRECT)))
    assert r.status is Status.OK, r.error


def test_segfault_is_a_crash(pool, workdir, still_serving):
    r = run(pool, request(workdir, kernel("*(volatile int *)0 = 1;")))
    assert r.status is Status.CRASH and "SIGSEGV" in r.error


def test_infinite_loop_times_out(pool, workdir, still_serving):
    settings = make_settings(workdir, timeout=1.5)
    t0 = time.monotonic()
    r = run(pool, request(workdir, kernel("for (volatile int i = 0;; i++) {}"), settings=settings))
    assert r.status is Status.TIMEOUT and "1.5 s" in r.error
    assert time.monotonic() - t0 < 1.5 + 5  # compile + the wall limit, then the kill


def test_cpu_limit_is_a_timeout(pool, workdir, still_serving):
    settings = make_settings(workdir, timeout=30, cpu_seconds=1)
    r = run(pool, request(workdir, kernel("for (volatile int i = 0;; i++) {}"), settings=settings))
    assert r.status is Status.TIMEOUT and "CPU time limit" in r.error


def test_huge_allocation_fails_inside_the_sandbox(pool, workdir, still_serving):
    body = (
        "size_t sz = (size_t)100 << 30; char *p = malloc(sz);\n"
        "for (size_t i = 0; i < sz; i += 4096) p[i] = 1;\n" + CORRECT
    )
    r = run(pool, request(workdir, kernel(body, "#include <stdlib.h>")))
    # RLIMIT_AS makes malloc fail: writing through NULL segfaults; never the OOM killer (SIGKILL).
    assert r.status in (Status.CRASH, Status.WRONG, Status.INVALID), r
    assert "SIGKILL" not in (r.error or "")


def test_buffers_larger_than_the_file_size_limit_are_shared_and_the_host_cannot_raise_its_limit(
    pool, workdir, still_serving
):
    # 2 MiB per buffer over a 1 MiB file-size limit: the worker shares them anyway (they are memory, bounded by
    # RLIMIT_AS), while the candidate's own hard limit is its soft one, so it cannot write a bigger file.
    settings = make_settings(workdir, max_file_mb=1)
    big = TaskSpec(name=VECADD.name, args={"n": 1 << 19})
    body = ("struct rlimit r; getrlimit(RLIMIT_FSIZE, &r);\n"
            "float bad = r.rlim_max > ((rlim_t)1 << 20) ? 1000.0f : 0.0f;\n"
            "for (int i = 0; i < n; i++) y[i] = a * x[i] + b + bad;")  # fmt: skip
    r = run(pool, request(workdir, kernel(body, "#include <sys/resource.h>"), settings=settings, task=big))
    assert r.status is Status.OK, r.error


@pytest.mark.slow
def test_fork_loop_is_killed_with_its_whole_group(pool, workdir, still_serving):
    settings = make_settings(workdir, timeout=1.5, max_processes=8)
    assert run(pool, request(workdir, kernel(CORRECT), settings=settings)).status is Status.OK
    (pgid,) = pool.worker_pids()
    r = run(pool, request(workdir, kernel("for (;;) fork();", "#include <unistd.h>"), settings=settings))
    assert r.status in (Status.TIMEOUT, Status.CRASH), r
    assert group_members(pgid) == []  # nothing of that worker survives, not even a zombie


def test_worker_runs_unprivileged(pool, workdir, still_serving):
    body = "float bad = getuid() == 0 ? 1000.0f : 0.0f;\nfor (int i = 0; i < n; i++) y[i] = a * x[i] + b + bad;"
    r = run(pool, request(workdir, kernel(body, "#include <unistd.h>")))
    assert r.status is Status.OK, r.error  # as root the worker dropped to nobody; otherwise it kept its uid


def test_worker_cannot_read_the_controllers_files(pool, workdir, still_serving):
    if os.geteuid() != 0:
        pytest.skip("only a root-started worker changes user")
    secret = os.path.join(workdir, "secret.txt")
    with open(secret, "w") as f:
        f.write("x")
    os.chmod(secret, 0o600)
    body = (
        f'float bad = fopen("{secret}", "r") != NULL ? 1000.0f : 0.0f;\n'
        "for (int i = 0; i < n; i++) y[i] = a * x[i] + b + bad;"
    )
    r = run(pool, request(workdir, kernel(body, "#include <stdio.h>")))
    assert r.status is Status.OK, r.error


@pytest.mark.slow
def test_the_working_directories_of_a_killed_pools_workers_are_swept_by_the_next_pool(tmp_path):
    """kill -9 of the process that owns a pool leaves its workers' directories (named for it); the next pool on
    the machine removes them, and leaves a live owner's and any other directory alone."""
    import glob
    import signal
    import subprocess
    import sys
    import tempfile

    from runtime.executors import LocalPool
    from runtime.sandbox.processes import sweep_work_dirs

    here = os.path.dirname(__file__)
    code = (f"import sys, time; sys.path.insert(0, {here!r})\n"
            "from runtime_helpers import CORRECT, kernel, request, run\n"
            "from runtime.executors import LocalPool\n"
            f"run(LocalPool(workers=1), request({str(tmp_path)!r}, kernel(CORRECT)))\n"
            "print('evaluated', flush=True); time.sleep(120)\n")  # fmt: skip
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "evaluated"
        pattern = os.path.join(tempfile.gettempdir(), f"evoforge-worker-{owner.pid}-*")
        left = glob.glob(pattern)
        assert left, "the worker had no working directory named for its owner"
        ours = tempfile.mkdtemp(prefix=f"evoforge-worker-{os.getpid()}-")  # a live owner's
        other = tempfile.mkdtemp(prefix="evoforge-worker-")  # not named for an owner
        # a hostile one, named for the dead owner: a link out of it to a file that must survive the sweep
        keep = tmp_path / "keep.txt"
        keep.write_text("not the sweep's")
        bait = tempfile.mkdtemp(prefix=f"evoforge-worker-{owner.pid}-")
        os.symlink(keep, os.path.join(bait, "link"))
        os.symlink(tmp_path, os.path.join(tempfile.gettempdir(), f"evoforge-worker-{owner.pid}-dirlink"))
        left.append(bait)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    try:
        assert all(os.path.isdir(d) for d in left)  # nothing removed them: their owner died without a word
        LocalPool(workers=1).close()
        assert not any(os.path.exists(d) for d in left)
        assert os.path.isdir(ours) and os.path.isdir(other)
        assert keep.read_text() == "not the sweep's" and tmp_path.is_dir()  # links are never followed
        link = os.path.join(tempfile.gettempdir(), f"evoforge-worker-{owner.pid}-dirlink")
        assert os.path.islink(link)  # a link named like a directory is left alone
        os.unlink(link)
        assert sweep_work_dirs() == []
    finally:
        os.rmdir(ours)
        os.rmdir(other)

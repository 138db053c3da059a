"""LocalPool end to end: real workers, real compiler."""

from __future__ import annotations

import fcntl
import os
import time

import pytest
from runtime_helpers import CORRECT, kernel, make_settings, request, run

from runtime.executors import LocalPool
from runtime.result import Status
from runtime.settings import EvalSettings, TaskSpec
from runtime.toolchain import CompilerNotFound


def test_correct_kernel_is_ok(pool, workdir):
    r = run(pool, request(workdir, kernel(CORRECT)))
    assert r.status is Status.OK, r.error
    assert r.fitness > 0 and r.metrics["vs_reference"] > 0 and r.metrics["ref_fitness"] > 0
    assert r.hardware and r.hardware["compiler"] and r.hardware["id"]
    assert r.timings["overhead_s"] < r.timings["total_s"]


def test_template_genome_and_worker_reuse(pool, workdir):
    run(pool, request(workdir, kernel(CORRECT)))
    before = pool.worker_pids()
    r = run(pool, request(workdir, params={"UNROLL": 4}))
    assert r.status is Status.OK, r.error
    assert pool.worker_pids() == before  # the same long-lived worker served both


def test_compile_error_through_the_pool(pool, workdir):
    r = run(pool, request(workdir, kernel("y[0] = nope;")))
    assert r.status is Status.COMPILE_ERROR and "nope" in r.error


def test_worker_internal_error_comes_back(pool, workdir):
    r = run(pool, request(workdir, kernel(CORRECT), task=TaskSpec(name="vecadd_task:NoSuchTask")))
    assert r.status is Status.INVALID and "internal error" in r.error and "Traceback" in r.error
    assert run(pool, request(workdir, kernel(CORRECT))).status is Status.OK


def test_printf_does_not_corrupt_the_protocol(pool, workdir):
    r = run(pool, request(workdir, kernel('printf("hello from the kernel\\n"); ' + CORRECT, "#include <stdio.h>")))
    assert r.status is Status.OK, r.error
    with open(os.path.join(pool.log_dir, "worker-0.log")) as f:
        assert "hello from the kernel" in f.read()


def test_environment_is_scrubbed(pool, workdir, monkeypatch):
    monkeypatch.setenv("EVOFORGE_TEST_SECRET", "sk-do-not-leak")
    body = (
        'const char *t = getenv("OMP_NUM_THREADS");\n'
        'float bad = (getenv("EVOFORGE_TEST_SECRET") != NULL || !t || strcmp(t, "1")) ? 1000.0f : 0.0f;\n'
        "for (int i = 0; i < n; i++) y[i] = a * x[i] + b + bad;"
    )
    fresh = make_settings(workdir, max_open_files=200)  # another profile: a worker started after setenv
    r = run(pool, request(workdir, kernel(body, "#include <stdlib.h>\n#include <string.h>"), settings=fresh))
    assert r.status is Status.OK, r.error


def test_missing_compiler_fails_in_the_controller(pool, workdir):
    bogus = {**make_settings(workdir).model_dump(), "compiler": {"cc": "/nonexistent/cc"}}
    settings = EvalSettings.model_validate(bogus)
    with pytest.raises(CompilerNotFound):
        pool.submit(request(workdir, kernel(CORRECT), settings=settings))
    assert pool.in_flight == 0


def _blocked_on_flock(pid: int) -> bool:
    with open("/proc/locks") as f:  # a waiter shows as "N: -> FLOCK ADVISORY WRITE <pid> ..."
        return any("->" in line and "FLOCK" in line and line.split()[-4] == str(pid) for line in f)


def test_timing_waits_for_the_machine_wide_lock(pool, workdir):
    settings = make_settings(workdir)
    assert run(pool, request(workdir, kernel(CORRECT), settings=settings)).status is Status.OK
    (pid,) = pool.worker_pids()
    fd = os.open(settings.timing.lock_file, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another worker is timing
    try:
        pool.submit(request(workdir, kernel(CORRECT + " /* lock */"), settings=settings))
        deadline = time.monotonic() + 30
        while not _blocked_on_flock(pid):
            assert time.monotonic() < deadline, "the worker never waited for the timing lock"
            time.sleep(0.02)
        time.sleep(0.3)
        assert pool.next_result(0) is None
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    got = pool.next_result(30)
    assert got is not None and got[1].status is Status.OK
    assert got[1].timings["lock_wait_s"] >= 0.3


def test_two_workers_evaluate_in_parallel(workdir):
    with LocalPool(workers=2, log_dir=os.path.join(workdir, "logs2")) as p:
        assert p.slots == 2
        reqs = [request(workdir, kernel(CORRECT + f" /* {i} */")) for i in range(4)]
        t0 = time.monotonic()
        for r in reqs:
            p.submit(r)
        assert p.in_flight == 4
        results = [p.next_result(60) for _ in reqs]
        assert all(r is not None and r[1].status is Status.OK for r in results)
        assert {r[0].key for r in results} == {r.key for r in reqs}
        assert p.in_flight == 0 and len(p.worker_pids()) == 2
        assert time.monotonic() - t0 < 30

"""The cascade's integrity rules, run in this process on benign kernels (hostile ones: test_sandbox.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from runtime_helpers import CORRECT, VECADD, kernel, make_settings, request

from runtime.backends.kernels import GUARD_BYTES, guarded_empty
from runtime.cascade import evaluate
from runtime.result import Status
from runtime.task import load_task_class

pytestmark = pytest.mark.exclusive  # it measures time


@pytest.fixture(scope="module")
def task(workdir):
    import sys

    from runtime_helpers import HERE

    sys.path.insert(0, HERE)
    return load_task_class(VECADD.name)(VECADD.args)


def _eval(workdir, task, ctx, body, prelude="", **settings_kw):
    req = request(workdir, kernel(body, prelude), settings=make_settings(workdir).model_copy(update=settings_kw))
    return evaluate(req, task, ctx)


def test_guarded_arrays_are_aligned_and_guarded():
    for n in (1, 3, 1000):
        raw, a = guarded_empty((n,), np.float32)
        assert a.ctypes.data % 64 == 0 and a.shape == (n,)
        assert raw.size == n * 4 + 2 * GUARD_BYTES and (raw[:GUARD_BYTES] == 0xA5).all()


def test_correct_kernel_is_ok_with_metrics(workdir, task, ctx):
    r = _eval(workdir, task, ctx, CORRECT)
    assert r.status is Status.OK, r.error
    assert r.fitness > 0 and r.unit == "GB/s"
    m = r.metrics
    assert m["vs_reference"] > 0 and m["ref_fitness"] > 0 and m["n_repeats"] >= 1 and m["flagged"] is False
    assert m["time_min_s"] <= m["time_median_s"]
    for key in ("compile_s", "check_s", "time_s", "total_s", "overhead_s", "calls_s"):
        assert key in r.timings


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ("for (int i = 0; i < n; i++) y[i] = NAN;", Status.WRONG, "NaN in output 'y'"),
        ("", Status.WRONG, "NaN in output 'y'"),  # wrote nothing: the poison shows
        ("for (int i = 0; i < n; i++) y[i] = a * x[i];", Status.WRONG, "max error"),
        (CORRECT + " y[n + 3] = 0;", Status.INVALID, "wrote out of bounds of 'y'"),
        (CORRECT + " y[-1] = 0;", Status.INVALID, "wrote out of bounds of 'y'"),
        (CORRECT + " ((float *)x)[0] += 1;", Status.INVALID, "modified its inputs ('x')"),
    ],
    ids=["nan", "nothing", "wrong-values", "past-the-end", "before-start", "input"],
)
def test_broken_kernels(workdir, task, ctx, body, status, words):
    r = _eval(workdir, task, ctx, body, prelude="#include <math.h>")
    assert r.status is status and words in r.error, r.error
    assert r.fitness is None


def test_wrong_reports_index_expected_and_got(workdir, task, ctx):
    r = _eval(workdir, task, ctx, CORRECT + " if (n > 5) y[5] = 1000.0f;")
    assert r.status is Status.WRONG
    assert "at index (5,)" in r.error and "got 1000.0" in r.error and "seed" in r.error


def test_compile_error(workdir, task, ctx):
    r = _eval(workdir, task, ctx, "y[0] = undefined_variable;")
    assert r.status is Status.COMPILE_ERROR and "undefined_variable" in r.error


def test_implausible_speedup_is_reverified_and_flagged(workdir, task, ctx):
    r = _eval(workdir, task, ctx, CORRECT, implausible_speedup=1.0000001)
    assert r.status is Status.OK and r.metrics["flagged"] is True


def test_kernel_that_stops_working_after_its_checks_is_caught(workdir, task, ctx):
    # Computes while being checked, then skips work on the full size once it has been seen twice:
    # without poisoning between timed calls, the stale correct output would make it look very fast.
    lazy = "static int seen = 0; if (n >= 1000 && ++seen > 2) return; " + CORRECT
    r = _eval(workdir, task, ctx, lazy)
    assert r.status is Status.WRONG and "unwritten on a timed call" in r.error, r.error


def test_kernel_that_writes_garbage_on_later_calls_is_caught(workdir, task, ctx):
    garbage = "{ for (int i = 0; i < n; i++) y[i] = 1; return; }"
    lazy = f"static int seen = 0; if (n >= 1000 && ++seen > 2) {garbage} " + CORRECT
    r = _eval(workdir, task, ctx, lazy)
    assert r.status is Status.WRONG and "on a timed call with fresh inputs" in r.error, r.error
    assert {"check_s", "lock_wait_s", "time_s"} <= set(r.timings)  # caught while timed: its figures are kept


@pytest.mark.parametrize(("stages", "has_check", "has_time"), [("compile", False, False), ("check", True, False)])
def test_partial_cascades_stop_early_without_fitness(workdir, task, ctx, stages, has_check, has_time):
    req = dataclasses.replace(request(workdir, kernel(CORRECT)), stages=stages)
    r = evaluate(req, task, ctx)
    assert r.status is Status.OK and r.fitness is None
    assert ("check_s" in r.timings) is has_check and ("time_s" in r.timings) is has_time
    wrong = dataclasses.replace(request(workdir, kernel("")), stages=stages)
    assert evaluate(wrong, task, ctx).status is (Status.OK if stages == "compile" else Status.WRONG)


SLOW = "for (int r = 0; r < 64; r++) for (int i = 0; i < n; i++) y[i] = a * x[i] + b;"


def test_a_duel_times_the_genome_side_by_side_with_its_rival(workdir, task, ctx):
    fast, slow = request(workdir, kernel(CORRECT)), request(workdir, kernel(SLOW))
    won = evaluate(dataclasses.replace(fast, stages="duel", rival=slow.genome), task, ctx)
    assert won.status is Status.OK, won.error
    assert won.metrics["duel_ratio"] > 2 and won.metrics["duel_rival"] == slow.genome.id and won.fitness > 0
    lost = evaluate(dataclasses.replace(slow, stages="duel", rival=fast.genome), task, ctx)
    assert lost.status is Status.OK and lost.metrics["duel_ratio"] < 0.5


def test_a_duel_checks_the_challenger_again(workdir, task, ctx):
    wrong = request(workdir, kernel("for (int i = 0; i < n; i++) y[i] = a * x[i];"))
    r = evaluate(dataclasses.replace(wrong, stages="duel", rival=request(workdir, kernel(CORRECT)).genome), task, ctx)
    assert r.status is Status.WRONG and "duel_ratio" not in r.metrics

"""Cheating kernels, written as a model looking for holes in the evaluator would write them.

Correct beyond the check set: a kernel right at the timed shape and at small ones, but wrong at other sizes
it may be called at, is ``wrong``.

Memoisation: every timed round sees fresh inputs, and its outputs are checked against the reference's on
the same inputs, so a kernel that remembers an answer gains nothing (keyed on content) or is ``wrong``
(keyed on its buffers' addresses). Each cheat is run beside the honest kernel it copies, in this
process, on a matmul small enough to be quick (n = 128) yet far slower to compute than to copy.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from runtime_helpers import MATMUL_COMPUTE as COMPUTE
from runtime_helpers import MATMUL_HONEST as HONEST
from runtime_helpers import MATMUL_SIGNATURE as SIGNATURE
from runtime_helpers import make_settings

from genome import Genome
from runtime.cascade import evaluate
from runtime.executors import EvalRequest
from runtime.result import Status
from runtime.settings import TaskSpec
from runtime.task import load_task_class

pytestmark = pytest.mark.exclusive  # it measures time

SPEC = TaskSpec(name="matmul", args={"m": 128, "n": 128, "k": 128})
PRELUDE = "#include <stdlib.h>\n#include <string.h>\n"

# Remembers the output of every pair of buffers it was called on (up to 64); copies it when called on the
# same buffers again.
BY_ADDRESS = PRELUDE + f"""
static const float *seen_a[64], *seen_b[64];
static float *saved[64];
static int used;
{SIGNATURE} {{
    size_t bytes = sizeof(float) * (size_t)M * N;
    for (int s = 0; s < used; s++)
        if (seen_a[s] == A && seen_b[s] == B) {{ memcpy(C, saved[s], bytes); return; }}
{COMPUTE}
    if (used < 64) {{
        saved[used] = malloc(bytes); memcpy(saved[used], C, bytes); seen_a[used] = A; seen_b[used] = B; used++;
    }}
}}
"""

# Remembers the output for inputs it has seen, keyed on a few of their values.
BY_CONTENT = PRELUDE + f"""
static float key[4];
static float *saved;
{SIGNATURE} {{
    size_t bytes = sizeof(float) * (size_t)M * N;
    float now[4] = {{A[0], A[M * K - 1], B[0], B[K * N - 1]}};
    if (saved && memcmp(now, key, sizeof now) == 0) {{ memcpy(C, saved, bytes); return; }}
{COMPUTE}
    free(saved); saved = malloc(bytes); memcpy(saved, C, bytes); memcpy(key, now, sizeof now);
}}
"""


def _eval(workdir, ctx, source: str, **kw):
    g = Genome(source=source)
    settings = make_settings(workdir).model_copy(update={"check_trials": 1})
    settings = settings.model_copy(update={"timing": settings.timing.model_copy(update={"max_seconds": 0.3})})
    req = EvalRequest(key=g.id, genome=g, task=SPEC, settings=settings, cache_dir=os.path.join(workdir, "cache"), **kw)
    return evaluate(req, load_task_class(SPEC.name)(SPEC.args), ctx)


def test_memoising_by_address_is_wrong(workdir, ctx):
    honest = _eval(workdir, ctx, HONEST)
    assert honest.status is Status.OK, honest.error
    r = _eval(workdir, ctx, BY_ADDRESS)  # buffers are reused with new contents: by the checks, or each round
    assert r.status is Status.WRONG, r
    assert r.fitness is None


def test_memoising_by_content_gains_nothing(workdir, ctx):
    honest, cheat = _eval(workdir, ctx, HONEST), _eval(workdir, ctx, BY_CONTENT)
    assert honest.status is Status.OK and cheat.status is Status.OK, (honest.error, cheat.error)
    # copying a remembered answer would be ~100x faster; computing it again each round is the honest speed. Each
    # is judged by its ratio to the reference timed beside it: the two evaluations run at different moments (two
    # runs of the same naive loop have read 1.8x apart here), so the bound is far from 100x and from that noise.
    ratios = cheat.metrics["vs_reference"], honest.metrics["vs_reference"]
    assert ratios[0] < 4 * ratios[1], ratios
    assert cheat.metrics["flagged"] is False


def test_a_memoising_challenger_loses_its_duel(workdir, ctx):
    rival = Genome(source=HONEST)
    r = _eval(workdir, ctx, BY_ADDRESS, stages="duel", rival=rival)
    assert r.status is Status.WRONG, r
    c = _eval(workdir, ctx, BY_CONTENT, stages="duel", rival=rival)
    assert c.status is Status.OK and c.metrics["duel_ratio"] < 1.5, c.metrics


# Right at the timed shape (even) and at every shape up to 300 rows; wrong at every odd row count above.
WRONG_AT_ODD_ROWS = f"""
{SIGNATURE} {{
    for (int i = 0; i < M * N; i++) C[i] = 0.0f;
    if (M > 300 && M % 2) return;
    for (int i = 0; i < M; i++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < N; j++) C[i * N + j] += A[i * K + k] * B[k * N + j];
}}
"""


def test_a_kernel_wrong_beyond_the_small_check_shapes_is_wrong(workdir, ctx):
    spec = TaskSpec(name="matmul", args={"m": 1024, "n": 32, "k": 32})
    task = load_task_class(spec.name)(spec.args)
    g = Genome(source=WRONG_AT_ODD_ROWS)
    req = EvalRequest(key=g.id, genome=g, task=spec, settings=make_settings(workdir),
                      cache_dir=os.path.join(workdir, "cache"), stages="check")
    r = evaluate(req, task, ctx)
    assert r.status is Status.WRONG and "'m': " in r.error, r
    honest = evaluate(dataclasses.replace(req, genome=Genome(source=HONEST), key="honest"), task, ctx)
    assert honest.status is Status.OK, honest.error


# Right on typical values, but it "skips zeros" with a threshold that also drops tiny normal values: wrong
# on inputs scaled by 2**-40, which the checks draw beside the typical ones.
FLUSHES_TINY_INPUTS = f"""
{SIGNATURE} {{
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {{
            float s = 0.0f;
            for (int k = 0; k < K; k++) {{
                float a = A[i * K + k], b = B[k * N + j];
                if (a > -1e-6f && a < 1e-6f) continue;   /* "skip zeros": also skips small values */
                s += a * b;
            }}
            C[i * N + j] = s;
        }}
}}
"""


def test_a_kernel_wrong_only_on_tiny_values_is_wrong_and_says_which(workdir, ctx):
    spec = TaskSpec(name="matmul", args={"m": 64, "n": 64, "k": 64})
    task = load_task_class(spec.name)(spec.args)
    g = Genome(source=FLUSHES_TINY_INPUTS)
    req = EvalRequest(key=g.id, genome=g, task=spec, settings=make_settings(workdir),
                      cache_dir=os.path.join(workdir, "cache"), stages="check")  # fmt: skip
    r = evaluate(req, task, ctx)
    assert r.status is Status.WRONG and "with small values" in r.error, r
    honest = evaluate(dataclasses.replace(req, genome=Genome(source=HONEST), key="honest"), task, ctx)
    assert honest.status is Status.OK, honest.error


# Softmax as a textbook writes it, without subtracting the row's max: right on typical inputs, inf / inf
# once a row holds large values.
NAIVE_SOFTMAX = r"""
#include <math.h>
void kernel(int rows, int cols, const float *x, float *y) {
    for (int r = 0; r < rows; r++) {
        float s = 0.0f;
        const float *xr = x + (long)r * cols;
        float *yr = y + (long)r * cols;
        for (int c = 0; c < cols; c++) { yr[c] = expf(xr[c]); s += yr[c]; }
        for (int c = 0; c < cols; c++) yr[c] /= s;
    }
}
"""


def test_a_softmax_that_overflows_on_large_values_is_wrong_and_says_which(workdir, ctx):
    spec = TaskSpec(name="softmax", args={"rows": 32, "cols": 256})
    task = load_task_class(spec.name)(spec.args)
    g = Genome(source=NAIVE_SOFTMAX)
    req = EvalRequest(key=g.id, genome=g, task=spec, settings=make_settings(workdir),
                      cache_dir=os.path.join(workdir, "cache"), stages="check")  # fmt: skip
    r = evaluate(req, task, ctx)
    assert r.status is Status.WRONG and "with large values" in r.error, r
    seed = task.seeds()[0]
    honest = evaluate(dataclasses.replace(req, genome=seed, key=seed.id), task, ctx)
    assert honest.status is Status.OK, honest.error


# Right on typical values at every size; from 48 rows on, it takes zeros of A for ones (a "fast path" that
# only zeros reach): wrong there on inputs with zeros, which the old checks drew only at the tiny shapes.
WRONG_ON_ZEROS_FROM_48 = f"""
{SIGNATURE} {{
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {{
            float s = 0.0f;
            for (int k = 0; k < K; k++) {{
                float a = A[i * K + k];
                if (M >= 48 && a == 0.0f) a = 1.0f;
                s += a * B[k * N + j];
            }}
            C[i * N + j] = s;
        }}
}}
"""


def test_edge_values_are_checked_at_every_size_a_kernel_may_switch_paths_at(workdir, ctx):
    spec = TaskSpec(name="matmul", args={"m": 256, "n": 256, "k": 256})
    task = load_task_class(spec.name)(spec.args)
    g = Genome(source=WRONG_ON_ZEROS_FROM_48)
    req = EvalRequest(key=g.id, genome=g, task=spec, settings=make_settings(workdir),
                      cache_dir=os.path.join(workdir, "cache"), stages="check")  # fmt: skip
    for _ in range(3):  # whatever the sizes drawn (a typical draw may hold an exact zero too, rarely)
        r = evaluate(req, task, ctx)
        assert r.status is Status.WRONG, r


# fp32 in name only: A and B rounded to 14 significant bits before an fp32 product, or quantised to int16 and
# multiplied in integers. Every element alone is within matmul's per-element tolerance; all together are not.
ROUNDED_TO_14_BITS = f"""
#include <stdint.h>
#include <string.h>
static float r14(float x) {{ uint32_t u; memcpy(&u, &x, 4); u = (u + 0x200u) & ~0x3FFu; memcpy(&x, &u, 4); return x; }}
{SIGNATURE} {{
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {{
            float s = 0.0f;
            for (int k = 0; k < K; k++) s += r14(A[i * K + k]) * r14(B[k * N + j]);
            C[i * N + j] = s;
        }}
}}
"""
INT16_FIXED_POINT = f"""
#include <math.h>
#include <stdint.h>
static float amax(const float *x, long n) {{
    float m = 1e-30f;
    for (long i = 0; i < n; i++) m = fmaxf(m, fabsf(x[i]));
    return m;
}}
{SIGNATURE} {{
    float sa = amax(A, (long)M * K) / 32767.0f, sb = amax(B, (long)K * N) / 32767.0f;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {{
            int64_t s = 0;
            for (int k = 0; k < K; k++) s += (int64_t)lrintf(A[i * K + k] / sa) * lrintf(B[k * N + j] / sb);
            C[i * N + j] = (float)s * sa * sb;
        }}
}}
"""


def test_arithmetic_of_fewer_bits_than_fp32_is_wrong(workdir, ctx):
    spec = TaskSpec(name="matmul", args={"m": 96, "n": 96, "k": 512})
    task = load_task_class(spec.name)(spec.args)
    for source in (ROUNDED_TO_14_BITS, INT16_FIXED_POINT):
        g = Genome(source=source)
        req = EvalRequest(key=g.id, genome=g, task=spec, settings=make_settings(workdir),
                          cache_dir=os.path.join(workdir, "cache"), stages="check")  # fmt: skip
        r = evaluate(req, task, ctx)
        assert r.status is Status.WRONG, r  # by the RMS bound, or an element at a tiny K where one is off alone
    honest = evaluate(dataclasses.replace(req, genome=Genome(source=HONEST), key="honest"), task, ctx)
    assert honest.status is Status.OK, honest.error


def test_every_element_of_a_14_bit_gemm_passes_alone_and_all_together_do_not():
    import numpy as np

    from runtime.backends import Failure
    from runtime.backends.kernels import Instance, compare

    task = load_task_class("matmul")({"m": 64, "n": 64, "k": 2048})
    case = {"m": 64, "n": 64, "k": 2048}

    def r14(x: np.ndarray) -> np.ndarray:
        u = x.view(np.uint32)
        return ((u + np.uint32(0x200)) & np.uint32(0xFFFFFC00)).view(np.float32)

    inst = Instance.fresh(task, case)
    inst.arrays = {**inst.inputs, "C": (r14(inst.inputs["A"]).astype(np.float64) @
                                        r14(inst.inputs["B"]).astype(np.float64)).astype(np.float32)}
    task.reference(case, inst.inputs, inst.expected)
    with pytest.raises(Failure, match="relative RMS error"):  # no element alone is outside its tolerance
        compare(task, inst)
    honest = np.zeros((64, 64), np.float32)  # fp32, summed in another order than BLAS: forwards, one term at a time
    for k in range(2048):
        honest += np.outer(inst.inputs["A"][:, k], inst.inputs["B"][k, :])
    inst.arrays["C"] = honest
    compare(task, inst)


# Computes only while it may run on more than one core: a timing pins each of its host's threads to one core,
# the checks leave it two. A kernel that can tell a timing from a check this way is still checked while timed.
SKIPS_WHEN_PINNED_TO_ONE_CORE = f"""
#define _GNU_SOURCE
#include <sched.h>
{SIGNATURE} {{
    cpu_set_t cores;
    if (sched_getaffinity(0, sizeof cores, &cores) == 0 && CPU_COUNT(&cores) == 1) return;
{COMPUTE}
}}
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a two-thread task needs two cores")
def test_a_kernel_that_works_only_when_it_sees_two_cores_is_wrong_when_timed(workdir, ctx):
    spec = TaskSpec(name="matmul", args={"m": 128, "n": 128, "k": 128, "threads": 2})
    g = Genome(source=SKIPS_WHEN_PINNED_TO_ONE_CORE)
    settings = make_settings(workdir).model_copy(update={"check_trials": 1})
    req = EvalRequest(key=g.id, genome=g, task=spec, settings=settings, cache_dir=os.path.join(workdir, "cache"))
    r = evaluate(req, load_task_class(spec.name)(spec.args), ctx)
    assert r.status is Status.WRONG and "timed call" in r.error, r

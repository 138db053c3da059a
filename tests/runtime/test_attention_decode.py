"""The attention_decode task: its kernels against the decoder's numpy attention, in process and in the sandbox."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import make_settings, request, run
from test_tasks import assert_correct, call, compile_kernel, random_points

from genome import Genome
from runtime.result import Status
from runtime.settings import TaskSpec
from runtime.tasks._common import load_c_source
from runtime.tasks.attention_decode import AttentionDecode


@pytest.mark.parametrize("cache", ["fp32", "f16"])
def test_seeds_and_template_points_are_correct(cache: str, tmp_path: Path) -> None:
    task = AttentionDecode({"cache": cache})
    for genome in [*task.seeds(), *random_points(task, 6, seed=3)]:
        assert_correct(task, compile_kernel(task, genome, tmp_path), np.random.default_rng(0))
    inputs = task.inputs(task.full_case(), np.random.default_rng(0))
    assert inputs["k"].dtype == inputs["v"].dtype == (np.float16 if cache == "f16" else np.float32)


def test_threads_share_the_sequences(tmp_path: Path) -> None:
    task = AttentionDecode({"threads": 2})
    assert "-fopenmp" in task.compile_flags()
    assert_correct(task, compile_kernel(task, task.seeds()[-1], tmp_path), np.random.default_rng(1))


@pytest.mark.parametrize(("wrong", "right"), [
    ("j <= pos;", "j <= pos + 1;"),
    ("(long)(h / group)", "(long)(h % kv_heads)"),
], ids=["reads-one-key-past-the-length", "maps-query-heads-to-the-wrong-kv-head"])  # fmt: skip
@pytest.mark.parametrize("cache", ["fp32", "f16"])
def test_a_kernel_that_reads_the_wrong_keys_fails(wrong: str, right: str, cache: str, tmp_path: Path) -> None:
    """A key past a sequence's length (NaN here) or a query head on another head's keys is caught."""
    source = load_c_source("attention_decode_naive.c")
    assert wrong in source
    task = AttentionDecode({"cache": cache})
    fn = compile_kernel(task, Genome(params={}, source=source.replace(wrong, right)), tmp_path)
    with pytest.raises(AssertionError, match="elements off"):
        assert_correct(task, fn, np.random.default_rng(0))


def test_an_fp32_kernel_fails_on_an_f16_cache(tmp_path: Path) -> None:
    """The cache's type reaches the kernel: one that reads halves as floats is caught."""
    task = AttentionDecode({"cache": "f16"})
    fp32 = "#undef KV_F16\n" + load_c_source("attention_decode_template.c")
    fn = compile_kernel(task, Genome(params=task.seeds()[-1].params, source=fp32), tmp_path)
    with pytest.raises(AssertionError, match="elements off"):
        assert_correct(task, fn, np.random.default_rng(0))


@pytest.mark.exclusive  # it compares two timings
def test_the_sandbox_checks_and_times_it(tmp_path: Path, pool) -> None:
    spec = TaskSpec(name="attention_decode", args={"batch": 4, "length": 256})
    point = {"VEC": 8, "KBLOCK": 32, "QTILE": 4}
    template = request(str(tmp_path), task=spec, params=point, settings=make_settings(str(tmp_path)))
    got = run(pool, template, timeout=120)
    assert got.status == Status.OK, got.error
    naive = AttentionDecode().seeds()[0].source
    slow = run(pool, request(str(tmp_path), naive, task=spec), timeout=120)
    # each against the reference timed beside it: a load that comes and goes between the two runs moves both
    assert slow.status == Status.OK and slow.fitness > 0
    assert slow.metrics["vs_reference"] < got.metrics["vs_reference"], (slow.metrics, got.metrics)


def test_a_kernel_whose_rounding_depends_on_its_tile_fails_in_the_sandbox(tmp_path: Path, pool) -> None:
    """Batch invariance is checked bit for bit: a kernel that scales the scores of a full tile by one more ulp is
    well within the tolerance, and its twin rows differ, so it is wrong; the template itself passes."""
    right = "s[r][jj] = dot(q[r], k[r] + (long)(j0 + jj) * d, d) * scale;"
    source = load_c_source("attention_decode_template.c")
    assert right in source
    drifting = source.replace(right, right.replace("* scale;", "* (rows > 4 ? scale * 1.0000001f : scale);"))
    spec = TaskSpec(name="attention_decode", args={"batch": 4, "length": 64})
    point = {"VEC": 8, "KBLOCK": 32, "QTILE": 4}
    got = run(pool, request(str(tmp_path), drifting, params=point, task=spec), timeout=120)
    assert got.status == Status.WRONG and "bit for bit" in got.error, got.error
    assert run(pool, request(str(tmp_path), source, params=point, task=spec), timeout=120).status == Status.OK


_FAST = {"SCORES": "KEYS", "EXP": "POLY", "VALUES": "ROWS"}


@pytest.mark.parametrize("march", ["native", "x86-64-v3"], ids=["this-cpu", "avx2-only"])
@pytest.mark.parametrize("cache", ["fp32", "f16"])
def test_scores_keys_exp_poly_and_values_rows_are_correct_at_every_vector_width(cache: str, march: str,
                                                                                 tmp_path: Path) -> None:  # fmt: skip
    """The template's other choices, each a path of its own (16 halves at once where AVX-512 is, two conversions of 8
    where only AVX2 is), on every check case: within the tolerance, and each chunk's query bit for bit its twin's."""
    task = AttentionDecode({"cache": cache, "threads": 2})
    for vec, kblock, qtile in ((4, 4, 1), (8, 32, 8), (16, 128, 2)):
        genome = Genome(params={"VEC": vec, "KBLOCK": kblock, "QTILE": qtile, **_FAST})
        assert_correct(task, compile_kernel(task, genome, tmp_path, march), np.random.default_rng(vec))


@pytest.mark.parametrize("cache", ["fp32", "f16"])
def test_values_rows_sums_what_axpy_sums_in_the_same_order(cache: str, tmp_path: Path) -> None:
    """VALUES=ROWS keeps a strip of the output in registers instead of memory, and nothing else: the same bits."""
    task = AttentionDecode({"cache": cache, "batch": 3, "length": 100, "queries": 5})
    case = task.full_case()
    inputs = task.inputs(case, np.random.default_rng(0))
    outs = []
    for values in ("AXPY", "ROWS"):
        genome = Genome(params={"VEC": 8, "KBLOCK": 16, "QTILE": 2, "SCORES": "KEYS", "EXP": "POLY", "VALUES": values})
        out = {k: np.empty(shape, dtype) for k, (shape, dtype) in task.outputs(case).items()}
        call(compile_kernel(task, genome, tmp_path), task.kernel_args(case, {**inputs, **out}))
        outs.append(out["out"])
    assert np.isfinite(outs[0]).all() and np.array_equal(outs[0], outs[1])


def test_the_space_scores_keys_only_in_blocks_of_a_vector_or_more() -> None:
    space = AttentionDecode().space()
    assert space.violations({"VEC": 16, "KBLOCK": 4, "QTILE": 1, **_FAST})
    assert not space.violations({"VEC": 16, "KBLOCK": 4, "QTILE": 1, **_FAST, "SCORES": "DOT"})
    points = [space.sample(np.random.default_rng(i)) for i in range(200)]
    assert all(p["KBLOCK"] >= p["VEC"] for p in points if p["SCORES"] == "KEYS")
    assert {p["SCORES"] for p in points} == {"DOT", "KEYS"}

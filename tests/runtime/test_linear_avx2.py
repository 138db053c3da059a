"""The AVX2 siblings of the linear slot's tasks: ``linear_int8_avx2`` (int8 through vpmaddwd)
and ``linear_f32`` (an FMA register tile). They run on every CPU with AVX2 and FMA, this one included, so
their seeds, template points and threads are checked here, and so are the cheats their checks must catch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_tasks import assert_correct, call, compile_kernel, random_points

from genome import Genome
from runtime.hardware import cpu_flags
from runtime.task import Task
from runtime.tasks.linear_f32 import LinearF32, pack_f32, unpack_f32
from runtime.tasks.linear_int8 import int8_linear_reference, pack_int8
from runtime.tasks.linear_int8_avx2 import LinearInt8Avx2, pack_int8_panels, panels_to_quads, quads_to_panels

pytestmark = [pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="this CPU has no AVX2 and FMA"),
              pytest.mark.exclusive]  # it measures time

TASKS = [LinearInt8Avx2(), LinearF32()]
IDS = ["int8_avx2", "f32"]


@pytest.mark.parametrize("task", TASKS, ids=IDS)
def test_seeds_are_correct(task: Task, tmp_path: Path) -> None:
    for genome in task.seeds():
        assert_correct(task, compile_kernel(task, genome, tmp_path), np.random.default_rng(1))


@pytest.mark.parametrize("task", TASKS, ids=IDS)
def test_random_template_points_are_correct(task: Task, tmp_path: Path) -> None:
    for genome in random_points(task, 3, seed=11):
        assert_correct(task, compile_kernel(task, genome, tmp_path), np.random.default_rng(2))


@pytest.mark.parametrize("cls", [LinearInt8Avx2, LinearF32], ids=IDS)
def test_threads_share_the_work(cls: type[Task], tmp_path: Path) -> None:
    task = cls({"threads": 2})
    assert "-fopenmp" in task.compile_flags()
    assert_correct(task, compile_kernel(task, Genome(params=task.tile_seed), tmp_path), np.random.default_rng(3))


def test_int8_avx2_answers_what_linear_int8_answers(tmp_path: Path) -> None:
    """The same quantisation and arithmetic as the VNNI task, bit for bit, on 8-bit weights whose u8 x s8 pairs
    overflow int16 (a kernel through vpmaddubsw's saturating pairs would be off); only W's layout differs."""
    task = LinearInt8Avx2()
    fn = compile_kernel(task, Genome(params=task.tile_seed), tmp_path)
    case = {"m": 9, "k": 64, "n": 16}
    inputs = task.inputs(case, np.random.default_rng(5))
    inputs["x"][:, :] = 4.0  # every q at 255 ...
    inputs["w"][:, 0] = 1.0  # ... and column 0's weights at 127: each pair sums 64770 > 32767
    inputs["wq"], inputs["w_scale"], inputs["w_colsum"] = pack_int8(inputs["w"])
    inputs["wp"] = pack_int8_panels(inputs["w"])[0]
    y = np.full((9, 16), np.nan, np.float32)
    call(fn, task.kernel_args(case, {**inputs, "y": y}))
    np.testing.assert_array_equal(y, int8_linear_reference(inputs["x"], inputs["wq"], inputs["w_scale"],
                                                           inputs["w_colsum"], inputs["bias"]))  # fmt: skip


def test_int8_panels_hold_the_quads_weights() -> None:
    """The AVX2 layout is linear_int8's quantised weights, each where the kernels read it, and back."""
    w = np.random.default_rng(7).uniform(-1, 1, (64, 24)).astype(np.float32)
    wq, scale, colsum = pack_int8(w)
    wp, scale_p, colsum_p = pack_int8_panels(w)
    assert wp.dtype == np.int8 and wp.shape == (3, 16, 8, 4)
    assert np.array_equal(scale, scale_p) and np.array_equal(colsum, colsum_p)
    flat = wp.ravel()
    for kk, j in [(0, 0), (5, 9), (63, 23), (17, 8)]:
        assert flat[(((j // 8) * 16 + kk // 4) * 8 + j % 8) * 4 + kk % 4] == wq[kk // 4, j, kk % 4]
    assert np.array_equal(panels_to_quads(wp), wq) and np.array_equal(quads_to_panels(wq), wp)
    with pytest.raises(ValueError, match="multiple of 8"):
        quads_to_panels(wq[:, :20])


def test_a_bf16_gemm_passes_no_f32_check(tmp_path: Path) -> None:
    """Weights rounded to bf16 are off by 2^-9 relative: every element may be near, all together are not."""
    from runtime.tasks.linear_bf16 import bf16_round

    task = LinearF32()
    case = {"m": 33, "k": 384, "n": 80}
    inputs = task.inputs(case, np.random.default_rng(6))
    want = np.empty((33, 80), np.float32)
    task.reference(case, inputs, {"y": want})
    got = (inputs["x"] @ bf16_round(inputs["w"]) + inputs["bias"]).astype(np.float32)
    rel = np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))
    assert rel > task.rms_tolerance(case)


def test_f32_panels_round_trip() -> None:
    w = np.arange(24 * 16, dtype=np.float32).reshape(24, 16)
    wp = pack_f32(w)
    assert wp.shape == (2, 24, 8) and wp[1, 3, 5] == w[3, 13]
    np.testing.assert_array_equal(unpack_f32(wp), w)

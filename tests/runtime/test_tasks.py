"""The built-in tasks compile with the system C compiler and match their references on odd sizes."""

from __future__ import annotations

import ctypes
import os
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from genome import EVOLVE_END, EVOLVE_START, Genome, evolve_blocks
from runtime.backends.kernels import check_plan, within_tolerance
from runtime.task import Task, load_task_class
from runtime.tasks.matmul import Matmul
from runtime.tasks.softmax import Softmax

KernelFn = Callable[..., None]


def compile_kernel(task: Task, genome: Genome, tmp_path: Path, march: str = "native") -> KernelFn:
    """Builds ``task.render(genome)`` for ``-march=<march>`` into a shared object and returns its ``kernel`` via
    ctypes."""
    src = tmp_path / f"{march}-{genome.id[:16]}.c"
    lib = src.with_suffix(".so")
    src.write_text(task.render(genome))
    cmd = ["cc", "-O3", f"-march={march}", "-shared", "-fPIC", *task.compile_flags(), str(src), "-o", str(lib)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return getattr(ctypes.CDLL(str(lib)), task.kernel_name)


def call(fn: KernelFn, args: list) -> None:
    def c(a):
        if isinstance(a, np.ndarray):
            return a.ctypes.data_as(ctypes.c_void_p)
        return ctypes.c_float(a) if isinstance(a, float) else ctypes.c_int(a)

    fn(*[c(a) for a in args])


def assert_correct(task: Task, fn: KernelFn, rng: np.random.Generator) -> None:
    """Runs every check case against the reference, on each of the task's value kinds, with its tolerance."""
    for case, kind in check_plan(task, 1):
        inputs = task.inputs_of_kind(case, rng, kind)
        got = {k: np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -1, dtype)
               for k, (shape, dtype) in task.outputs(case).items()}
        want = {k: np.empty(shape, dtype) for k, (shape, dtype) in task.outputs(case).items()}
        call(fn, task.kernel_args(case, {**inputs, **got}))
        task.reference(case, inputs, want)
        rtol, atol = task.tolerance(case)
        scales = task.error_scale(case, inputs, want) or {}
        for name in set(want) - set(task.judged):
            ok = within_tolerance(got[name], want[name], rtol, atol, scales.get(name))
            assert ok.all(), f"{name} at {case} with {kind} values: {int((~ok).sum())} of {ok.size} elements off"
        why = task.judge(case, inputs, want, got)
        assert why is None, f"at {case} with {kind} values: {why}"
        for name, pairs in task.twin_rows(case).items():
            for a, b in pairs:
                same = np.array_equal(got[name][a], got[name][b], equal_nan=True)
                assert same, f"{name} rows {a}, {b} differ at {case}"


def random_points(task: Task, count: int, seed: int) -> list[Genome]:
    rng = np.random.default_rng(seed)
    return [Genome(params=task.space().sample(rng)) for _ in range(count)]


@pytest.mark.parametrize("name", ["matmul", "softmax"])
def test_builtin_names_load(name: str) -> None:
    cls = load_task_class(name)
    task = cls()
    assert task.kernel_name == "kernel"
    assert task.render(task.seeds()[1]).count("void kernel(") == 1


@pytest.mark.parametrize("task", [Matmul(), Softmax()], ids=["matmul", "softmax"])
def test_sources_carry_evolve_blocks_and_the_signature(task: Task) -> None:
    for genome in task.seeds():
        source = genome.source if genome.source is not None else task.template()
        assert EVOLVE_START in source and EVOLVE_END in source
        assert evolve_blocks(source)
        assert task.signature in source
        assert not task.space().violations(genome.params) or genome.source is not None


@pytest.mark.parametrize("task", [Matmul(), Softmax()], ids=["matmul", "softmax"])
def test_seeds_are_correct(task: Task, tmp_path: Path) -> None:
    for genome in task.seeds():
        assert_correct(task, compile_kernel(task, genome, tmp_path), np.random.default_rng(1))


@pytest.mark.parametrize(("task", "count"), [(Matmul(), 12), (Softmax(), 12)], ids=["matmul", "softmax"])
def test_random_template_points_are_correct(task: Task, count: int, tmp_path: Path) -> None:
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # the compiler dominates: one per core
        kernels = list(pool.map(lambda g: compile_kernel(task, g, tmp_path), random_points(task, count, seed=7)))
    for fn in kernels:
        assert_correct(task, fn, np.random.default_rng(2))


@pytest.mark.parametrize("cls", [Matmul, Softmax], ids=["matmul", "softmax"])
def test_threads_build_with_openmp(cls: type[Task], tmp_path: Path) -> None:
    task = cls({"threads": 2})
    assert task.compile_flags() == ["-fopenmp"]
    assert cls().compile_flags() == []
    assert_correct(task, compile_kernel(task, random_points(task, 1, seed=3)[0], tmp_path), np.random.default_rng(3))


def test_matmul_full_case_and_measures() -> None:
    task = Matmul({"m": 1000, "n": 1000, "k": 1000})
    case = task.full_case()
    assert case == {"m": 1000, "n": 1000, "k": 1000}
    assert task.work(case) == pytest.approx(2.0)
    genome = task.seeds()[1]
    descriptors = task.descriptors()
    assert {"source_lines", "register_tile_area", "cache_block_kib"} <= descriptors.keys()
    area = descriptors["register_tile_area"]
    assert area.low <= area.fn(genome, {}) <= area.high
    kib = descriptors["cache_block_kib"]
    assert kib.low <= kib.fn(genome, {}) <= kib.high


def test_matmul_space_keeps_register_tiles_in_registers() -> None:
    space = Matmul().space()
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = space.sample(rng)
        assert p["MC"] % p["MR"] == 0 and p["NC"] % p["NR"] == 0
        assert p["MR"] * p["NR"] <= 28 * 16


def test_softmax_measures() -> None:
    task = Softmax()
    assert task.full_case() == {"rows": 4096, "cols": 1024}
    assert task.work(task.full_case()) == pytest.approx(4096 * 1024 * 8 / 1e9)
    assert {"vector_width", "rows_per_block"} <= task.descriptors().keys()


def test_value_kinds_reshape_float_inputs_only() -> None:
    from runtime.task import VALUE_KINDS

    task = Matmul({"m": 64, "n": 64, "k": 64})
    rng = np.random.default_rng(1)
    case = {"m": 40, "n": 30, "k": 50}
    typical = task.inputs_of_kind(case, np.random.default_rng(7), "typical")["A"]
    large = task.inputs_of_kind(case, np.random.default_rng(7), "large")["A"]
    assert np.abs(large).max() > 1e11 * np.abs(typical).max()
    assert np.abs(task.inputs_of_kind(case, rng, "small")["A"]).max() < 1e-10
    zeros = task.inputs_of_kind(case, rng, "zeros")["A"]
    assert 0.2 < np.mean(zeros == 0) < 0.5
    signed = task.inputs_of_kind(case, rng, "signed_zeros")["A"]
    z = signed[signed == 0]
    assert np.signbit(z).any() and (~np.signbit(z)).any()
    sub = task.inputs_of_kind(case, rng, "denormals")["A"]
    tiny = np.finfo(np.float32).smallest_normal
    assert 0.2 < np.mean((sub != 0) & (np.abs(sub) < tiny)) < 0.5
    assert set(task.value_kinds()) == set(VALUE_KINDS)
    with pytest.raises(ValueError, match="unknown value kind"):
        task.inputs_of_kind(case, rng, "huge")


def test_check_plan_covers_every_value_kind_at_every_size_checked() -> None:
    from runtime.backends.kernels import check_plan

    task = Matmul({"m": 64, "n": 64, "k": 64})
    plan = check_plan(task, 1)
    assert {kind for _, kind in plan} == set(task.value_kinds())
    big = Matmul({"m": 1024, "n": 1024, "k": 1024})
    for _ in range(5):
        plan = check_plan(big, 3)
        sizes = {tuple(c.values()) for c, kind in plan if kind == "typical"}
        first_draw = {tuple(c.values()) for c, kind in plan if kind == "zeros"}
        assert len(first_draw) >= len(sizes) // 3 and max(m for m, _, _ in first_draw) >= 127
        for kind in ("large", "small", "zeros", "signed_zeros"):  # every size of the draw, the largest included
            assert {tuple(c.values()) for c, k in plan if k == kind} == first_draw
        subnormal = [big.work(c) for c, k in plan if k == "denormals"]
        assert len(subnormal) >= 7 and max(subnormal) > big.work({"m": 64, "n": 64, "k": 64})


def test_matmul_error_scale_forgives_cancellation_not_a_missing_term() -> None:
    from runtime.backends.kernels import within_tolerance

    task = Matmul({"m": 64, "n": 64, "k": 64})
    rng = np.random.default_rng(3)
    case = {"m": 32, "n": 32, "k": 512}
    inputs = task.inputs_of_kind(case, rng, "large")
    a64, b64 = inputs["A"].astype(np.float64), inputs["B"].astype(np.float64)
    exact = a64 @ b64
    honest = np.zeros((32, 32), np.float32)  # fp32, summed in another order than BLAS: backwards
    for k in range(511, -1, -1):
        honest += np.outer(inputs["A"][:, k], inputs["B"][k, :])
    expected = {"C": inputs["A"] @ inputs["B"]}
    scale = task.error_scale(case, inputs, expected)["C"]
    rtol, atol = task.tolerance(case)
    assert within_tolerance(honest, expected["C"], rtol, atol, scale).all()
    missing = (exact - np.outer(a64[:, 7], b64[7, :])).astype(np.float32)  # one term left out
    assert not within_tolerance(missing, expected["C"], rtol, atol, scale).all()

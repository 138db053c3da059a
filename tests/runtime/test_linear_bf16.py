"""The ``linear_bf16`` task: its bf16 helpers, its seeds and template points (AVX512 and AMX) on every check
case, and a tolerance that rejects kernels that are slightly wrong."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from genome import EVOLVE_END, EVOLVE_START, Genome, evolve_blocks
from runtime.hardware import cpu_flags
from runtime.settings import CompilerSettings
from runtime.task import Case, load_task_class
from runtime.tasks.linear_bf16 import (
    MINILM_SHAPES,
    LinearBf16,
    bf16_bits,
    bf16_round,
    pack_bf16,
    unpack_bf16,
)
from runtime.toolchain import CKernel, compile_source, load_kernel

pytestmark = pytest.mark.exclusive  # it measures time

HAS_AMX = "amx_bf16" in Path("/proc/cpuinfo").read_text()
AVX512 = {"ISA": "AVX512", "KU": 1, "AMX_MT": 1, "AMX_NT": 1, "AMX_PANEL": 32}
AMX = {"ISA": "AMX", "MR": 4, "NR": 2, "KU": 1}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where the kernels are compiled: only on a CPU that runs them (their flags make even the scalar loops
    AVX-512 code: elsewhere they die of SIGILL)."""
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("this CPU has no AVX512-BF16: linear_bf16's kernels cannot run here")
    return str(tmp_path_factory.mktemp("linear_bf16"))


@pytest.fixture
def build(cache_dir: str) -> Iterator:
    """Compiles a source with the project's C backend and flags; the kernels are closed after the test."""
    loaded: list[CKernel] = []

    def _build(source: str) -> CKernel:
        lib = compile_source(
            source, compiler=CompilerSettings(), extra_flags=LinearBf16().compile_flags(), cache_dir=cache_dir
        )
        loaded.append(load_kernel(lib.path, "kernel"))
        return loaded[-1]

    yield _build
    for kernel in loaded:
        kernel.close()


def run_case(task: LinearBf16, kernel: CKernel, case: Case, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's output (on a NaN-filled buffer) and the reference's, for fresh inputs."""
    inputs = task.inputs(case, rng)
    got = np.full((case["m"], case["n"]), np.nan, np.float32)
    want = np.empty_like(got)
    kernel.bind(task.kernel_args(case, {**inputs, "y": got}))()
    task.reference(case, inputs, {"y": want})
    return got, want


def assert_correct(task: LinearBf16, kernel: CKernel, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for case in task.check_cases(rng):
        got, want = run_case(task, kernel, case, rng)
        rtol, atol = task.tolerance(case)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"case {case}")


# --- the numpy helpers ------------------------------------------------------------------------------


def bf16_bits_reference(a: np.ndarray) -> np.ndarray:
    """Round to nearest even, spelled out bit by bit: keep the upper half, go up past the halfway point or
    at it when the kept half is odd."""
    out = []
    for b in np.asarray(a, np.float32).reshape(-1).view(np.uint32).tolist():
        kept, rest = b >> 16, b & 0xFFFF
        if (b & 0x7F800000) == 0x7F800000 and b & 0x7FFFFF:
            out.append(0x7FC0)  # NaN
            continue
        out.append(kept + 1 if rest > 0x8000 or (rest == 0x8000 and kept & 1) else kept)
    return np.array(out, np.uint16)


def test_bf16_round_matches_the_bit_level_reference() -> None:
    rng = np.random.default_rng(0)
    random = rng.standard_normal(4000).astype(np.float32) * np.float32(2.0) ** rng.integers(-20, 20, 4000)
    ties = (random.view(np.uint32) & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # exactly halfway, odd and even
    edges = np.array(
        [0.0, -0.0, 1.0, -1.0, 1.00390625, 1.01171875, 3.4028235e38, 1e-40, -1e-45, np.inf, -np.inf, np.nan],
        np.float32,
    )
    values = np.concatenate([random, ties.view(np.float32), edges])
    np.testing.assert_array_equal(bf16_bits(values), bf16_bits_reference(values))
    rounded = bf16_round(values)
    assert rounded.dtype == np.float32
    np.testing.assert_array_equal(rounded.view(np.uint32), bf16_bits_reference(values).astype(np.uint32) << 16)
    assert bf16_round(np.float32([1.00390625]))[0] == 1.0  # a tie goes to the even neighbour
    assert bf16_round(np.float32([1.01171875]))[0] == 1.015625  # and up when that one is even
    assert np.isinf(bf16_round(np.float32([3.4028235e38]))[0])  # past the largest bf16


def test_pack_bf16_layout_round_trips() -> None:
    k, n = 64, 48
    w = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32)
    wp = pack_bf16(w)
    assert wp.dtype == np.uint16 and wp.shape == (k // 2, n, 2) and wp.flags.c_contiguous
    flat, bits = wp.reshape(-1), bf16_bits(w)
    for kk, j in [(0, 0), (1, 0), (0, 1), (2, 5), (63, 47), (17, 30)]:
        assert flat[((kk // 2) * n + j) * 2 + kk % 2] == bits[kk, j]
    np.testing.assert_array_equal(unpack_bf16(wp, k, n), bf16_round(w))
    np.testing.assert_array_equal(pack_bf16(unpack_bf16(wp, k, n)), wp)
    with pytest.raises(ValueError, match="even"):
        pack_bf16(np.zeros((3, 16), np.float32))


# --- the task ---------------------------------------------------------------------------------------


def test_registered_with_sizes_cases_and_measures() -> None:
    task = load_task_class("linear_bf16")()
    assert isinstance(task, LinearBf16)
    case = task.full_case()
    assert case == {"m": 256, "k": 384, "n": 1536}
    assert task.work(case) == pytest.approx(2 * 256 * 384 * 1536 / 1e9)
    cases = task.check_cases(np.random.default_rng(0))
    assert {c["m"] for c in cases} >= {1, 7, 33, 256}
    assert set(MINILM_SHAPES) <= {(c["k"], c["n"]) for c in cases}
    assert all(c["k"] % 32 == 0 and c["n"] % 16 == 0 and c["m"] >= 1 for c in cases)
    with pytest.raises(ValueError, match="k % 32"):
        LinearBf16({"k": 48})
    with pytest.raises(ValueError, match="n % 16"):
        LinearBf16({"n": 100})
    area = task.descriptors()["c_block_floats"]
    assert area.fn(task.seeds()[1], {}) == 6 * 4 * 16
    assert area.fn(Genome(params={**task.seeds()[1].params, "ISA": "AMX"}), {}) == 2 * 2 * 256


def test_sources_carry_evolve_blocks_and_the_signature() -> None:
    task = LinearBf16()
    for genome in task.seeds():
        source = genome.source if genome.source is not None else task.template()
        assert EVOLVE_START in source and EVOLVE_END in source and evolve_blocks(source)
        assert task.signature in source
        assert genome.source is not None or not task.space().violations(genome.params)


def test_seeds_are_correct(build) -> None:
    task = LinearBf16()
    for genome in task.seeds():
        assert_correct(task, build(task.render(genome)), seed=2)


@pytest.mark.parametrize(("mr", "nr"), [(1, 4), (7, 3), (14, 2), (16, 1)])
def test_avx512_tiles_are_correct(build, mr: int, nr: int) -> None:
    task = LinearBf16()
    params = {**AVX512, "MR": mr, "NR": nr, "KU": 4 if mr < 8 else 1}
    assert not task.space().violations(params)
    assert_correct(task, build(task.render(Genome(params=params))), seed=3)


@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-BF16")
@pytest.mark.parametrize(("mt", "nt", "panel"), [(2, 2, 32), (1, 3, 64), (2, 1, 128), (1, 1, 32)])
def test_amx_blocks_are_correct(build, mt: int, nt: int, panel: int) -> None:
    task = LinearBf16()
    params = {**AMX, "AMX_MT": mt, "AMX_NT": nt, "AMX_PANEL": panel}
    assert not task.space().violations(params)
    assert_correct(task, build(task.render(Genome(params=params))), seed=4)


def test_amx_falls_back_to_avx512_without_permission(build) -> None:
    """A refused AMX request runs the AVX512 path of the same kernel (no SIGILL)."""
    task = LinearBf16()
    source = task.render(Genome(params={**AMX, "AMX_MT": 2, "AMX_NT": 2, "AMX_PANEL": 32}))
    assert_correct(task, build("#define LINEAR_BF16_NO_AMX 1\n" + source), seed=5)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("acc + bias[j]", "acc"),  # bias dropped
        ("kk < k;", "kk < k - 32;"),  # last 32-wide k block dropped
        ("(u + 0x7fffu + ((u >> 16) & 1u))", "u"),  # x truncated to bf16 instead of rounded
        ("(u + 0x7fffu + ((u >> 16) & 1u))", "(u + 0x8000u)"),  # ties rounded away from zero
    ],
    ids=["no-bias", "short-k", "truncated-x", "ties-away"],
)
def test_tolerance_rejects_a_wrong_kernel(build, old: str, new: str) -> None:
    task = LinearBf16()
    source = task.seeds()[0].source
    assert source is not None and old in source
    kernel = build(source.replace(old, new))
    rng = np.random.default_rng(6)
    case = {"m": 7, "k": 384, "n": 384}
    got, want = run_case(task, kernel, case, rng)
    rtol, atol = task.tolerance(case)
    assert not np.allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("isa", ["AVX512", "AMX"])
def test_threads_build_with_openmp(cache_dir: str, isa: str) -> None:
    """With threads > 1 both paths share their blocks among OpenMP threads (AMX: each configures its tiles)."""
    if isa == "AMX" and not HAS_AMX:
        pytest.skip("this CPU has no AMX-BF16")
    task = LinearBf16({"threads": 2})
    assert "-fopenmp" in task.compile_flags() and "-fopenmp" not in LinearBf16().compile_flags()
    params = {**AVX512, **AMX, "ISA": isa, "AMX_MT": 2, "AMX_NT": 2}
    lib = compile_source(
        task.render(Genome(params=params)),
        compiler=CompilerSettings(),
        extra_flags=task.compile_flags(),
        cache_dir=cache_dir,
    )
    # Left loaded: unloading a library built with -fopenmp while libgomp's threads live crashes the process
    # at exit (CKernel.close dlcloses; test_tasks.py keeps its OpenMP kernels loaded too).
    assert_correct(task, load_kernel(lib.path, "kernel"), seed=7)

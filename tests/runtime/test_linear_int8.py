"""The ``linear_int8`` task: its quantisation and packing helpers, its seeds and template points (VNNI and AMX)
on every check case, and a tolerance that rejects kernels that are slightly wrong."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from genome import EVOLVE_END, EVOLVE_START, Genome, evolve_blocks
from runtime.hardware import cpu_flags
from runtime.settings import CompilerSettings
from runtime.task import Case, load_task_class
from runtime.tasks.linear_bf16 import MINILM_SHAPES
from runtime.tasks.linear_int8 import LinearInt8, int8_linear_reference, pack_int8, quantize_rows, unpack_int8
from runtime.toolchain import CKernel, compile_source, load_kernel

pytestmark = pytest.mark.exclusive  # it measures time

HAS_AMX = "amx_int8" in Path("/proc/cpuinfo").read_text()
VNNI = {"ISA": "VNNI", "KU": 1, "AMX_MT": 1, "AMX_NT": 1, "PANEL": 32}
AMX = {"ISA": "AMX", "MR": 4, "NR": 2, "KU": 1}
F32 = np.float32


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where the kernels are compiled: only on a CPU that runs them (their flags make even the scalar loops
    AVX-512 code: elsewhere they die of SIGILL)."""
    if "avx512_vnni" not in cpu_flags():
        pytest.skip("this CPU has no AVX512-VNNI: linear_int8's kernels cannot run here")
    return str(tmp_path_factory.mktemp("linear_int8"))


@pytest.fixture
def build(cache_dir: str) -> Iterator:
    """Compiles a source with the project's C backend and flags; the kernels are closed after the test."""
    loaded: list[CKernel] = []

    def _build(source: str) -> CKernel:
        lib = compile_source(
            source, compiler=CompilerSettings(), extra_flags=LinearInt8().compile_flags(), cache_dir=cache_dir
        )
        loaded.append(load_kernel(lib.path, "kernel"))
        return loaded[-1]

    yield _build
    for kernel in loaded:
        kernel.close()


def run_case(task: LinearInt8, kernel: CKernel, case: Case, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's output (on a NaN-filled buffer) and the reference's, for fresh inputs."""
    inputs = task.inputs(case, rng)
    got = np.full((case["m"], case["n"]), np.nan, np.float32)
    want = np.empty_like(got)
    kernel.bind(task.kernel_args(case, {**inputs, "y": got}))()
    task.reference(case, inputs, {"y": want})
    return got, want


def assert_correct(task: LinearInt8, kernel: CKernel, seed: int) -> None:
    """Every check case within the task's tolerance; the integer part is exact, so in fact bit for bit."""
    rng = np.random.default_rng(seed)
    for case in task.check_cases(rng):
        got, want = run_case(task, kernel, case, rng)
        rtol, atol = task.tolerance(case)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"case {case}")
        np.testing.assert_array_equal(got, want, err_msg=f"case {case}")


# --- the numpy helpers ------------------------------------------------------------------------------


def quantize_row_scalar(row: np.ndarray) -> tuple[list[int], F32, int]:
    """One row, spelled out with fp32 scalars and Python's round (half to even)."""
    lo, hi = min(F32(0), *row), max(F32(0), *row)
    s = F32(hi - lo) / F32(255)
    s = F32(1) if s == 0 else s
    inv = F32(1) / s
    z = round(float(F32(-lo) * inv))
    return [min(255, max(0, round(float(v * inv)) + z)) for v in row], s, z


def test_quantize_rows_matches_the_scalar_statement() -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(-4, 4, (9, 64)).astype(F32)
    x[1], x[2], x[3], x[4] = np.abs(x[1]), -np.abs(x[2]), 0.0, 2.5
    x[5] = rng.uniform(-1e-3, 3e-3, 64)
    q, s, z = quantize_rows(x)
    assert q.dtype == np.uint8 and s.dtype == np.float32 and z.dtype == np.int32 and q.shape == x.shape
    for i, row in enumerate(x):
        want_q, want_s, want_z = quantize_row_scalar(row)
        assert q[i].tolist() == want_q and s[i] == want_s and z[i] == want_z, f"row {i}"
    assert z[1] == 0 and q[1].max() == 255  # all positive: lo clamps to 0, the largest value is 255
    assert z[2] == 255 and q[2].min() == 0  # all negative: hi clamps to 0
    assert s[3] == 1.0 and z[3] == 0 and not q[3].any()  # all zero: s == 0 becomes 1
    assert z[4] == 0 and (q[4] == 255).all()  # constant: the clamp at 255
    assert q[0].min() == 0 and q[0].max() == 255


def test_quantize_rows_rounds_ties_to_even() -> None:
    """lo = -127/32 and hi = 4 make s = 1/32 exactly (z = 127): (i + 1/2)/32 lands on ties."""
    row = np.array([-127 / 32, 4.0, 0.5 / 32, 1.5 / 32, 2.5 / 32, -0.5 / 32, -1.5 / 32, -2.5 / 32], F32)
    q, s, z = quantize_rows(np.tile(row, (1, 8)))
    assert s[0] == F32(1 / 32) and z[0] == 127
    assert q[0, :8].tolist() == [0, 255, 127, 129, 129, 127, 125, 125]


def test_pack_int8_layout_scales_and_column_sums() -> None:
    k, n = 64, 48
    rng = np.random.default_rng(1)
    w = rng.uniform(-1, 1, (k, n)).astype(F32)
    w[:, 5] = 0.0
    w[:4, 7] = (127.0, 2.5, 3.5, -2.5)  # scale 1: ties to even
    w[4:, 7] = 0.0
    wq, scale, colsum = pack_int8(w)
    assert wq.dtype == np.int8 and wq.shape == (k // 4, n, 4) and wq.flags.c_contiguous
    assert scale.dtype == np.float32 and colsum.dtype == np.int32
    plain = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    flat = wq.reshape(-1)
    for kk, j in [(0, 0), (1, 0), (3, 0), (4, 0), (0, 1), (2, 5), (63, 47), (17, 30)]:
        assert flat[((kk // 4) * n + j) * 4 + kk % 4] == plain[kk, j]
    np.testing.assert_array_equal(unpack_int8(wq), plain)
    np.testing.assert_array_equal(scale, np.abs(w).max(axis=0) / F32(127) + (np.abs(w).max(axis=0) == 0))
    assert scale[5] == 1.0 and not plain[:, 5].any()
    assert plain[:4, 7].tolist() == [127, 2, 4, -2]
    assert np.abs(plain).max(axis=0).tolist() == [0 if j == 5 else 127 for j in range(n)]
    np.testing.assert_array_equal(colsum, plain.astype(np.int64).sum(axis=0))
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_int8(np.zeros((6, 16), F32))


def test_reference_is_the_integer_gemm_and_near_fp32() -> None:
    rng = np.random.default_rng(2)
    x = rng.uniform(-4, 4, (5, 128)).astype(F32)
    w = rng.uniform(-1, 1, (128, 32)).astype(F32)
    bias = rng.uniform(-1, 1, 32).astype(F32)
    wq, scale, colsum = pack_int8(w)
    y = int8_linear_reference(x, wq, scale, colsum, bias)
    q, s, z = quantize_rows(x)
    acc = q.astype(np.int64) @ unpack_int8(wq).astype(np.int64)
    d = (acc - z[:, None].astype(np.int64) * colsum).astype(F32)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, d * (s[:, None] * scale[None, :]) + bias)
    exact = x @ w + bias
    assert np.abs(y - exact).max() < 0.02 * np.abs(exact).max()  # quantisation error, a percent or so


# --- the task ---------------------------------------------------------------------------------------


def test_registered_with_sizes_cases_and_measures() -> None:
    task = load_task_class("linear_int8")()
    assert isinstance(task, LinearInt8)
    case = task.full_case()
    assert case == {"m": 256, "k": 384, "n": 1536}
    assert task.work(case) == pytest.approx(2 * 256 * 384 * 1536 / 1e9)
    cases = task.check_cases(np.random.default_rng(0))
    for m in (1, 7, 33, 256):
        assert set(MINILM_SHAPES) <= {(c["k"], c["n"]) for c in cases if c["m"] == m}
    assert all(c["k"] % 64 == 0 and c["n"] % 16 == 0 and c["m"] >= 1 for c in cases)
    with pytest.raises(ValueError, match="k % 64"):
        LinearInt8({"k": 96})
    with pytest.raises(ValueError, match="n % 16"):
        LinearInt8({"n": 100})
    area = task.descriptors()["c_block_ints"]
    assert area.fn(task.seeds()[1], {}) == 8 * 2 * 16
    assert area.fn(Genome(params={**task.seeds()[1].params, "ISA": "AMX"}), {}) == 2 * 2 * 256
    assert "-ffp-contract=off" in task.compile_flags()


def test_inputs_reach_the_special_rows() -> None:
    task = LinearInt8()
    inputs = task.inputs({"m": 7, "k": 64, "n": 16}, np.random.default_rng(3))
    q, s, z = quantize_rows(inputs["x"])
    assert z[1] == 0 and z[2] == 255 and s[3] == 1.0 and (q[4] == 255).all() and s[5] == F32(1 / 32)
    assert inputs["w_scale"][3] == 1.0


def test_sources_carry_evolve_blocks_and_the_signature() -> None:
    task = LinearInt8()
    for genome in task.seeds():
        source = genome.source if genome.source is not None else task.template()
        assert EVOLVE_START in source and EVOLVE_END in source and evolve_blocks(source)
        assert task.signature in source
        assert genome.source is not None or not task.space().violations(genome.params)


def test_seeds_are_correct(build) -> None:
    task = LinearInt8()
    for genome in task.seeds():
        assert_correct(task, build(task.render(genome)), seed=2)


@pytest.mark.parametrize(("mr", "nr", "panel"), [(1, 4, 16), (7, 3, 32), (14, 2, 512), (16, 1, 64)])
def test_vnni_tiles_are_correct(build, mr: int, nr: int, panel: int) -> None:
    task = LinearInt8()
    params = {**VNNI, "MR": mr, "NR": nr, "KU": 4 if mr < 8 else 1, "PANEL": panel}
    assert not task.space().violations(params)
    assert_correct(task, build(task.render(Genome(params=params))), seed=3)


@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-INT8")
@pytest.mark.parametrize(("mt", "nt", "panel"), [(2, 2, 32), (1, 3, 64), (2, 1, 128), (1, 1, 16)])
def test_amx_blocks_are_correct(build, mt: int, nt: int, panel: int) -> None:
    task = LinearInt8()
    params = {**AMX, "AMX_MT": mt, "AMX_NT": nt, "PANEL": panel}
    assert not task.space().violations(params)
    assert_correct(task, build(task.render(Genome(params=params))), seed=4)


def test_amx_falls_back_to_vnni_without_permission(build) -> None:
    """A refused AMX request runs the VNNI path of the same kernel (no SIGILL)."""
    task = LinearInt8()
    source = task.render(Genome(params={**AMX, "AMX_MT": 2, "AMX_NT": 2, "PANEL": 32}))
    assert_correct(task, build("#define LINEAR_INT8_NO_AMX 1\n" + source), seed=5)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("acc - z * w_colsum[j]", "acc"),  # zero point not taken out
        (" + bias[j]", ""),  # bias dropped
        ("kk < k; kk++) acc +=", "kk < k - 64; kk++) acc +="),  # last 64-wide k block dropped
        ("(int)rintf(xr[kk] * inv)", "(int)roundf(xr[kk] * inv)"),  # ties of x rounded away from zero
    ],
    ids=["no-zero-point", "no-bias", "short-k", "ties-away"],
)
def test_tolerance_rejects_a_wrong_kernel(build, old: str, new: str) -> None:
    task = LinearInt8()
    source = task.seeds()[0].source
    assert source is not None and source.count(old) == 1
    kernel = build(source.replace(old, new))
    rng = np.random.default_rng(6)
    case = {"m": 7, "k": 384, "n": 384}
    got, want = run_case(task, kernel, case, rng)
    rtol, atol = task.tolerance(case)
    assert not np.allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("isa", ["VNNI", "AMX"])
def test_threads_build_with_openmp(cache_dir: str, isa: str) -> None:
    """With threads > 1 both paths share rows to quantise and blocks of columns among OpenMP threads."""
    if isa == "AMX" and not HAS_AMX:
        pytest.skip("this CPU has no AMX-INT8")
    task = LinearInt8({"threads": 2})
    assert "-fopenmp" in task.compile_flags() and "-fopenmp" not in LinearInt8().compile_flags()
    params = {**VNNI, **AMX, "ISA": isa, "MR": 6, "NR": 2, "AMX_MT": 2, "AMX_NT": 2}
    lib = compile_source(
        task.render(Genome(params=params)),
        compiler=CompilerSettings(),
        extra_flags=task.compile_flags(),
        cache_dir=cache_dir,
    )
    # Left loaded: unloading a library built with -fopenmp while libgomp's threads live crashes the process
    # at exit (CKernel.close dlcloses; test_tasks.py keeps its OpenMP kernels loaded too).
    assert_correct(task, load_kernel(lib.path, "kernel"), seed=7)

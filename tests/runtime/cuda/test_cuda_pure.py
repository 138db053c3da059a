"""The CUDA backend's pure-Python parts: ptxas parsing, occupancy, launch validation, tasks, settings."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_helpers import ptxas_report

from evo.config import load_config
from genome import Genome, evolve_blocks
from runtime.backends.cuda import launch_for
from runtime.cascade import Failure
from runtime.result import Status
from runtime.sandbox.limits import scrubbed_env
from runtime.settings import TimingSettings
from runtime.task import load_task_class
from runtime.tasks.matmul_cuda import MatmulCuda, bf16_to_f32, f32_to_bf16
from runtime.tasks.softmax_cuda import SoftmaxCuda
from runtime.timing import time_interleaved
from runtime.toolchain.cuda_device import visible_gpus
from runtime.toolchain.cuda_launch import Launch, LaunchError, arch_limits, occupancy, validate_launch
from runtime.toolchain.nvcc import CudaSettings, nvcc_flags, parse_ptxas


def test_ptxas_report_with_spills_and_stack():
    info = parse_ptxas(ptxas_report("ptxas_matmul_spill_sm80.txt"), "kernel")
    assert (info.arch, info.registers, info.smem_bytes) == ("sm_80", 255, 0)
    assert (info.spill_store_bytes, info.spill_load_bytes, info.stack_bytes) == (1256, 1480, 992)
    assert info.spill_bytes == 2736 and info.cmem_bytes == 392
    assert info.metrics()["spill_bytes"] == 2736


def test_ptxas_report_with_static_smem_and_no_cmem():
    info = parse_ptxas(ptxas_report("ptxas_softmax_block_sm90.txt"), "kernel")
    assert (info.arch, info.registers, info.smem_bytes, info.spill_bytes, info.cmem_bytes) == ("sm_90", 32, 128, 0, 0)
    info = parse_ptxas(ptxas_report("ptxas_helper_smem_sm80.txt"), "kernel")
    assert (info.registers, info.smem_bytes, info.stack_bytes) == (32, 4096, 256)


def test_ptxas_report_without_the_kernel_names_what_it_found():
    with pytest.raises(ValueError, match=r"no entry function 'main_kernel' \(found: kernel\).*extern"):
        parse_ptxas(ptxas_report("ptxas_helper_smem_sm80.txt"), "main_kernel")


def test_nvcc_flags_target_and_fast_math():
    flags = nvcc_flags(CudaSettings(), "sm_90", ["-DIN_BF16"])
    assert flags[:2] == ["-cubin", "-arch=sm_90"] and "-O3" in flags and "--use_fast_math" not in flags
    assert flags[-2:] == ["-Xptxas", "-v"] and "-DIN_BF16" in flags
    assert "--use_fast_math" in nvcc_flags(CudaSettings(fast_math=True), "sm_80")
    with pytest.raises(ValueError, match="invalid CUDA architecture"):
        nvcc_flags(CudaSettings(), "90")


def test_arch_limits_lookup():
    assert arch_limits("sm_90a").name == "sm_90"
    assert arch_limits("sm_121").name == "sm_120"  # nearest older listed arch
    assert arch_limits("sm_89").warps_per_sm == 48
    for bad in ("sm_60", "compute_80", "gfx90a"):
        with pytest.raises(ValueError):
            arch_limits(bad)


@pytest.mark.parametrize(
    ("arch", "threads", "regs", "smem", "expected", "limit"),
    [
        ("sm_80", 256, 32, 0, 1.0, "warps"),
        ("sm_80", 256, 48, 1024, 40 / 64, "registers"),  # 1536 regs/warp: 42 warps -> 5 blocks of 8
        ("sm_80", 64, 255, 71680, 4 / 64, "shared memory"),  # (70 + 1 reserved) KiB: 2 blocks in 164 KiB
        ("sm_90", 1024, 64, 0, 0.5, "registers"),  # 2048 regs/warp: 32 warps, one block
        ("sm_86", 128, 32, 0, 1.0, "warps"),  # 12 blocks of 4 warps fill 48 warp slots
        ("sm_86", 32, 16, 0, 16 / 48, "blocks"),  # 16 blocks of one warp
        ("sm_75", 1024, 65, 0, 0.0, "launch"),  # 2304 regs/warp x 32 warps > 64K: no block fits
    ],
)
def test_occupancy_estimates(arch, threads, regs, smem, expected, limit):
    occ = occupancy(arch_limits(arch), threads, regs, smem)
    assert occ.occupancy == pytest.approx(expected) and occ.limited_by == limit


@pytest.mark.parametrize(
    ("launch", "kw", "reason"),
    [
        (Launch((1, 1, 1), (1025, 1, 1)), {}, "block.x = 1025 exceeds"),
        (Launch((1, 1, 1), (32, 32, 2)), {}, "2048 threads per block exceed"),
        (Launch((1, 70000, 1), (32, 1, 1)), {}, "grid.y = 70000 exceeds"),
        (Launch((0, 1, 1), (32, 1, 1)), {}, "three positive ints"),
        (Launch((1, 1, 1), (32, 1, 1), 100 * 1024), {}, "exceed sm_86's maximum 101376"),
        (Launch((1, 1, 1), (32, 1, 1), 90 * 1024), {"static_smem": 10 * 1024}, "shared memory"),
        (Launch((1, 1, 1), (1024, 1, 1)), {"registers": 255}, "too many resources"),
    ],
)
def test_invalid_launches_say_why(launch, kw, reason):
    with pytest.raises(LaunchError, match=reason):
        validate_launch(launch, arch_limits("sm_86"), **kw)


def test_valid_launch_passes():
    validate_launch(Launch((2**31 - 1, 65535, 1), (256, 1, 1), 96 * 1024), arch_limits("sm_80"), registers=64)


def test_matmul_launch_from_params():
    task = MatmulCuda({"m": 1000, "n": 4096, "k": 64})
    modest = task.seeds()[1].params
    launch = task.launch(modest, task.full_case())
    assert launch == Launch(grid=(64, 16, 1), block=(256, 1, 1), shared_bytes=8 * (64 + 64) * 4)
    db = {**modest, "DOUBLE_BUFFER": True, "SMEM_PAD": 4}
    assert task.launch(db, task.full_case()).shared_bytes == 2 * 8 * (64 + 64 + 8) * 4
    with pytest.raises(LaunchError, match="BLOCK_K"):
        task.launch({k: v for k, v in modest.items() if k != "BLOCK_K"}, task.full_case())
    with pytest.raises(LaunchError, match="must divide"):
        task.launch({**modest, "THREAD_M": 3}, task.full_case())


def test_softmax_launch_variants():
    task = SoftmaxCuda({"rows": 100, "cols": 7})
    base = task.seeds()[1].params
    assert task.launch({**base, "VARIANT": "WARP"}, task.full_case()).grid == (25, 1, 1)
    assert task.launch({**base, "VARIANT": "BLOCK"}, task.full_case()).grid == (100, 1, 1)
    with pytest.raises(LaunchError, match="VARIANT"):
        task.launch({**base, "VARIANT": "GRID"}, task.full_case())


def test_an_unrunnable_launch_is_an_invalid_candidate():
    task = MatmulCuda({})
    info = parse_ptxas(ptxas_report("ptxas_matmul_spill_sm80.txt"), "kernel")
    point = {**task.seeds()[1].params, "THREAD_M": 1, "THREAD_N": 1}  # 4096 threads per block
    with pytest.raises(Failure) as caught:
        launch_for(task, point, task.full_case(), arch_limits("sm_80"), info)
    assert caught.value.status is Status.INVALID and "block.x = 4096 exceeds" in str(caught.value)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_matmul_space_points_render_and_launch(dtype):
    task = MatmulCuda({"dtype": dtype})
    space, rng, limits = task.space(), np.random.default_rng(1), arch_limits("sm_86")
    for _ in range(50):
        point = space.sample(rng)
        validate_launch(task.launch(point, task.full_case()), limits)  # the space keeps to runnable launches
    for g in [*task.seeds(), Genome(params=point)]:
        src = task.render(g)
        assert len(evolve_blocks(src)) == 1 and "#define BLOCK_M" in src and 'extern "C"' in src
    assert task.compile_flags() == {"fp32": [], "fp16": ["-DIN_F16"], "bf16": ["-DIN_BF16"]}[dtype]


def test_softmax_space_points_render_and_launch():
    task = SoftmaxCuda({})
    space, rng = task.space(), np.random.default_rng(2)
    for _ in range(30):
        point = space.sample(rng)
        validate_launch(task.launch(point, task.full_case()), arch_limits("sm_75"))
    for g in task.seeds():
        assert len(evolve_blocks(task.render(g))) == 1


def test_matmul_inputs_and_reference_per_dtype():
    rng = np.random.default_rng(0)
    case = {"m": 5, "n": 3, "k": 4}
    for dtype, host in (("fp32", np.float32), ("fp16", np.float16), ("bf16", np.uint16)):
        task = MatmulCuda({"dtype": dtype})
        inputs = task.inputs(case, rng)
        assert inputs["A"].dtype == host and inputs["A"].shape == (5, 4)
        out = {"C": np.empty((5, 3), np.float32)}
        task.reference(case, inputs, out)
        widened = [x.astype(np.float32) if dtype != "bf16" else bf16_to_f32(x) for x in (inputs["A"], inputs["B"])]
        np.testing.assert_allclose(out["C"], widened[0] @ widened[1], rtol=1e-6)


def test_bf16_round_trip():
    x = np.array([1.0, -2.5, 3.140625, 1e-3, 65504.0, 0.0], np.float32)
    back = bf16_to_f32(f32_to_bf16(x))
    np.testing.assert_allclose(back, x, rtol=2**-8)
    assert back[2] == np.float32(3.140625)  # representable in bf16: exact
    tie = np.array([1.0 + 2**-8, 1.0], np.float32)  # halfway between two bf16 values: rounds to the even one
    assert f32_to_bf16(tie)[0] == f32_to_bf16(tie)[1]


def test_builtin_cuda_tasks_and_configs_load():
    assert load_task_class("matmul_cuda") is MatmulCuda and load_task_class("softmax_cuda") is SoftmaxCuda
    for name in ("matmul_cuda", "softmax_cuda"):
        config = load_config(f"configs/{name}.yaml")
        task = config.make_task()
        assert task.backend == "cuda" and set(config.archive.descriptors) <= set(task.descriptors())
        assert config.evaluation.cuda.fast_math is False


def test_cuda_descriptors_read_the_metrics():
    d = MatmulCuda({}).descriptors()
    metrics = {"registers": 64, "occupancy": 0.5, "smem_bytes": 8192, "spill_bytes": 0, "threads_per_block": 256}
    g = MatmulCuda({}).seeds()[1]
    assert d["registers"].fn(g, metrics) == 64 and d["smem_kib"].fn(g, metrics) == 8
    assert d["thread_tile"].fn(g, metrics) == 16 and d["occupancy"].fn(g, {}) == 0


def test_workers_are_pinned_to_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5")
    assert visible_gpus() == ["2", "5"]
    assert scrubbed_env(1, "/tmp", "5")["CUDA_VISIBLE_DEVICES"] == "5"
    assert "CUDA_VISIBLE_DEVICES" not in scrubbed_env(1, "/tmp")


def test_timing_harness_takes_a_device_timer():
    calls: list[str] = []

    def timer(fn):
        fn()
        return 2e-3 if fn is cand else 1e-3

    def cand():
        calls.append("c")

    run = time_interleaved(cand, lambda: None, TimingSettings(warmup=1, min_repeats=5, max_repeats=5), timer=timer)
    assert run.candidate.median == 2e-3 and run.reference.median == 1e-3 and run.candidate.n == 5
    assert len(calls) == 6  # one warm-up, five timed

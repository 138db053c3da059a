"""Compile-only checks with the real nvcc: the seeds and a few template points for sm_80 and sm_90.

Compiles run one at a time (nvcc is heavy and CI machines are small); skipped where nvcc is absent.
"""

from __future__ import annotations

import pytest
from cuda_helpers import needs_nvcc

from genome import Genome
from runtime.tasks.matmul_cuda import MatmulCuda
from runtime.tasks.softmax_cuda import SoftmaxCuda
from runtime.toolchain.cc import CompileError
from runtime.toolchain.nvcc import CudaSettings, compile_cuda

pytestmark = needs_nvcc

# Cheap but distinct template points (big register tiles take nvcc tens of seconds; not needed here).
MATMUL_POINTS = [
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16, "THREAD_M": 4, "THREAD_N": 4, "VEC": 4, "DOUBLE_BUFFER": True,
     "SMEM_PAD": 4},
    {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "THREAD_M": 2, "THREAD_N": 2, "VEC": 2, "DOUBLE_BUFFER": False,
     "SMEM_PAD": 1},
]  # fmt: skip
SOFTMAX_POINT = {"VARIANT": "BLOCK", "WARPS_PER_BLOCK": 8, "VEC": 4, "UNROLL": 2, "ONLINE": True, "EXP": "FAST"}


def _compile(task, genome, arch, cache):
    return compile_cuda(task.render(genome), settings=CudaSettings(), arch=arch, kernel="kernel",
                        extra_flags=task.compile_flags(), cache_dir=str(cache))  # fmt: skip


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_seeds_and_points_compile_with_ptxas_figures(arch, tmp_path):
    assert all(MatmulCuda({}).space().is_valid(p) for p in MATMUL_POINTS)
    assert SoftmaxCuda({}).space().is_valid(SOFTMAX_POINT)
    jobs = [(MatmulCuda({}), g) for g in MatmulCuda({}).seeds()]
    jobs += [(MatmulCuda({}), Genome(params=p)) for p in MATMUL_POINTS]
    jobs += [(SoftmaxCuda({}), g) for g in SoftmaxCuda({}).seeds()]
    jobs += [(SoftmaxCuda({}), Genome(params=SOFTMAX_POINT))]
    for task, genome in jobs:
        built = _compile(task, genome, arch, tmp_path)
        assert built.info.arch == arch and 0 < built.info.registers <= 255 and not built.cached
        assert built.info.spill_bytes == 0, (task.name, genome.params)
    block = _compile(SoftmaxCuda({}), Genome(params=SOFTMAX_POINT), arch, tmp_path)
    assert block.cached and block.info.smem_bytes == 128  # the block reduction's partial sums, from the cache


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_inputs_compile(dtype, tmp_path):
    task = MatmulCuda({"dtype": dtype})
    point = {**MATMUL_POINTS[0], "BLOCK_K": 32, "VEC": 8}  # 8 halves: one 16-byte load
    assert task.space().is_valid(point)
    built = _compile(task, Genome(params=point), "sm_80", tmp_path)
    assert built.info.registers > 0


def test_nvcc_errors_become_compile_errors(tmp_path):
    with pytest.raises(CompileError, match="undefined") as caught:
        compile_cuda('extern "C" __global__ void kernel(float *y) { y[0] = nope; }', settings=CudaSettings(),
                     arch="sm_80", kernel="kernel", cache_dir=str(tmp_path))  # fmt: skip
    assert "ptxas info" not in caught.value.stderr


def test_a_mangled_kernel_name_is_a_compile_error(tmp_path):
    with pytest.raises(CompileError, match="extern"):
        compile_cuda("__global__ void kernel(float *y) { y[0] = 1.0f; }", settings=CudaSettings(), arch="sm_80",
                     kernel="kernel", cache_dir=str(tmp_path))  # fmt: skip


def test_the_candidate_host_builds_here_and_says_why_it_cannot_run_without_a_driver(tmp_path):
    """The CUDA host (its own process and context per candidate) builds with the C compiler and the toolkit's
    headers only, and its fill kernel to PTX. Started here, it gets as far as opening the driver."""
    import os
    import subprocess

    from runtime.sandbox.cuda_host import CudaHostLauncher, build_cuda_host
    from runtime.toolchain.cuda_device import CudaUnavailable, probe

    exe, ptx = build_cuda_host("cc", "nvcc", str(tmp_path))
    assert os.access(exe, os.X_OK) and ".entry evoforge_fill" in open(ptx).read()
    assert build_cuda_host("cc", "nvcc", str(tmp_path)) == (exe, ptx)  # cached
    assert subprocess.run([exe], capture_output=True, timeout=30).returncode == 64  # wrong arguments
    try:
        probe()
        has_driver = True
    except CudaUnavailable:
        has_driver = False
    if has_driver:
        pytest.skip("a driver is present: tests/runtime/cuda/test_cuda_gpu.py runs the host for real")
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(b"\0" * 64)
    launcher = CudaHostLauncher("cc", "nvcc", str(tmp_path))
    with pytest.raises(CompileError, match="no NVIDIA driver"):
        launcher.host(str(cubin), "kernel")
    launcher.close()

"""The CUDA cascade on a real GPU, through the sandboxed pool: statuses, integrity rules, timing.

Marked ``gpu`` and skipped (with the reason) where there is no driver, GPU, pycuda or nvcc.
Run them on a GPU machine with ``bench/gpu_check.sh`` or ``pytest -m gpu tests/runtime/cuda``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from cuda_helpers import needs_gpu

from genome import Genome
from runtime.executors import EvalRequest, LocalPool
from runtime.result import EvalResult, Status
from runtime.settings import EvalSettings, TaskSpec
from runtime.tasks.matmul_cuda import MatmulCuda
from runtime.tasks.softmax_cuda import SoftmaxCuda

pytestmark = [pytest.mark.gpu, needs_gpu]

SMALL_MM = TaskSpec(name="matmul_cuda", args={"m": 512, "n": 384, "k": 256})
SMALL_SM = TaskSpec(name="softmax_cuda", args={"rows": 1000, "cols": 1500})
NAIVE_HEAD = '#include <cuda_fp16.h>\ntypedef float in_t;\nextern "C" __global__ void kernel(int M, int N, int K, ' \
             "const in_t *A, const in_t *B, float *C)\n"  # fmt: skip


@pytest.fixture(scope="module")
def gpu_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalPool, str]]:
    work = str(tmp_path_factory.mktemp("cuda"))
    with LocalPool(workers=1, log_dir=os.path.join(work, "logs")) as pool:
        yield pool, work


def _settings(work: str, **cuda: Any) -> EvalSettings:
    return EvalSettings.model_validate({
        "timing": {"max_seconds": 0.3, "max_repeats": 30, "lock_file": os.path.join(work, "timing.lock")},
        "sandbox": {"timeout": 120.0, "memory_mb": 16 * 2**20},
        "check_trials": 1,
        "cuda": cuda,
    })  # fmt: skip


def _run(gpu_pool: tuple[LocalPool, str], spec: TaskSpec, genome: Genome, **cuda: Any) -> EvalResult:
    pool, work = gpu_pool
    req = EvalRequest(key=genome.id, genome=genome, task=spec, settings=_settings(work, **cuda),
                      cache_dir=os.path.join(work, "cache"))  # fmt: skip
    pool.submit(req)
    got = pool.next_result(300)
    assert got is not None and got[0].key == req.key
    return got[1]


@pytest.mark.parametrize(
    "spec",
    [
        SMALL_MM,
        TaskSpec(name="matmul_cuda", args={**SMALL_MM.args, "dtype": "bf16"}),
        TaskSpec(name="matmul_cuda", args={**SMALL_MM.args, "dtype": "fp16"}),
        SMALL_SM,
    ],
)
def test_seeds_are_ok_and_timed_against_a_gpu_reference(gpu_pool, spec):
    task = (MatmulCuda if spec.name == "matmul_cuda" else SoftmaxCuda)(spec.args)
    for genome in task.seeds():
        result = _run(gpu_pool, spec, genome)
        assert result.status is Status.OK, result.error
        m = result.metrics
        assert result.fitness > 0 and m["vs_reference"] > 0 and m["registers"] > 0 and 0 < m["occupancy"] <= 1
        assert m["reference_impl"] in ("cublas", "torch", "cupy", "numpy (host)")
        assert result.hardware and result.hardware["gpu_arch"].startswith("sm_")


def test_l2_flush_timing(gpu_pool):
    result = _run(gpu_pool, SMALL_MM, MatmulCuda(SMALL_MM.args).seeds()[1], l2_flush=True)
    assert result.status is Status.OK and result.metrics["l2_flush"] is True


def test_wrong_output_is_wrong(gpu_pool):
    src = NAIVE_HEAD + "{ int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < M * N) C[i] = 1.0f; }"
    result = _run(gpu_pool, SMALL_MM, Genome(params=MatmulCuda({}).seeds()[0].params, source=src))
    assert result.status is Status.WRONG and "expected" in result.error


def test_writing_past_an_output_is_invalid(gpu_pool):
    src = NAIVE_HEAD + "{ if (blockIdx.x == 0 && threadIdx.x == 0) C[M * N + 3] = 0.0f; }"
    result = _run(gpu_pool, SMALL_MM, Genome(params=MatmulCuda({}).seeds()[0].params, source=src))
    assert result.status is Status.INVALID and "guard zone" in result.error


def test_a_faulting_kernel_crashes_its_host_and_the_next_candidate_runs(gpu_pool):
    """The fault loses the candidate host's context, not the worker's."""
    src = NAIVE_HEAD + "{ C[(size_t)1 << 40] = 1.0f; }"
    result = _run(gpu_pool, SMALL_MM, Genome(params=MatmulCuda({}).seeds()[0].params, source=src))
    assert result.status is Status.CRASH and "faulted" in result.error
    again = _run(gpu_pool, SMALL_MM, MatmulCuda(SMALL_MM.args).seeds()[1])
    assert again.status is Status.OK, again.error


def test_an_unrunnable_launch_is_invalid(gpu_pool):
    # 2048 threads per block; the tiles still split evenly over them, so it compiles.
    point = {**MatmulCuda({}).seeds()[1].params, "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "THREAD_M": 2,
             "THREAD_N": 2, "VEC": 1}  # fmt: skip
    result = _run(gpu_pool, SMALL_MM, Genome(params=point))
    assert result.status is Status.INVALID and "exceeds the maximum 1024" in result.error


def test_a_compile_error_is_reported(gpu_pool):
    result = _run(gpu_pool, SMALL_MM, Genome(params={}, source='extern "C" __global__ void kernel() { nope; }'))
    assert result.status is Status.COMPILE_ERROR and "nope" in result.error


# Right on its first call at the full size (the small checks are computed every time); afterwards it copies
# what it saved in device memory: fast, and stale once the inputs change. Each timed round fills fresh
# inputs, so it is wrong there.
MEMO = """#include <cuda_fp16.h>
typedef float in_t;
__device__ float saved[1 << 20];
__device__ int have[1 << 20];
extern "C" __global__ void kernel(int M, int N, int K, const in_t *A, const in_t *B, float *C)
{
    // Every thread of the launch, whatever its shape, strides over all of C.
    int per_block = blockDim.x * blockDim.y * blockDim.z;
    int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    int t = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    int stride = per_block * gridDim.x * gridDim.y * gridDim.z;
    int remember = M * N > 100000;
    for (int i = block * per_block + t; i < M * N && i < (1 << 20); i += stride) {
        if (remember && have[i]) { C[i] = saved[i]; continue; }
        int r = i / N, c = i % N;
        float s = 0.0f;
        for (int k = 0; k < K; k++) s += A[r * K + k] * B[k * N + c];
        C[i] = s;
        if (remember) { saved[i] = s; have[i] = 1; }
    }
}
"""


def test_a_kernel_that_remembers_its_outputs_on_the_device_is_wrong(gpu_pool):
    result = _run(gpu_pool, SMALL_MM, Genome(params=MatmulCuda({}).seeds()[0].params, source=MEMO))
    assert result.status is Status.WRONG and "fresh inputs" in result.error, result.error
    honest = _run(gpu_pool, SMALL_MM, MatmulCuda(SMALL_MM.args).seeds()[1])
    assert honest.status is Status.OK and honest.metrics["fresh_inputs"] == "device fill", honest.error

"""The built-in ``matmul_cuda`` task: GEMM ``C[M,N] = A[M,K] x B[K,N]`` on the GPU against cuBLAS.

Inputs are fp32, fp16 or bf16 (task argument ``dtype``); C and the accumulation are fp32. bf16 has no
numpy dtype, so bf16 arrays are ``uint16`` holding the top half of the fp32 bit pattern.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from pydantic import Field

from genome import ChoiceParam, Genome, ParamSpace, Pow2Param
from runtime.cuda_task import CudaTask, Launch, LaunchError, load_cuda_source, need
from runtime.task import Case, Descriptor, TaskArgs

__all__ = ["MatmulCuda", "bf16_to_f32", "f32_to_bf16"]

_ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2}
# The kernel sees exactly the inputs the reference sees, so only the fp32 summation order differs;
# narrower inputs carry smaller mantissas into the same fp32 sums, hence the same relative bound.
_TOLERANCE = {"fp32": (1e-4, 1e-5), "fp16": (1e-4, 1e-5), "bf16": (1e-4, 1e-5)}
_SMEM_LIMIT = 99 * 1024  # the smallest opt-in maximum per block of the supported archs (sm_86/89/120)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits (uint16), rounded to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(b: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> fp32, exactly."""
    return (b.astype(np.uint32) << 16).view(np.float32)


class MatmulCudaArgs(TaskArgs):
    """Problem size of the timed case, and the input precision."""

    m: int = Field(4096, ge=1, description="rows of A and C")
    n: int = Field(4096, ge=1, description="columns of B and C")
    k: int = Field(4096, ge=1, description="columns of A, rows of B")
    dtype: Literal["fp32", "fp16", "bf16"] = Field("fp32", description="precision of A and B (C is fp32)")


class MatmulCuda(CudaTask):
    """GEMM on the GPU; the template is a tiled shared-memory kernel with register tiles."""

    name = "matmul_cuda"
    unit = "TFLOP/s"
    description = "GEMM on an NVIDIA GPU, row-major, fp32/fp16/bf16 inputs, fp32 accumulation"
    signature = 'extern "C" __global__ void kernel(int M, int N, int K, const in_t *A, const in_t *B, float *C)'
    gpu_reference = "gemm"
    Args = MatmulCudaArgs
    args: MatmulCudaArgs

    def space(self) -> ParamSpace:
        """Block and thread tiles, stage depth, load width, double buffering and padding, pruned to
        launches of 32..1024 threads whose tiles split evenly into loads and fit 99 KiB of shared memory."""
        threads = "(BLOCK_M // THREAD_M) * (BLOCK_N // THREAD_N)"
        return ParamSpace(
            {
                "BLOCK_M": Pow2Param(type="pow2", low=16, high=256),
                "BLOCK_N": Pow2Param(type="pow2", low=16, high=256),
                "BLOCK_K": Pow2Param(type="pow2", low=8, high=64),
                "THREAD_M": Pow2Param(type="pow2", low=1, high=16),
                "THREAD_N": Pow2Param(type="pow2", low=1, high=16),
                "VEC": Pow2Param(type="pow2", low=1, high=8),
                "DOUBLE_BUFFER": ChoiceParam(type="choice", values=(False, True)),
                "SMEM_PAD": ChoiceParam(type="choice", values=(0, 1, 4)),
            },
            [
                "THREAD_M <= BLOCK_M",
                "THREAD_N <= BLOCK_N",
                f"{threads} >= 32",
                f"{threads} <= 1024",
                "THREAD_M * THREAD_N <= 64",
                f"VEC * {_ITEMSIZE[self.args.dtype]} <= 16",
                f"BLOCK_M * BLOCK_K % ({threads} * VEC) == 0",
                f"BLOCK_K * BLOCK_N % ({threads} * VEC) == 0",
                f"(2 if DOUBLE_BUFFER else 1) * BLOCK_K * (BLOCK_M + BLOCK_N + 2 * SMEM_PAD) * 4 <= {_SMEM_LIMIT}",
            ],
        )

    def template(self) -> str:
        return load_cuda_source("matmul_template.cu")

    def seeds(self) -> list[Genome]:
        """The naive kernel (global memory only), and a modest tiled point (64x64 tiles, 4x4 per thread)."""
        naive = {
            "BLOCK_M": 16,
            "BLOCK_N": 16,
            "BLOCK_K": 8,
            "THREAD_M": 1,
            "THREAD_N": 1,
            "VEC": 1,
            "DOUBLE_BUFFER": False,
            "SMEM_PAD": 0,
        }
        modest = {
            "BLOCK_M": 64,
            "BLOCK_N": 64,
            "BLOCK_K": 8,
            "THREAD_M": 4,
            "THREAD_N": 4,
            "VEC": 1,
            "DOUBLE_BUFFER": False,
            "SMEM_PAD": 0,
        }
        return [Genome(params=naive, source=load_cuda_source("matmul_naive.cu")), Genome(params=modest)]

    def compile_flags(self) -> list[str]:
        return {"fp32": [], "fp16": ["-DIN_F16"], "bf16": ["-DIN_BF16"]}[self.args.dtype]

    def launch(self, params: Mapping[str, Any], case: Case) -> Launch:
        bm, bn, bk, tm, tn = need(params, "BLOCK_M", "BLOCK_N", "BLOCK_K", "THREAD_M", "THREAD_N")
        if bm % tm or bn % tn:
            raise LaunchError(f"THREAD_M={tm} must divide BLOCK_M={bm} and THREAD_N={tn} divide BLOCK_N={bn}")
        stages = 2 if params.get("DOUBLE_BUFFER") else 1
        smem = stages * bk * (bm + bn + 2 * int(params.get("SMEM_PAD", 0))) * 4
        grid = (-(-case["n"] // bn), -(-case["m"] // bm), 1)
        return Launch(grid=grid, block=((bm // tm) * (bn // tn), 1, 1), shared_bytes=smem)

    def full_case(self) -> Case:
        return {"m": self.args.m, "n": self.args.n, "k": self.args.k}

    def check_cases(self, rng: np.random.Generator) -> list[Case]:
        """Tiny and odd shapes (no tile or vector width divides them), one aligned, three drawn up to 300."""
        fixed = [(1, 1, 1), (7, 13, 5), (33, 65, 17), (127, 129, 131), (3, 200, 1), (128, 256, 64)]
        drawn = [tuple(int(v) for v in rng.integers(1, 301, size=3)) for _ in range(3)]
        return [{"m": m, "n": n, "k": k} for m, n, k in fixed + drawn]

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        a = rng.standard_normal((case["m"], case["k"]), dtype=np.float32)
        b = rng.standard_normal((case["k"], case["n"]), dtype=np.float32)
        if self.args.dtype == "fp16":
            return {"A": a.astype(np.float16), "B": b.astype(np.float16)}
        if self.args.dtype == "bf16":
            return {"A": f32_to_bf16(a), "B": f32_to_bf16(b)}
        return {"A": a, "B": b}

    def outputs(self, case: Case) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"C": ((case["m"], case["n"]), np.dtype(np.float32))}

    def device_fill(self, case: Case, inputs: Mapping[str, np.ndarray]) -> dict[str, tuple[int, float, float]] | None:
        """Normal values like :meth:`inputs`'s, in the input dtype (bf16 held as uint16)."""
        kind = {"fp32": 0, "fp16": 1, "bf16": 2}[self.args.dtype]
        return {name: (kind, 0.0, 1.0) for name in inputs}

    def _f32(self, x: np.ndarray) -> np.ndarray:
        return bf16_to_f32(x) if self.args.dtype == "bf16" else x.astype(np.float32, copy=False)

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """numpy's fp32 matmul of the (exactly widened) inputs."""
        np.matmul(self._f32(inputs["A"]), self._f32(inputs["B"]), out=outputs["C"])

    def kernel_args(self, case: Case, arrays: Mapping[str, Any]) -> list[Any]:
        return [case["m"], case["n"], case["k"], arrays["A"], arrays["B"], arrays["C"]]

    def tolerance(self, case: Case) -> tuple[float, float]:
        """Per input dtype; the absolute part grows with K like the error of a K-term fp32 dot product."""
        rtol, atol = _TOLERANCE[self.args.dtype]
        return (rtol, atol * case["k"])

    def work(self, case: Case) -> float:
        return 2.0 * case["m"] * case["n"] * case["k"] / 1e12

    def descriptors(self) -> dict[str, Descriptor]:
        return {
            **super().descriptors(),
            "thread_tile": Descriptor(
                "thread_tile",
                "THREAD_M * THREAD_N: outputs per thread (register tile)",
                lambda g, m: float(g.params.get("THREAD_M", 1) * g.params.get("THREAD_N", 1)),
                0.0,
                64.0,
            ),
            "block_tile": Descriptor(
                "block_tile",
                "BLOCK_M * BLOCK_N: outputs per block (shared-memory tile)",
                lambda g, m: float(g.params.get("BLOCK_M", 1) * g.params.get("BLOCK_N", 1)),
                0.0,
                65536.0,
            ),
        }

"""The built-in ``matmul`` task: fp32 row-major GEMM ``C[M,N] = A[M,K] x B[K,N]`` against numpy's BLAS."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import Field

from genome import ChoiceParam, Genome, IntParam, ParamSpace, Pow2Param
from runtime.task import VALUE_KINDS, Case, Descriptor, KernelTask, TaskArgs
from runtime.tasks._common import load_c_source, vector_width

__all__ = ["Matmul"]

_ACC_REGISTERS = 28
"""Vector registers the micro-kernel may hold accumulators in (of 32 with AVX-512; scaled for fewer)."""


class MatmulArgs(TaskArgs):
    """Problem size of the timed case."""

    m: int = Field(1024, ge=1, description="rows of A and C")
    n: int = Field(1024, ge=1, description="columns of B and C")
    k: int = Field(1024, ge=1, description="columns of A, rows of B")


class Matmul(KernelTask):
    """fp32 GEMM; the template is a packed, cache-blocked GEMM with a register-tiled vector micro-kernel."""

    name = "matmul"
    unit = "GFLOP/s"
    description = "fp32 row-major matrix multiply C[M,N] = A[M,K] x B[K,N]"
    signature = "void kernel(int M, int N, int K, const float *A, const float *B, float *C)"
    Args = MatmulArgs
    args: MatmulArgs

    def space(self) -> ParamSpace:
        """Register tile, cache blocks, unroll and loop orders, pruned to tiles that neither spill nor stall.

        NR is in whole vectors of the host's width (16 floats with AVX-512, 8 with AVX); a tile needs at
        least 12 vector accumulators (8 without AVX-512) to keep the FMA units busy, and at most as many
        as fit beside the B row. Loop orders that repack B for every block of rows (I outside J) are left
        out: they were always slower.
        """
        vw = vector_width()
        regs, least = (_ACC_REGISTERS, 12) if vw == 16 else (12, 8)
        return ParamSpace(
            {
                "MR": IntParam(type="int", low=3, high=16),
                "NR": IntParam(type="int", low=vw, high=4 * vw, step=vw),
                "MC": IntParam(type="int", low=32, high=512, step=8),
                "KC": IntParam(type="int", low=64, high=512, step=32),
                "NC": IntParam(type="int", low=256, high=4096, step=128),
                "UNROLL": Pow2Param(type="pow2", low=1, high=8),
                "LOOP_ORDER": ChoiceParam(type="choice", values=("JPI", "PJI")),
                "TILE_ORDER": ChoiceParam(type="choice", values=("COLS", "ROWS")),
                "PREFETCH_C": ChoiceParam(type="choice", values=(False, True)),
            },
            [
                f"MR * NR >= {least * vw}",
                f"MR * NR <= {regs * vw}",
                f"(MR + 1) * NR <= {(regs + 3) * vw}",
                "MC % MR == 0",
                "NC % NR == 0",
                "KC * NR <= 16384",
            ],
        )

    def template(self) -> str:
        return load_c_source("matmul_template.c")

    def seeds(self) -> list[Genome]:
        """The naive triple loop, and a modest template point (small tile, no tuning)."""
        vw = vector_width()
        modest = {
            "MR": 6, "NR": 2 * vw, "MC": 96, "KC": 128, "NC": 512, "UNROLL": 1,
            "LOOP_ORDER": "JPI", "TILE_ORDER": "COLS", "PREFETCH_C": False,
        }
        return [Genome(params={}, source=load_c_source("matmul_naive.c")), Genome(params=modest)]

    def compile_flags(self) -> list[str]:
        return ["-fopenmp"] if self.args.threads > 1 else []

    def full_case(self) -> Case:
        return {"m": self.args.m, "n": self.args.n, "k": self.args.k}

    def check_cases(self, rng: np.random.Generator) -> list[Case]:
        """Fixed tiny and odd shapes (no tile divides them), three drawn up to 200, and two drawn across the
        domain up to the timed shape: rows odd in its upper half, and even anywhere. A kernel must be right at
        every size it may be called at, not only at the small checked ones and the timed one."""
        fixed = [(1, 1, 1), (7, 13, 5), (33, 65, 17), (127, 129, 131), (3, 200, 1)]
        drawn = [tuple(int(v) for v in rng.integers(1, 201, size=3)) for _ in range(3)]
        a = self.args
        across = []
        for parity, low in ((1, max(1, a.m // 2)), (0, 1)):
            m = int(rng.integers(low, a.m + 1))
            if m % 2 != parity:
                m = m + 1 if m < a.m else m - 1
            across.append((max(m, 1), int(rng.integers(1, a.n + 1)), int(rng.integers(1, a.k + 1))))
        return [{"m": m, "n": n, "k": k} for m, n, k in fixed + drawn + across]

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {
            "A": rng.standard_normal((case["m"], case["k"]), dtype=np.float32),
            "B": rng.standard_normal((case["k"], case["n"]), dtype=np.float32),
        }

    def outputs(self, case: Case) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"C": ((case["m"], case["n"]), np.dtype(np.float32))}

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        np.matmul(inputs["A"], inputs["B"], out=outputs["C"])

    def kernel_args(self, case: Case, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        return [case["m"], case["n"], case["k"], arrays["A"], arrays["B"], arrays["C"]]

    def tolerance(self, case: Case) -> tuple[float, float]:
        """Against ``|A| @ |B|`` (see :meth:`error_scale`): an fp32 dot product of K terms summed in any order
        is off by about sqrt(K) roundings of its terms' size; 16 of them is the margin between two honest
        kernels. The atol only forgives flushing subnormal products to zero."""
        return (16 * math.sqrt(case["k"]) * 2.0**-24, 1e-30)

    def rms_tolerance(self, case: Case) -> float:
        """Any fp32 summation order, even a naive one over K = 2048, stays near 1e-6 relative RMS error; inputs
        rounded to 14 bits give 3.7e-5 and an int16 fixed-point GEMM 4e-5, however long K is."""
        return 1e-5

    def error_scale(self, case: Case, inputs: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray],
                    ) -> Mapping[str, np.ndarray]:  # fmt: skip
        """``|A| @ |B|``: the size of the terms each element sums, which bounds its rounding whatever cancels."""
        return {"C": np.abs(inputs["A"]) @ np.abs(inputs["B"])}  # fp32: a scale needs no more precision

    def value_kinds(self) -> tuple[str, ...]:
        """Typical normals, and huge, tiny, zero, signed-zero and subnormal values (see runtime.task.VALUE_KINDS)."""
        return VALUE_KINDS

    def work(self, case: Case) -> float:
        return 2.0 * case["m"] * case["n"] * case["k"] / 1e9

    def ceiling(self, fma_gflops: float) -> float:
        """Every flop of an fp32 GEMM is half a fused multiply-add: no more than the cores' FMA peak."""
        return fma_gflops * self.args.threads

    def descriptors(self) -> dict[str, Descriptor]:
        vw = vector_width()
        return {
            **super().descriptors(),
            "register_tile_area": Descriptor(
                "register_tile_area",
                "MR * NR: floats of C held in registers by the micro-kernel",
                lambda g, m: float(g.params.get("MR", 1) * g.params.get("NR", 1)),
                0.0,
                float(_ACC_REGISTERS * vw),
            ),
            "cache_block_kib": Descriptor(
                "cache_block_kib",
                "(MC*KC + KC*NC) * 4 / 1024: KiB of packed A block plus packed B panel",
                lambda g, m: float(
                    (g.params.get("MC", 0) * g.params.get("KC", 0) + g.params.get("KC", 0) * g.params.get("NC", 0))
                    * 4 / 1024
                ),
                0.0,
                8192.0,
            ),
        }

"""A user-defined task in the style of Kernel Tuner's tiled matmul example: a fixed kernel, a space of
576 tilings, and a seed with no head start (the smallest tiles).

    C[m, n] = A[m, k] @ B[k, n], fp32, row-major

The kernel walks C in BM x BN blocks and K in BK slices, and computes each block in TM x TN register
tiles. Referenced from ``configs/tiled_matmul_user.yaml`` as ``tiled_matmul_task:TiledMatmul``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from genome import Genome, ParamSpace
from runtime import Case, Descriptor, KernelTask, TaskArgs

TEMPLATE = r"""
#define MIN(a, b) ((a) < (b) ? (a) : (b))
void kernel(int m, int n, int k, const float *A, const float *B, float *C) {
    for (long i = 0; i < (long)m * n; i++) C[i] = 0.0f;
    for (int i0 = 0; i0 < m; i0 += BM)
    for (int j0 = 0; j0 < n; j0 += BN)
    for (int k0 = 0; k0 < k; k0 += BK) {
        const int i1 = MIN(i0 + BM, m), j1 = MIN(j0 + BN, n), k1 = MIN(k0 + BK, k);
        for (int i = i0; i < i1; i += TM)
        for (int j = j0; j < j1; j += TN) {
            if (i + TM <= i1 && j + TN <= j1) {  /* a whole register tile */
                float acc[TM][TN];
                for (int a = 0; a < TM; a++) for (int b = 0; b < TN; b++) acc[a][b] = C[(long)(i + a) * n + j + b];
                for (int p = k0; p < k1; p++) {
                    const float *bp = B + (long)p * n + j;
                    for (int a = 0; a < TM; a++) {
                        const float av = A[(long)(i + a) * k + p];
                        for (int b = 0; b < TN; b++) acc[a][b] += av * bp[b];
                    }
                }
                for (int a = 0; a < TM; a++) for (int b = 0; b < TN; b++) C[(long)(i + a) * n + j + b] = acc[a][b];
            } else {  /* the ragged edge */
                for (int a = i; a < MIN(i + TM, i1); a++)
                for (int b = j; b < MIN(j + TN, j1); b++) {
                    float s = C[(long)a * n + b];
                    for (int p = k0; p < k1; p++) s += A[(long)a * k + p] * B[(long)p * n + b];
                    C[(long)a * n + b] = s;
                }
            }
        }
    }
}
"""

_BLOCKS = (16, 32, 64, 128)


class TiledMatmulArgs(TaskArgs):
    m: int = 512
    n: int = 512
    k: int = 512


class TiledMatmul(KernelTask):
    name = "tiled_matmul"
    unit = "GFLOP/s"
    description = "fp32 GEMM, a fixed blocked kernel with 576 tilings (Kernel Tuner's example, on the CPU)."
    signature = "void kernel(int m, int n, int k, const float *A, const float *B, float *C)"
    Args = TiledMatmulArgs

    def space(self) -> ParamSpace:
        return ParamSpace.from_dict({"params": {
            "BM": list(_BLOCKS), "BN": list(_BLOCKS), "BK": [32, 64, 128],
            "TM": [1, 2, 4], "TN": [1, 4, 8, 16],
        }})  # fmt: skip

    def template(self) -> str:
        return TEMPLATE

    def seeds(self) -> list[Genome]:
        return [Genome(params={"BM": 16, "BN": 16, "BK": 32, "TM": 1, "TN": 1})]

    def full_case(self) -> Case:
        a = self.args
        return {"m": a.m, "n": a.n, "k": a.k}

    def check_cases(self, rng: np.random.Generator) -> list[Case]:
        return [{"m": 1, "n": 1, "k": 1}, {"m": 19, "n": 37, "k": 23},
                {"m": int(rng.integers(1, 150)), "n": int(rng.integers(1, 150)), "k": int(rng.integers(1, 150))}]

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"A": rng.standard_normal((case["m"], case["k"]), dtype=np.float32),
                "B": rng.standard_normal((case["k"], case["n"]), dtype=np.float32)}  # fmt: skip

    def outputs(self, case: Case) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"C": ((case["m"], case["n"]), np.dtype(np.float32))}

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        np.matmul(inputs["A"], inputs["B"], out=outputs["C"])

    def kernel_args(self, case: Case, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        return [case["m"], case["n"], case["k"], arrays["A"], arrays["B"], arrays["C"]]

    def tolerance(self, case: Case) -> tuple[float, float]:
        return (16 * float(np.sqrt(case["k"])) * 2.0**-24, 1e-4)

    def work(self, case: Case) -> float:
        return 2.0 * case["m"] * case["n"] * case["k"] / 1e9

    def descriptors(self) -> dict[str, Descriptor]:
        return {
            **super().descriptors(),
            "register_tile": Descriptor("register_tile", "TM x TN accumulators",
                                        lambda g, m: g.params.get("TM", 1) * g.params.get("TN", 1), 1, 64),
            "block_kib": Descriptor("block_kib", "BK x BN slice of B per block (KiB)",
                                    lambda g, m: g.params.get("BK", 32) * g.params.get("BN", 16) * 4 / 1024, 0, 64),
        }

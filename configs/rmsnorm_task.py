"""A user-defined task, written from the README alone: RMSNorm over rows, fp32.

    y[r, c] = x[r, c] / sqrt(mean(x[r, :]^2) + eps) * w[c]

Referenced from ``configs/rmsnorm_user.yaml`` as ``task: {name: "rmsnorm_task:RMSNorm"}``; the config's
directory is on the import path, so this file only has to sit beside the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from genome import Genome, ParamSpace
from runtime import Case, Descriptor, KernelTask, TaskArgs

TEMPLATE = r"""
#include <math.h>
/* ACC independent partial sums break the add dependency chain; UNROLL columns per step. */
void kernel(int rows, int cols, float eps, const float *x, const float *w, float *y) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (long)r * cols;
        float *yr = y + (long)r * cols;
        /* EVOLVE-BLOCK-START */
        float acc[ACC] = {0};
        int c = 0;
        for (; c + ACC * UNROLL <= cols; c += ACC * UNROLL)
            for (int u = 0; u < ACC * UNROLL; u++) acc[u % ACC] += xr[c + u] * xr[c + u];
        float ss = 0.0f;
        for (int a = 0; a < ACC; a++) ss += acc[a];
        for (; c < cols; c++) ss += xr[c] * xr[c];
        float scale = 1.0f / sqrtf(ss / cols + eps);
        for (c = 0; c < cols; c++) yr[c] = xr[c] * scale * w[c];
        /* EVOLVE-BLOCK-END */
    }
}
"""

NAIVE = r"""
#include <math.h>
void kernel(int rows, int cols, float eps, const float *x, const float *w, float *y) {
    /* EVOLVE-BLOCK-START */
    for (int r = 0; r < rows; r++) {
        double ss = 0.0;
        for (int c = 0; c < cols; c++) ss += (double)x[(long)r * cols + c] * x[(long)r * cols + c];
        float scale = (float)(1.0 / sqrt(ss / cols + eps));
        for (int c = 0; c < cols; c++) y[(long)r * cols + c] = x[(long)r * cols + c] * scale * w[c];
    }
    /* EVOLVE-BLOCK-END */
}
"""


class RMSNormArgs(TaskArgs):
    rows: int = 2048
    cols: int = 1024
    eps: float = 1e-6


class RMSNorm(KernelTask):
    name = "rmsnorm_user"
    unit = "GB/s"
    description = "Row-wise RMS normalisation with a learned scale, fp32."
    signature = "void kernel(int rows, int cols, float eps, const float *x, const float *w, float *y)"
    Args = RMSNormArgs

    def space(self) -> ParamSpace:
        return ParamSpace.from_dict({
            "params": {"ACC": {"type": "pow2", "low": 1, "high": 32}, "UNROLL": {"type": "int", "low": 1, "high": 4}},
            "constraints": ["ACC * UNROLL <= 64"],
        })

    def template(self) -> str:
        return TEMPLATE

    def seeds(self) -> list[Genome]:
        return [Genome(params={}, source=NAIVE), Genome(params={"ACC": 1, "UNROLL": 1})]

    def full_case(self) -> Case:
        return {"rows": self.args.rows, "cols": self.args.cols}

    def check_cases(self, rng: np.random.Generator) -> list[Case]:
        return [{"rows": 1, "cols": 1}, {"rows": 3, "cols": 17}, {"rows": int(rng.integers(1, 9)),
                                                                   "cols": int(rng.integers(1, 300))}]

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {
            "x": rng.standard_normal((case["rows"], case["cols"]), dtype=np.float32),
            "w": rng.uniform(0.5, 1.5, case["cols"]).astype(np.float32),
        }

    def outputs(self, case: Case) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"y": ((case["rows"], case["cols"]), np.dtype(np.float32))}

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        x = inputs["x"]
        ms = np.mean(x * x, axis=1, keepdims=True)
        np.multiply(x / np.sqrt(ms + np.float32(self.args.eps)), inputs["w"], out=outputs["y"])

    def kernel_args(self, case: Case, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        return [case["rows"], case["cols"], float(self.args.eps), arrays["x"], arrays["w"], arrays["y"]]

    def tolerance(self, case: Case) -> tuple[float, float]:
        return (1e-5, 1e-5)

    def work(self, case: Case) -> float:
        return case["rows"] * case["cols"] * 4 * 2 / 1e9  # read x, write y (w stays in cache)

    def descriptors(self) -> dict[str, Descriptor]:
        return {
            **super().descriptors(),
            "accumulators": Descriptor("accumulators", "independent partial sums", lambda g, m: g.params.get("ACC", 1),
                                       1, 32),
        }

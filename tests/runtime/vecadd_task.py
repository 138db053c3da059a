"""A tiny task for the runtime's tests: ``y = a * x + b`` elementwise in fp32.

Used through ``TaskSpec(name="vecadd_task:VecAdd")`` with this directory on the request's ``sys_path``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from genome import Genome, ParamSpace
from runtime.task import Case, KernelTask, TaskArgs

A, B = 1.5, -0.25

NAIVE = """
void kernel(int n, float a, float b, const float *x, float *y) {
    for (int i = 0; i < n; i++) y[i] = a * x[i] + b;
}
"""

TEMPLATE = """
void kernel(int n, float a, float b, const float *x, float *y) {
    int i = 0;
    for (; i + UNROLL <= n; i += UNROLL)
        for (int u = 0; u < UNROLL; u++) y[i + u] = a * x[i + u] + b;
    for (; i < n; i++) y[i] = a * x[i] + b;
}
"""


class VecAddArgs(TaskArgs):
    n: int = 4096


class VecAdd(KernelTask):
    name = "vecadd"
    unit = "GB/s"
    description = "y = a*x + b, elementwise, fp32"
    signature = "void kernel(int n, float a, float b, const float *x, float *y)"
    Args = VecAddArgs

    def space(self) -> ParamSpace:
        return ParamSpace({"UNROLL": {"type": "pow2", "low": 1, "high": 8}})

    def template(self) -> str:
        return TEMPLATE

    def seeds(self) -> list[Genome]:
        return [Genome(source=NAIVE), Genome(params={"UNROLL": 4})]

    def full_case(self) -> Case:
        return {"n": self.args.n}

    def check_cases(self, rng: np.random.Generator) -> list[Case]:
        return [{"n": 1}, {"n": 7}, {"n": int(rng.integers(8, 200))}]

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"x": rng.standard_normal(case["n"], dtype=np.float32)}

    def outputs(self, case: Case) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"y": ((case["n"],), np.dtype(np.float32))}

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        y = outputs["y"]
        np.multiply(inputs["x"], np.float32(A), out=y)
        y += np.float32(B)

    def kernel_args(self, case: Case, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        return [case["n"], A, B, arrays["x"], arrays["y"]]

    def work(self, case: Case) -> float:
        return 8 * case["n"] / 1e9  # GB moved: read x, write y

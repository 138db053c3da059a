"""The built-in ``softmax`` task: numerically stable row-wise softmax over the last axis, fp32."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import Field

from genome import ChoiceParam, Genome, ParamSpace, Pow2Param
from runtime.slots import Slot, SlotTask
from runtime.task import VALUE_KINDS, Case, Descriptor, TaskArgs
from runtime.tasks._common import load_c_source

__all__ = ["Softmax"]


class SoftmaxArgs(TaskArgs):
    """Shape of the timed case."""

    rows: int = Field(4096, ge=1, description="independent rows")
    cols: int = Field(1024, ge=1, description="length of each row (the softmax axis)")


class Softmax(SlotTask):
    """Row-wise softmax; the template varies vector width, unrolling, row blocking, passes and exp."""

    name = "softmax"
    unit = "GB/s"
    description = "fp32 softmax over the last axis of a [rows, cols] matrix, max-subtracted"
    signature = "void kernel(int rows, int cols, const float *x, float *y)"
    slot = Slot("softmax")
    Args = SoftmaxArgs
    args: SoftmaxArgs

    def space(self) -> ParamSpace:
        """Vector width and independent work in flight (bounded so accumulators stay in registers)."""
        return ParamSpace(
            {
                "VEC": Pow2Param(type="pow2", low=4, high=16),
                "UNROLL": Pow2Param(type="pow2", low=1, high=4),
                "ROWS_PER_BLOCK": Pow2Param(type="pow2", low=1, high=4),
                "PASSES": ChoiceParam(type="choice", values=("THREE", "ONLINE")),
                "EXP": ChoiceParam(type="choice", values=("POLY", "LIBM")),
            },
            ["UNROLL * ROWS_PER_BLOCK <= 8"],
        )

    def template(self) -> str:
        return load_c_source("softmax_template.c")

    def seeds(self) -> list[Genome]:
        """The naive three-loop kernel, and a modest template point (narrow vectors, libm exp)."""
        modest = {"VEC": 4, "UNROLL": 1, "ROWS_PER_BLOCK": 1, "PASSES": "THREE", "EXP": "LIBM"}
        return [Genome(params={}, source=load_c_source("softmax_naive.c")), Genome(params=modest)]

    def compile_flags(self) -> list[str]:
        return ["-fopenmp"] if self.args.threads > 1 else []

    def full_case(self) -> Case:
        return {"rows": self.args.rows, "cols": self.args.cols}

    def check_cases(self, rng: np.random.Generator) -> list[Case]:
        """Fixed tiny and odd shapes (no vector or block divides them), plus two drawn ones."""
        fixed = [(1, 1), (3, 7), (5, 33), (7, 127), (9, 1000)]
        drawn = [(int(rng.integers(1, 40)), int(rng.integers(1, 600))) for _ in range(2)]
        return [{"rows": r, "cols": c} for r, c in fixed + drawn]

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Standard normal, scaled so rows span a wide range of exponents."""
        x = rng.standard_normal((case["rows"], case["cols"]), dtype=np.float32)
        return {"x": x * np.float32(4.0)}

    def outputs(self, case: Case) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"y": ((case["rows"], case["cols"]), np.dtype(np.float32))}

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """Softmax as numpy users write it, the result written into the output buffer."""
        x = inputs["x"]
        e = np.exp(x - x.max(axis=1, keepdims=True))
        np.divide(e, e.sum(axis=1, keepdims=True), out=outputs["y"])

    def value_kinds(self) -> tuple[str, ...]:
        """Typical values, huge values (a kernel that does not subtract the row's max overflows), tiny,
        zero, signed-zero and subnormal ones (see runtime.task.VALUE_KINDS)."""
        return VALUE_KINDS

    def slot_args(self, operands: Mapping[str, Any], out: np.ndarray) -> list[Any]:
        x = operands["x"]
        return [x.shape[0], x.shape[1], x, out]

    def kernel_args(self, case: Case, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        return [case["rows"], case["cols"], arrays["x"], arrays["y"]]

    def tolerance(self, case: Case) -> tuple[float, float]:
        """Tight relative error (a fast exp must stay within a few ulp), plus what an fp32 sum of the row's ``cols``
        terms may be off by in any order (each element is divided by it; measured up to 0.22 ``cols`` ulp for an
        honest sequential sum); atol covers underflowing tails."""
        return (1e-5 + case["cols"] * 2.0**-24, 1e-9)

    def rms_tolerance(self, case: Case) -> float:
        """All elements together: a sum's rounding, a quarter of the per-element allowance, and a little more; an
        exp of 13 bits (1e-4 off) is over it at any row length the checks draw."""
        return 4e-6 + case["cols"] * 2.0**-26

    def work(self, case: Case) -> float:
        """Bytes moved: x read once, y written once."""
        return case["rows"] * case["cols"] * 8 / 1e9

    def descriptors(self) -> dict[str, Descriptor]:
        return {
            **super().descriptors(),
            "vector_width": Descriptor(
                "vector_width",
                "VEC * UNROLL: floats per row in flight",
                lambda g, m: float(g.params.get("VEC", 1) * g.params.get("UNROLL", 1)),
                0.0,
                64.0,
            ),
            "rows_per_block": Descriptor(
                "rows_per_block",
                "rows processed interleaved",
                lambda g, m: float(g.params.get("ROWS_PER_BLOCK", 1)),
                0.0,
                4.0,
            ),
        }

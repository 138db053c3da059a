"""The built-in ``rmsnorm`` task: fp32 RMSNorm over the last axis, shaped like a decode step's (the decoder's
``rmsnorm`` slot, :mod:`runtime.decoder.ops`; SmolLM2-135M's hidden size of 576 by default)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import Field

from genome import Genome, ParamSpace, Pow2Param
from runtime.slots import Slot, SlotTask
from runtime.task import VALUE_KINDS, Case, Descriptor, TaskArgs
from runtime.tasks._common import load_c_source

__all__ = ["RMSNorm"]


class RMSNormArgs(TaskArgs):
    """Shape of the timed case: a decode step normalises [sequences, hidden] activations."""

    rows: int = Field(64, ge=1, description="rows (tokens of a step)")
    cols: int = Field(576, ge=1, description="length of each row (the hidden size)")
    eps: float = Field(1e-5, gt=0, description="added to the mean square (the model's rms_norm_eps)")


class RMSNorm(SlotTask):
    """Row-wise RMSNorm; the template varies vector width and independent sums."""

    name = "rmsnorm"
    unit = "GB/s"
    description = "fp32 RMSNorm over the last axis of a [rows, cols] matrix, times a weight per column"
    signature = "void kernel(int rows, int cols, float eps, const float *x, const float *w, float *y)"
    slot = Slot("rmsnorm")
    Args = RMSNormArgs
    args: RMSNormArgs

    def space(self) -> ParamSpace:
        return ParamSpace(
            {
                "VEC": Pow2Param(type="pow2", low=4, high=16),
                "UNROLL": Pow2Param(type="pow2", low=1, high=8),
            }
        )

    def template(self) -> str:
        return load_c_source("rmsnorm_template.c")

    def seeds(self) -> list[Genome]:
        """The naive scalar kernel, and a modest template point (the decoder's default)."""
        return [Genome(params={}, source=load_c_source("rmsnorm_naive.c")), Genome(params={"VEC": 8, "UNROLL": 2})]

    def compile_flags(self) -> list[str]:
        return ["-fopenmp"] if self.args.threads > 1 else []

    def full_case(self) -> Case:
        return {"rows": self.args.rows, "cols": self.args.cols}

    def check_cases(self, rng: np.random.Generator) -> list[Case]:
        fixed = [(1, 1), (3, 7), (5, 33), (8, 576), (2, 1000)]
        drawn = [(int(rng.integers(1, 40)), int(rng.integers(1, 600))) for _ in range(2)]
        return [{"rows": r, "cols": c} for r, c in fixed + drawn]

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Rows spread like a decoder's residual stream (a few large outliers); weights near 1. Where there are
        two rows or more, the middle one has a mean square near ``eps``: a kernel that drops or misplaces eps
        is off there by about 1.4x on every draw, not only when a row happens to be all zeros."""
        rows, cols = case["rows"], case["cols"]
        x = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(3.0)
        x[:, :: max(1, cols // 4)] *= np.float32(20.0)
        if rows > 1:
            middle = x[rows // 2]
            mean_square = max(float(np.mean(np.square(middle, dtype=np.float64))), 1e-30)
            middle *= np.float32(np.sqrt(self.args.eps / mean_square))
        w = (1.0 + 0.2 * rng.standard_normal(cols)).astype(np.float32)
        return {"x": x, "w": w}

    def outputs(self, case: Case) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"y": ((case["rows"], case["cols"]), np.dtype(np.float32))}

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """The decoder's numpy RMSNorm (its default for the slot)."""
        from runtime.decoder.ops import np_rmsnorm

        outputs["y"][...] = np_rmsnorm(inputs["x"], inputs["w"], self.args.eps)

    def value_kinds(self) -> tuple[str, ...]:
        """Typical values, huge ones (a sum of squares near overflow), tiny ones (the mean square below eps),
        zero, signed-zero and subnormal ones (see runtime.task.VALUE_KINDS)."""
        return VALUE_KINDS

    def slot_args(self, operands: Mapping[str, Any], out: np.ndarray) -> list[Any]:
        x = operands["x"]
        return [x.shape[0], x.shape[1], float(operands["eps"]), x, operands["w"], out]

    def kernel_args(self, case: Case, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        return [case["rows"], case["cols"], float(self.args.eps), arrays["x"], arrays["w"], arrays["y"]]

    def tolerance(self, case: Case) -> tuple[float, float]:
        return (1e-4, 1e-5)

    def work(self, case: Case) -> float:
        """Bytes moved: x read, y written (w stays in cache)."""
        return case["rows"] * case["cols"] * 8 / 1e9

    def descriptors(self) -> dict[str, Descriptor]:
        return {
            **super().descriptors(),
            "vector_width": Descriptor(
                "vector_width", "VEC * UNROLL: floats per row in flight",
                lambda g, m: float(g.params.get("VEC", 1) * g.params.get("UNROLL", 1)), 0.0, 128.0,
            ),  # fmt: skip
        }

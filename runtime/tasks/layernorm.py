"""The built-in ``layernorm`` task: fp32 layer norm over the last axis, shaped like the engine's (MiniLM's 384)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import Field

from genome import ChoiceParam, Genome, ParamSpace, Pow2Param
from runtime.slots import Slot, SlotTask
from runtime.task import VALUE_KINDS, Case, Descriptor, TaskArgs
from runtime.tasks._common import load_c_source

__all__ = ["LayerNorm"]


class LayerNormArgs(TaskArgs):
    """Shape of the timed case: the engine normalises [tokens, hidden] activations."""

    rows: int = Field(2048, ge=1, description="rows (tokens of a batch)")
    cols: int = Field(384, ge=1, description="length of each row (the hidden size)")
    eps: float = Field(1e-12, gt=0, description="added to the variance (BERT's layer_norm_eps)")


class LayerNorm(SlotTask):
    """Row-wise layer norm; the template varies vector width, accumulators and one or two passes.

    Its elites fill the engine's ``layernorm`` slot (``runtime.engine``).
    """

    name = "layernorm"
    unit = "GB/s"
    description = "fp32 layer norm over the last axis of a [rows, cols] matrix, with gamma and beta"
    signature = (
        "void kernel(int rows, int cols, float eps, const float *x, const float *gamma, const float *beta, float *y)"
    )
    slot = Slot("layernorm")
    Args = LayerNormArgs
    args: LayerNormArgs

    def space(self) -> ParamSpace:
        return ParamSpace(
            {
                "VEC": Pow2Param(type="pow2", low=4, high=16),
                "UNROLL": Pow2Param(type="pow2", low=1, high=4),
                "PASSES": ChoiceParam(type="choice", values=("TWO", "ONE")),
            }
        )

    def template(self) -> str:
        return load_c_source("layernorm_template.c")

    def seeds(self) -> list[Genome]:
        """The naive scalar kernel, and a modest template point."""
        return [Genome(params={}, source=load_c_source("layernorm_naive.c")),
                Genome(params={"VEC": 4, "UNROLL": 1, "PASSES": "TWO"})]

    def compile_flags(self) -> list[str]:
        return ["-fopenmp"] if self.args.threads > 1 else []

    def full_case(self) -> Case:
        return {"rows": self.args.rows, "cols": self.args.cols}

    def check_cases(self, rng: np.random.Generator) -> list[Case]:
        fixed = [(1, 1), (3, 7), (5, 33), (7, 384), (2, 1000)]
        drawn = [(int(rng.integers(1, 40)), int(rng.integers(1, 600))) for _ in range(2)]
        return [{"rows": r, "cols": c} for r, c in fixed + drawn]

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Rows with an offset and a spread like a transformer's residual stream; gamma near 1, beta near 0."""
        rows, cols = case["rows"], case["cols"]
        x = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(2.0) + np.float32(0.5)
        gamma = (1.0 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
        beta = (0.1 * rng.standard_normal(cols)).astype(np.float32)
        return {"x": x, "gamma": gamma, "beta": beta}

    def outputs(self, case: Case) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"y": ((case["rows"], case["cols"]), np.dtype(np.float32))}

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """The engine's numpy layer norm (its default for the slot)."""
        from runtime.engine.ops import np_layernorm

        outputs["y"][...] = np_layernorm(inputs["x"], inputs["gamma"], inputs["beta"], self.args.eps)

    def value_kinds(self) -> tuple[str, ...]:
        """Typical values, huge values (a variance that overflows), tiny ones (one that underflows),
        zero, signed-zero and subnormal ones (see runtime.task.VALUE_KINDS)."""
        return VALUE_KINDS

    def slot_args(self, operands: Mapping[str, Any], out: np.ndarray) -> list[Any]:
        x = operands["x"]
        return [x.shape[0], x.shape[1], float(operands["eps"]), x, operands["gamma"], operands["beta"], out]

    def kernel_args(self, case: Case, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        return [case["rows"], case["cols"], float(self.args.eps), arrays["x"], arrays["gamma"], arrays["beta"],
                arrays["y"]]

    def tolerance(self, case: Case) -> tuple[float, float]:
        return (1e-4, 1e-4)

    def error_scale(self, case: Case, inputs: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray],
                    ) -> Mapping[str, np.ndarray]:  # fmt: skip
        """``|gamma * xhat| + |beta|``: the size of the two terms each element adds, which bounds its rounding where
        they cancel (a huge gamma and beta, whose sum is near zero)."""
        x = inputs["x"].astype(np.float64)
        xc = x - x.mean(axis=-1, keepdims=True)
        xhat = xc / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + self.args.eps)
        return {"y": np.abs(inputs["gamma"].astype(np.float64) * xhat) + np.abs(inputs["beta"].astype(np.float64))}

    def work(self, case: Case) -> float:
        """Bytes moved: x read, y written (gamma and beta stay in cache)."""
        return case["rows"] * case["cols"] * 8 / 1e9

    def descriptors(self) -> dict[str, Descriptor]:
        return {
            **super().descriptors(),
            "vector_width": Descriptor(
                "vector_width", "VEC * UNROLL: floats per row in flight",
                lambda g, m: float(g.params.get("VEC", 1) * g.params.get("UNROLL", 1)), 0.0, 64.0,
            ),
        }

"""The built-in ``gelu`` task: fused bias + erf GELU, fp32, shaped like MiniLM's feed-forward ([tokens, 1536])."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import Field

from genome import ChoiceParam, Genome, ParamSpace, Pow2Param
from runtime.slots import Slot, SlotTask
from runtime.task import VALUE_KINDS, Case, Descriptor, TaskArgs
from runtime.tasks._common import load_c_source

__all__ = ["Gelu"]


class GeluArgs(TaskArgs):
    rows: int = Field(2048, ge=1, description="rows (tokens of a batch)")
    cols: int = Field(1536, ge=1, description="length of each row (the feed-forward width)")


class Gelu(SlotTask):
    """``y = gelu(x + bias)`` row-wise; the template varies vector width, unrolling and the erf.

    Its elites fill the engine's ``gelu`` slot (``runtime.engine``).
    """

    name = "gelu"
    unit = "GB/s"
    description = "fp32 fused bias + erf GELU over a [rows, cols] matrix, bias broadcast over rows"
    signature = "void kernel(int rows, int cols, const float *x, const float *bias, float *y)"
    slot = Slot("gelu")
    Args = GeluArgs
    args: GeluArgs

    def space(self) -> ParamSpace:
        return ParamSpace(
            {
                "VEC": Pow2Param(type="pow2", low=4, high=16),
                "UNROLL": Pow2Param(type="pow2", low=1, high=4),
                "ERF": ChoiceParam(type="choice", values=("POLY", "LIBM")),
            }
        )

    def template(self) -> str:
        return load_c_source("gelu_template.c")

    def seeds(self) -> list[Genome]:
        return [Genome(params={}, source=load_c_source("gelu_naive.c")),
                Genome(params={"VEC": 4, "UNROLL": 1, "ERF": "LIBM"})]

    def compile_flags(self) -> list[str]:
        return ["-fopenmp"] if self.args.threads > 1 else []

    def full_case(self) -> Case:
        return {"rows": self.args.rows, "cols": self.args.cols}

    def check_cases(self, rng: np.random.Generator) -> list[Case]:
        fixed = [(1, 1), (3, 7), (5, 33), (2, 1536)]
        drawn = [(int(rng.integers(1, 40)), int(rng.integers(1, 600))) for _ in range(2)]
        return [{"rows": r, "cols": c} for r, c in fixed + drawn]

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Pre-activations spanning GELU's curved range and both tails."""
        x = rng.standard_normal((case["rows"], case["cols"]), dtype=np.float32) * np.float32(3.0)
        return {"x": x, "bias": (0.5 * rng.standard_normal(case["cols"])).astype(np.float32)}

    def outputs(self, case: Case) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"y": ((case["rows"], case["cols"]), np.dtype(np.float32))}

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """The engine's numpy bias + GELU (its default for the slot)."""
        from runtime.engine.ops import np_bias_gelu

        outputs["y"][...] = np_bias_gelu(inputs["x"], inputs["bias"])

    def value_kinds(self) -> tuple[str, ...]:
        """Typical values, huge values (an exp-based tanh that overflows), tiny,
        zero, signed-zero and subnormal ones (see runtime.task.VALUE_KINDS)."""
        return VALUE_KINDS

    def slot_args(self, operands: Mapping[str, Any], out: np.ndarray) -> list[Any]:
        x = operands["x"]
        return [x.shape[0], x.shape[1], x, operands["bias"], out]

    def kernel_args(self, case: Case, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        return [case["rows"], case["cols"], arrays["x"], arrays["bias"], arrays["y"]]

    def tolerance(self, case: Case) -> tuple[float, float]:
        return (1e-4, 2e-6)

    def work(self, case: Case) -> float:
        """Bytes moved: x read, y written."""
        return case["rows"] * case["cols"] * 8 / 1e9

    def descriptors(self) -> dict[str, Descriptor]:
        return {
            **super().descriptors(),
            "vector_width": Descriptor(
                "vector_width", "VEC * UNROLL: floats in flight",
                lambda g, m: float(g.params.get("VEC", 1) * g.params.get("UNROLL", 1)), 0.0, 64.0,
            ),
        }

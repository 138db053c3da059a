"""The built-in ``softmax_cuda`` task: row-wise fp32 softmax on the GPU (warp- or block-per-row)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from genome import ChoiceParam, Genome, ParamSpace, Pow2Param
from runtime.cuda_task import CudaTask, Launch, LaunchError, load_cuda_source, need
from runtime.task import Case, Descriptor, TaskArgs
from runtime.tasks.softmax import Softmax

__all__ = ["SoftmaxCuda"]


class SoftmaxCudaArgs(TaskArgs):
    """Shape of the timed case (large enough by default that it does not fit in a GPU's L2)."""

    rows: int = Field(8192, ge=1, description="independent rows")
    cols: int = Field(4096, ge=1, description="length of each row (the softmax axis)")


class SoftmaxCuda(CudaTask):
    """Row-wise softmax; the template's VARIANT maps a row to a warp or to a whole block."""

    name = "softmax_cuda"
    unit = "GB/s"
    description = "fp32 softmax over the last axis of a [rows, cols] matrix, on an NVIDIA GPU"
    signature = 'extern "C" __global__ void kernel(int rows, int cols, const float *x, float *y)'
    gpu_reference = "softmax"
    Args = SoftmaxCudaArgs
    args: SoftmaxCudaArgs

    def space(self) -> ParamSpace:
        return ParamSpace(
            {
                "VARIANT": ChoiceParam(type="choice", values=("WARP", "BLOCK")),
                "WARPS_PER_BLOCK": Pow2Param(type="pow2", low=1, high=32),
                "VEC": Pow2Param(type="pow2", low=1, high=4),
                "UNROLL": Pow2Param(type="pow2", low=1, high=8),
                "ONLINE": ChoiceParam(type="choice", values=(False, True)),
                "EXP": ChoiceParam(type="choice", values=("EXPF", "FAST")),
            },
            [],
        )

    def template(self) -> str:
        return load_cuda_source("softmax_template.cu")

    def seeds(self) -> list[Genome]:
        """The naive kernel (one lane per row), a warp-per-row and a block-per-row template point."""
        base = {"WARPS_PER_BLOCK": 4, "VEC": 1, "UNROLL": 1, "ONLINE": False, "EXP": "EXPF"}
        return [
            Genome(params={**base, "VARIANT": "WARP"}, source=load_cuda_source("softmax_naive.cu")),
            Genome(params={**base, "VARIANT": "WARP"}),
            Genome(params={**base, "VARIANT": "BLOCK"}),
        ]

    def launch(self, params: Mapping[str, Any], case: Case) -> Launch:
        (wpb,) = need(params, "WARPS_PER_BLOCK")
        variant = params.get("VARIANT")
        if variant == "WARP":
            return Launch(grid=(-(-case["rows"] // wpb), 1, 1), block=(32 * wpb, 1, 1))
        if variant == "BLOCK":
            return Launch(grid=(case["rows"], 1, 1), block=(32 * wpb, 1, 1))
        raise LaunchError(f"VARIANT must be 'WARP' or 'BLOCK' (got {variant!r})")

    def full_case(self) -> Case:
        return {"rows": self.args.rows, "cols": self.args.cols}

    # Shapes, inputs, reference, tolerance and work are the CPU task's: the same softmax, the same checks.
    check_cases = Softmax.check_cases
    inputs = Softmax.inputs
    outputs = Softmax.outputs
    reference = Softmax.reference
    tolerance = Softmax.tolerance
    work = Softmax.work

    def kernel_args(self, case: Case, arrays: Mapping[str, Any]) -> list[Any]:
        return [case["rows"], case["cols"], arrays["x"], arrays["y"]]

    def descriptors(self) -> dict[str, Descriptor]:
        return {
            **super().descriptors(),
            "vector_width": Descriptor(
                "vector_width",
                "VEC * UNROLL: floats per thread in flight",
                lambda g, m: float(g.params.get("VEC", 1) * g.params.get("UNROLL", 1)),
                0.0,
                32.0,
            ),
            "threads_per_row": Descriptor(
                "threads_per_row",
                "32 (WARP) or 32 * WARPS_PER_BLOCK (BLOCK): threads sharing one row",
                lambda g, m: 32.0 * (g.params.get("WARPS_PER_BLOCK", 1) if g.params.get("VARIANT") == "BLOCK" else 1),
                0.0,
                1024.0,
            ),
        }

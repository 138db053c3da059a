"""The bf16 linear layer (runtime.tasks.linear_bf16) against numpy's fp32 ``x @ w + b``, one thread, side by side.

    python bench/linear_bf16_vs_blas.py --run-dir /tmp/lb16     # the best kernel of a run
    python bench/linear_bf16_vs_blas.py                         # a fixed template point (AMX 2x2 tiles)

For each MiniLM shape (k, n) at m = 64 and 256 tokens: GFLOP/s of both and the ratio (numpy time / kernel
time: > 1 means the bf16 kernel is faster). The kernel's output is checked against the task's reference
(numpy on bf16-rounded operands) first. numpy multiplies fp32, so the ratio includes the precision it gives up.
"""

from __future__ import annotations

from _side_by_side import linear_main

from runtime.tasks.linear_bf16 import MINILM_SHAPES, LinearBf16

FIXED_POINT = {"ISA": "AMX", "AMX_MT": 2, "AMX_NT": 2, "AMX_PANEL": 32, "MR": 6, "NR": 4, "KU": 2}
"""A good point of the template when no run is given: 2 x 2 AMX C tiles, 32 rows of x converted at a time."""


def main() -> None:
    linear_main(
        __doc__, lambda m, k, n: LinearBf16({"m": m, "k": k, "n": n}), FIXED_POINT, MINILM_SHAPES, "bf16 linear"
    )


if __name__ == "__main__":
    main()

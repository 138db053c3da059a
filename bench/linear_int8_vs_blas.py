"""The int8 linear layer (runtime.tasks.linear_int8) against numpy's fp32 ``x @ w + b``, one thread, side by side.

    python bench/linear_int8_vs_blas.py --run-dir /tmp/li8      # the best kernel of a run
    python bench/linear_int8_vs_blas.py                         # a fixed template point (AMX 1x3 tiles)

For each MiniLM shape (k, n) at m = 64 and 256 tokens: GOP/s of both (2 m n k per call: int8 multiply-adds for
the kernel, fp32 ones for numpy, counted alike) and the ratio (numpy time / kernel time: > 1 means the int8
kernel is faster). The kernel's output is checked against the task's reference (the same quantisation in numpy)
first. The kernel quantises x on every call (included in its time); numpy multiplies the unquantised fp32 W, so
the ratio includes the precision int8 gives up.
"""

from __future__ import annotations

from _side_by_side import linear_main

from runtime.tasks.linear_bf16 import MINILM_SHAPES
from runtime.tasks.linear_int8 import LinearInt8

FIXED_POINT = {"ISA": "AMX", "AMX_MT": 1, "AMX_NT": 3, "PANEL": 16, "MR": 8, "NR": 2, "KU": 2}
"""A good point of the template when no run is given: 1 x 3 AMX C tiles, 16 rows of x quantised at a time."""


def main() -> None:
    linear_main(
        __doc__,
        lambda m, k, n: LinearInt8({"m": m, "k": k, "n": n}),
        FIXED_POINT,
        MINILM_SHAPES,
        "int8 linear",
        unit="GOP/s",
    )


if __name__ == "__main__":
    main()

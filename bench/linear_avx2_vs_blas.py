"""The linear slot's AVX2 kernels against numpy's fp32 ``x @ w + b``, one thread, side by side.

    python bench/linear_avx2_vs_blas.py int8 --run-dir runs/linear_int8_avx2_minilm   # the best kernel of a run
    python bench/linear_avx2_vs_blas.py f32 --ms 1 8 32                               # a fixed template point

``int8``: ``linear_int8_avx2`` (u8 activations quantised per token inside the kernel, s8 weights per channel,
``vpmaddwd``); its ratio includes the precision int8 gives up. ``f32``: ``linear_f32`` (fp32, W in panels of 8
columns), which gives up none. For each MiniLM shape (k, n) and m: the throughput of both (2 m n k per call)
and the ratio (numpy time / kernel time: > 1 means the kernel is faster), the kernel checked against its
task's reference first and timed behind the boundary (see _side_by_side).
"""

from __future__ import annotations

import sys

from _side_by_side import linear_main

from runtime.tasks.linear_bf16 import MINILM_SHAPES
from runtime.tasks.linear_f32 import LinearF32
from runtime.tasks.linear_int8_avx2 import LinearInt8Avx2

KINDS = {
    "int8": (LinearInt8Avx2, {"MR": 4, "NR": 1, "KU": 2, "PANEL": 64}, "int8 linear (AVX2)", "GOP/s"),
    "f32": (LinearF32, {"MR": 4, "NR": 3, "KU": 2, "PANEL": 64}, "fp32 linear (AVX2 + FMA)", "GFLOP/s"),
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in KINDS:
        raise SystemExit(f"usage: {sys.argv[0]} {{{','.join(KINDS)}}} [--run-dir DIR] [--ms M ...] [--json]")
    cls, point, title, unit = KINDS[sys.argv.pop(1)]
    linear_main(__doc__, lambda m, k, n: cls({"m": m, "k": k, "n": n}), point, MINILM_SHAPES, title, unit=unit)


if __name__ == "__main__":
    main()

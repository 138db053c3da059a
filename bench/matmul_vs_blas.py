"""The best evolved fp32 matmul against numpy's OpenBLAS, single thread, measured side by side.

    python bench/matmul_vs_blas.py --run-dir runs/matmul_cpu           # an existing run
    python bench/matmul_vs_blas.py --config configs/matmul_cpu.yaml    # run the search first

Prints GFLOP/s of both and the ratio (reference time / evolved time: > 1 means faster than BLAS) at
n = 256, 512, 1000 and 1024, plus the evaluations and wall time the search took and its climb.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _side_by_side import report, run_search, side_by_side

from archive import Run
from runtime.tasks.matmul import Matmul


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", type=Path, help="take the best kernel of this run")
    src.add_argument("--config", type=Path, help="run this config first (into --out)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_matmul"), help="run dir for --config")
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1000, 1024])
    ap.add_argument("--seconds", type=float, default=3.0, help="timing cap per size")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seconds = run_search(args.config, args.out) if args.config else None
    rd = Run.open(args.out if args.config else args.run_dir)
    measured = side_by_side(rd, lambda n: Matmul({"m": n, "n": n, "k": n}), args.sizes, seconds=args.seconds)
    report("fp32 matmul: best evolved kernel vs numpy (OpenBLAS), 1 thread", rd, measured, seconds, args.json)


if __name__ == "__main__":
    main()

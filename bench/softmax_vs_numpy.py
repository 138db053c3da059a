"""The best evolved row-wise softmax against numpy (max, exp, sum, divide), fp32, single thread.

    python bench/softmax_vs_numpy.py --run-dir runs/softmax_cpu
    python bench/softmax_vs_numpy.py --config configs/softmax_cpu.yaml

Prints GB/s of both and the ratio (> 1 means faster than numpy) at 4096 x 1024 and other shapes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _side_by_side import report, run_search, side_by_side

from archive import Run
from runtime.tasks.softmax import Softmax


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", type=Path, help="take the best kernel of this run")
    src.add_argument("--config", type=Path, help="run this config first (into --out)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_softmax"), help="run dir for --config")
    ap.add_argument("--cols", type=int, nargs="+", default=[1024, 4096, 1000], help="row lengths (4096 rows)")
    ap.add_argument("--seconds", type=float, default=3.0, help="timing cap per shape")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seconds = run_search(args.config, args.out) if args.config else None
    rd = Run.open(args.out if args.config else args.run_dir)
    measured = side_by_side(rd, lambda c: Softmax({"rows": 4096, "cols": c}), args.cols, seconds=args.seconds)
    report("fp32 row-wise softmax: best evolved kernel vs numpy, 1 thread", rd, measured, seconds, args.json)


if __name__ == "__main__":
    main()

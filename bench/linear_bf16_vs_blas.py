"""The bf16 linear layer (runtime.tasks.linear_bf16) against numpy's fp32 ``x @ w + b``, one thread, side by side.

    python bench/linear_bf16_vs_blas.py --run-dir /tmp/lb16     # the best kernel of a run
    python bench/linear_bf16_vs_blas.py                         # a fixed template point (AMX 2x2 tiles)

For each MiniLM shape (k, n) at m = 64 and 256 tokens: GFLOP/s of both and the ratio (numpy time / kernel
time: > 1 means the bf16 kernel is faster). The kernel's output is checked against the task's reference
(numpy on bf16-rounded operands) first. numpy multiplies fp32, so the ratio includes the precision it gives up.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from _side_by_side import climb
from threadpoolctl import threadpool_limits

from evo.rundir import RunDir
from genome import Genome
from runtime import TimingSettings
from runtime.backends import compile_source, load_kernel
from runtime.cascade import guarded_empty
from runtime.settings import CompilerSettings
from runtime.tasks.linear_bf16 import MINILM_SHAPES, LinearBf16
from runtime.timing import pinned, time_interleaved

FIXED_POINT = {"ISA": "AMX", "AMX_MT": 2, "AMX_NT": 2, "AMX_PANEL": 32, "MR": 6, "NR": 4, "KU": 2}
"""A good point of the template when no run is given: 2 x 2 AMX C tiles, 32 rows of x converted at a time."""


def measure(genome: Genome, compiler: CompilerSettings, ms: list[int], seconds: float) -> list[dict[str, Any]]:
    """Each MiniLM shape at each m: the kernel's and numpy's GFLOP/s, timed interleaved on one pinned core."""
    timing = TimingSettings(warmup=3, min_repeats=10, max_repeats=400, target_rel_spread=0.005, max_seconds=seconds)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, pinned(None, 1), threadpool_limits(1):
        for k, n in MINILM_SHAPES:
            for m in ms:
                task = LinearBf16({"m": m, "k": k, "n": n})
                lib = compile_source(
                    task.render(genome), compiler=compiler, extra_flags=task.compile_flags(), cache_dir=tmp
                )
                kernel = load_kernel(lib.path, task.kernel_name)
                case = task.full_case()
                inputs = task.inputs(case, np.random.default_rng(m * k + n))
                y = guarded_empty((m, n), np.float32)[1]
                expected = np.empty_like(y)
                call = kernel.bind(task.kernel_args(case, {**inputs, "y": y}))
                call()
                task.reference(case, inputs, {"y": expected})
                rtol, atol = task.tolerance(case)
                x, w, b, out = inputs["x"], inputs["w"], inputs["bias"], np.empty_like(y)

                def numpy_linear(x=x, w=w, b=b, out=out) -> None:
                    np.add(np.matmul(x, w, out=out), b, out=out)

                run = time_interleaved(call, numpy_linear, timing)
                work = task.work(case)
                rows.append(
                    {
                        "m": m,
                        "k": k,
                        "n": n,
                        "correct": bool(np.allclose(y, expected, rtol=rtol, atol=atol)),
                        "kernel_gflops": work / run.candidate.median,
                        "numpy_gflops": work / run.reference.median,
                        "ratio": run.reference.median / run.candidate.median,
                        "repeats": run.candidate.n,
                    }
                )
                kernel.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, help="take the best kernel of this run (default: a fixed point)")
    ap.add_argument("--ms", type=int, nargs="+", default=[64, 256], help="rows (tokens) per call")
    ap.add_argument("--seconds", type=float, default=2.0, help="timing cap per shape")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.run_dir:
        rd = RunDir.open(args.run_dir, readonly=True)
        best = rd.store.best(1)
        if not best:
            raise SystemExit(f"no ok candidate in {rd.path}")
        genome, compiler, label = best[0].genome, rd.frozen_config().evaluation.compiler, f"best of {rd.path}"
        history = climb(rd)
    else:
        genome, compiler, label, history = Genome(params=FIXED_POINT), CompilerSettings(), "fixed point", []
    rows = measure(genome, compiler, args.ms, args.seconds)
    if args.json:
        print(json.dumps({"kernel": label, "params": dict(genome.params), "climb": history, "shapes": rows}, indent=2))
        return
    print(f"bf16 linear ({label}: {dict(genome.params) or 'code genome'}) vs numpy fp32 x @ w + b, 1 thread")
    for r in history[-1:]:
        print(f"search: best {r['fitness']:.1f} GFLOP/s after {r['evals']} evals ({r['vs_reference']:.2f}x reference)")
    print(f"{'m':>5} {'k':>5} {'n':>5}  {'kernel GFLOP/s':>14}  {'numpy GFLOP/s':>13}  {'ratio':>6}  correct")
    for r in rows:
        print(
            f"{r['m']:>5} {r['k']:>5} {r['n']:>5}  {r['kernel_gflops']:>14.1f}  {r['numpy_gflops']:>13.1f}"
            f"  {r['ratio']:>5.2f}x  {r['correct']}"
        )


if __name__ == "__main__":
    main()

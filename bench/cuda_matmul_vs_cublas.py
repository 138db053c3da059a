"""The best evolved CUDA GEMM against cuBLAS at n = 1024, 4096, 8192, behind the trust boundary.

    python bench/cuda_matmul_vs_cublas.py --run-dir runs/matmul_cuda        # an existing run
    python bench/cuda_matmul_vs_cublas.py --config configs/matmul_cuda.yaml # run the search first

For each size the run's best is evaluated afresh by a sandboxed worker, as in a search: checked, then its
launches timed in a host of its own (its own CUDA context, CUDA events recorded by the host's code) interleaved
with the GPU reference in the worker's context (cuBLAS via ctypes, else torch or cupy), on fresh inputs every
round. Prints TFLOP/s of both and the ratio (reference time / evolved time: > 1 means faster than cuBLAS).
Needs a GPU, nvcc and pycuda.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _side_by_side import remeasure  # noqa: E402

from archive import Run  # noqa: E402
from evo.rundir import frozen_config  # noqa: E402
from runtime.settings import TaskSpec, TimingSettings  # noqa: E402
from runtime.toolchain.cuda_device import open_device  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", type=Path, help="take the best kernel of this run")
    src.add_argument("--config", type=Path, help="run this config first (into --out)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_matmul_cuda"), help="run dir for --config")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--seconds", type=float, default=2.0, help="timing cap per size")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    run_dir = args.run_dir
    if args.config is not None:
        subprocess.run([sys.executable, "-m", "evo", "run", str(args.config), "--run-dir", str(args.out)], check=True,
                       cwd=ROOT)  # fmt: skip
        run_dir = args.out
    rd = Run.open(run_dir)
    config, best = frozen_config(rd), rd.store.best(1)
    if not best:
        sys.exit(f"no ok candidate in {run_dir}")
    cand = best[0]
    dev = open_device()
    timing = TimingSettings(warmup=3, min_repeats=10, max_repeats=200, target_rel_spread=0.01, max_seconds=args.seconds)
    settings = config.evaluation.model_copy(update={"timing": timing, "check_trials": 1})
    specs = [TaskSpec(name=config.task.name, args={**config.task.args, "m": n, "n": n, "k": n}) for n in args.sizes]
    rows = []
    for n, r in zip(args.sizes, remeasure(cand.genome, specs, settings), strict=True):
        m = r.metrics
        rows.append({"n": n, "status": str(r.status), "error": r.error, "evolved_tflops": r.fitness,
                     "reference": m.get("reference_impl"), "reference_tflops": m.get("ref_fitness"),
                     "ratio": m.get("vs_reference"), "registers": m.get("registers"),
                     "occupancy": m.get("occupancy")})  # fmt: skip
    out = {"run_dir": str(run_dir), "gpu": dev.name, "arch": dev.arch, "best": cand.id, "params": cand.params,
           "dtype": config.task.args.get("dtype", "fp32"), "sizes": rows}  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{dev.name} ({dev.arch}); best {cand.id[:12]} of {run_dir}: {cand.params}")
    print(f"{'n':>6} {'evolved TFLOP/s':>16} {'reference':>10} {'ref TFLOP/s':>12} {'ratio':>7}")
    for r in rows:
        if r["evolved_tflops"] is None:
            print(f"{r['n']:>6} {r['status']}: {r['error']}")
            continue
        print(f"{r['n']:>6} {r['evolved_tflops']:>16.2f} {r['reference']:>10} {r['reference_tflops']:>12.2f} "
              f"{r['ratio']:>7.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

"""The best evolved CUDA GEMM against cuBLAS, in this one process, at n = 1024, 4096, 8192.

    python bench/cuda_matmul_vs_cublas.py --run-dir runs/matmul_cuda        # an existing run
    python bench/cuda_matmul_vs_cublas.py --config configs/matmul_cuda.yaml # run the search first

For each size: the evolved kernel and the GPU reference (cuBLAS via ctypes, else torch or cupy) are
timed interleaved with CUDA events through the runtime's one harness; prints TFLOP/s of both and the
ratio (reference time / evolved time: > 1 means faster than cuBLAS). Needs a GPU, nvcc and pycuda.
Correctness at each size is checked against the first call's cuBLAS output (same inputs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evo.rundir import RunDir  # noqa: E402
from runtime.backends import WorkerContext  # noqa: E402
from runtime.backends.cuda import CudaBackend, launch_for  # noqa: E402
from runtime.settings import TimingSettings  # noqa: E402
from runtime.task import load_task_class  # noqa: E402
from runtime.timing import time_interleaved  # noqa: E402
from runtime.toolchain.cuda_device import open_device  # noqa: E402
from runtime.toolchain.cuda_launch import arch_limits  # noqa: E402
from runtime.toolchain.cuda_reference import gpu_reference  # noqa: E402


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
    rd = RunDir.open(run_dir, readonly=True)
    config, best = rd.frozen_config(), rd.store.best(1)
    if not best:
        sys.exit(f"no ok candidate in {run_dir}")
    cand = best[0]
    dev = open_device()
    rows = []
    timing = TimingSettings(warmup=3, min_repeats=10, max_repeats=200, target_rel_spread=0.01, max_seconds=args.seconds)
    for n in args.sizes:
        task = config.task.model_copy(update={"args": {**config.task.args, "m": n, "n": n, "k": n}})
        t = load_task_class(task.name)(task.args)
        with tempfile.TemporaryDirectory() as cache:
            cuda = config.evaluation.cuda.model_copy(update={"arch": config.evaluation.cuda.arch or dev.arch})
            build = CudaBackend().compile(t, cand.genome, config.evaluation.model_copy(update={"cuda": cuda}),
                                          WorkerContext(cache, None, None))
            built, metrics = build.artifact.built, build.metrics
            kernel = dev.load(built.path, t.kernel_name)
            case = t.full_case()
            inputs = t.inputs(case, np.random.default_rng(0))
            bufs = {k: dev.buffer(v.shape, v.dtype, guard=256, sentinel=0xA5) for k, v in inputs.items()}
            for k, v in inputs.items():
                bufs[k].upload(v)
            outs = {k: dev.buffer(s, d, guard=256, sentinel=0xA5) for k, (s, d) in t.outputs(case).items()}
            refs = {k: dev.buffer(s, d, guard=0, sentinel=0) for k, (s, d) in t.outputs(case).items()}
            found = gpu_reference(t.gpu_reference, case, bufs, refs)
            if found is None:
                sys.exit("no GPU GEMM library here (cuBLAS, torch or cupy): nothing to compare against")
            ref_call, impl = found
            launch = launch_for(t, cand.genome.params, case, arch_limits(built.info.arch), built.info)
            call = kernel.bind(launch, t.kernel_args(case, {**bufs, **outs}))
            run = time_interleaved(call, ref_call, timing, timer=dev.time_call)
            got, want = outs["C"].download(), refs["C"].download()
            err = float(np.max(np.abs(got - want)) / max(1e-30, float(np.max(np.abs(want)))))
            work = t.work(case)
            rows.append({"n": n, "evolved_tflops": work / run.candidate.median, "reference": impl,
                         "reference_tflops": work / run.reference.median,
                         "ratio": run.reference.median / run.candidate.median, "max_rel_err_vs_ref": err,
                         "registers": metrics["registers"], "occupancy": metrics["occupancy"]})  # fmt: skip
            for b in (*bufs.values(), *outs.values(), *refs.values()):
                b.free()
    out = {"run_dir": str(run_dir), "gpu": dev.name, "arch": dev.arch, "best": cand.id, "params": cand.params,
           "dtype": config.task.args.get("dtype", "fp32"), "sizes": rows}  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{dev.name} ({dev.arch}); best {cand.id[:12]} of {run_dir}: {cand.params}")
    print(f"{'n':>6} {'evolved TFLOP/s':>16} {'reference':>10} {'ref TFLOP/s':>12} {'ratio':>7} {'rel err':>9}")
    for r in rows:
        print(f"{r['n']:>6} {r['evolved_tflops']:>16.2f} {r['reference']:>10} {r['reference_tflops']:>12.2f} "
              f"{r['ratio']:>7.3f} {r['max_rel_err_vs_ref']:>9.1e}")  # fmt: skip


if __name__ == "__main__":
    main()

"""Shared by the bench scripts: take a run's best candidate and time it against the task's reference,
side by side in this one process, on one pinned core, at several problem sizes; for the linear-layer tasks,
against numpy's fp32 ``x @ w + b`` instead (:func:`linear_main`).

Set thread counts before numpy loads: the comparison is single-threaded on both sides.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from archive import Candidate  # noqa: E402
from evo.rundir import RunDir  # noqa: E402
from genome import Genome  # noqa: E402
from runtime import Task, TimingSettings  # noqa: E402
from runtime.backends.kernels import guarded_empty, within_tolerance  # noqa: E402
from runtime.settings import CompilerSettings  # noqa: E402
from runtime.timing import pinned, time_interleaved  # noqa: E402
from runtime.toolchain import compile_source, load_kernel  # noqa: E402


def run_search(config: Path, run_dir: Path) -> float:
    """Runs ``evo run`` on ``config`` into a fresh ``run_dir``; returns its wall seconds."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "evo", "run", str(config), "--run-dir", str(run_dir)], check=True,
                   cwd=ROOT)
    return time.monotonic() - t0


def climb(rd: RunDir, marks: tuple[int, ...] = (1, 2, 5, 10, 25, 50, 100, 200, 300, 500)) -> list[dict[str, Any]]:
    """Best fitness and its vs_reference after the first n evaluations, as measured during the search."""
    best: Candidate | None = None
    rows, n = [], 0
    for c in rd.store.evaluated():
        n += 1
        if c.status == "ok" and c.fitness is not None and (best is None or c.fitness > (best.fitness or 0)):
            best = c
        if n in marks and best is not None:
            rows.append({"evals": n, "fitness": best.fitness, "vs_reference": best.metrics.get("vs_reference")})
    if best is not None and (not rows or rows[-1]["evals"] != n):
        rows.append({"evals": n, "fitness": best.fitness, "vs_reference": best.metrics.get("vs_reference")})
    return rows


def run_wall_seconds(rd: RunDir) -> float:
    cands = list(rd.store.evaluated())
    return max(c.evaluated_at or 0 for c in cands) - min(c.created_at for c in cands) if cands else 0.0


def side_by_side(
    rd: RunDir, make_task: Callable[[int], Task], sizes: list[int], *, seconds: float = 3.0
) -> dict[str, Any]:
    """Compiles the run's best candidate and times it against the reference at each size."""
    config = rd.frozen_config()
    best = rd.store.best(1)
    if not best:
        raise SystemExit(f"no ok candidate in {rd.path}")
    cand = best[0]
    timing = TimingSettings(warmup=3, min_repeats=10, max_repeats=400, target_rel_spread=0.005, max_seconds=seconds)
    results = []
    with tempfile.TemporaryDirectory() as tmp, pinned(None, 1):
        for size in sizes:
            task = make_task(size)
            lib = compile_source(task.render(cand.genome), compiler=config.evaluation.compiler,
                                 extra_flags=task.compile_flags(), cache_dir=tmp)
            kernel = load_kernel(lib.path, task.kernel_name)
            case = task.full_case()
            rng = np.random.default_rng(size)
            inputs = task.inputs(case, rng)
            outs = {k: guarded_empty(shape, dtype)[1] for k, (shape, dtype) in task.outputs(case).items()}
            refs = {k: np.empty(shape, dtype) for k, (shape, dtype) in task.outputs(case).items()}
            call = kernel.bind(task.kernel_args(case, {**inputs, **outs}))
            call()
            task.reference(case, inputs, refs)
            rtol, atol = task.tolerance(case)
            scales = task.error_scale(case, inputs, refs) or {}
            correct = all(within_tolerance(outs[k], refs[k], rtol, atol, scales.get(k)).all() for k in outs)
            run = time_interleaved(call, lambda t=task, c=case, i=inputs, r=refs: t.reference(c, i, r), timing)
            work = task.work(case)
            results.append({
                "size": size, "case": case, "correct": bool(correct),
                "fitness": work / run.candidate.median, "reference_fitness": work / run.reference.median,
                "ratio": run.reference.median / run.candidate.median, "repeats": run.candidate.n,
                "rel_uncertainty": run.rel_uncertainty,
            })
            kernel.close()
    return {"candidate": cand.id, "params": dict(cand.params), "unit": cand.unit, "sizes": results}


def report(title: str, rd: RunDir, measured: dict[str, Any], search_seconds: float | None, as_json: bool) -> None:
    out = {
        "run_dir": str(rd.path),
        "evaluations": rd.store.count() - rd.store.count("pending"),
        "run_wall_seconds": search_seconds if search_seconds is not None else run_wall_seconds(rd),
        "climb": climb(rd),
        **measured,
    }
    if as_json:
        print(json.dumps(out, indent=2))
        return
    unit = measured["unit"]
    print(f"{title}\nrun {out['run_dir']}: {out['evaluations']} evaluations, {out['run_wall_seconds']:.0f} s")
    for c in rd.store.by_operator("seed", limit=10):
        if c.fitness is not None:
            kind = "code genome" if not c.params else "template point"
            print(f"seed ({kind}) {c.id[:12]}: {c.fitness:8.3f} {unit}  ({c.metrics.get('vs_reference', 0):.4f}x)")
    print("climb (best as measured during the search):")
    for r in out["climb"]:
        print(f"  after {r['evals']:>4} evals: {r['fitness']:8.2f} {unit}  ({r['vs_reference']:.3f}x reference)")
    print(f"best candidate {measured['candidate'][:12]}: {measured['params']}")
    print("side by side in this process, one pinned core:")
    for r in measured["sizes"]:
        print(f"  {r['case']}: evolved {r['fitness']:8.2f} {unit}  reference {r['reference_fitness']:8.2f} {unit}"
              f"  ratio {r['ratio']:.3f}x  (n={r['repeats']}, correct={r['correct']})")


# --- linear layers (runtime.tasks.linear_bf16, linear_int8) against numpy's fp32 x @ w + b ---------------


def linear_vs_numpy(
    make_task: Callable[[int, int, int], Task],
    genome: Genome,
    compiler: CompilerSettings,
    shapes: Sequence[tuple[int, int]],
    ms: list[int],
    seconds: float,
) -> list[dict[str, Any]]:
    """Each ``(k, n)`` of ``shapes`` at each m: the kernel's rate (``task.work`` per second) and numpy's
    ``x @ w + b`` (fp32, the task's ``w`` and ``bias`` inputs) at the same work, timed interleaved on one pinned
    core. The kernel's output is checked against the task's reference first (``correct``)."""
    timing = TimingSettings(warmup=3, min_repeats=10, max_repeats=400, target_rel_spread=0.005, max_seconds=seconds)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, pinned(None, 1), threadpool_limits(1):
        for k, n in shapes:
            for m in ms:
                task = make_task(m, k, n)
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


def linear_main(
    doc: str,
    make_task: Callable[[int, int, int], Task],
    fixed_point: dict[str, Any],
    shapes: Sequence[tuple[int, int]],
    title: str,
    unit: str = "GFLOP/s",
) -> None:
    """The command line of a linear-layer bench: the best kernel of ``--run-dir`` (or ``fixed_point``) against
    numpy per shape and m, as a table or ``--json``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        genome, compiler, label, history = Genome(params=fixed_point), CompilerSettings(), "fixed point", []
    rows = linear_vs_numpy(make_task, genome, compiler, shapes, args.ms, args.seconds)
    if args.json:
        print(json.dumps({"kernel": label, "params": dict(genome.params), "climb": history, "shapes": rows}, indent=2))
        return
    print(f"{title} ({label}: {dict(genome.params) or 'code genome'}) vs numpy fp32 x @ w + b, 1 thread")
    for r in history[-1:]:
        print(f"search: best {r['fitness']:.1f} {unit} after {r['evals']} evals ({r['vs_reference']:.2f}x reference)")
    head, width = f"kernel {unit}", len(f"numpy {unit}")
    print(f"{'m':>5} {'k':>5} {'n':>5}  {head:>14}  {'numpy ' + unit:>{width}}  {'ratio':>6}  correct")
    for r in rows:
        print(
            f"{r['m']:>5} {r['k']:>5} {r['n']:>5}  {r['kernel_gflops']:>14.1f}  {r['numpy_gflops']:>{width}.1f}"
            f"  {r['ratio']:>5.2f}x  {r['correct']}"
        )

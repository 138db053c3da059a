"""Shared by the bench scripts: take a run's best candidate and time it against the task's reference at
several problem sizes; for the linear-layer tasks, against numpy's fp32 ``x @ w + b`` too (:func:`linear_main`).

Candidate code runs only behind the boundary, as in a search: each figure of ours comes from a fresh evaluation
by a sandboxed worker, which runs the candidate in a host of its own (the sandbox user, the system-call filter)
and times it interleaved with the task's reference on one pinned core, under the machine's timing lock, on
fresh inputs every round. Nothing of the candidate runs in this process.

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

from archive import Candidate, Run  # noqa: E402
from evo.rundir import frozen_config  # noqa: E402
from genome import Genome  # noqa: E402
from runtime import EvalRequest, EvalResult, EvalSettings, Status, Task, TaskSpec, TimingSettings  # noqa: E402
from runtime.settings import CompilerSettings  # noqa: E402
from runtime.timing import pinned, time_interleaved  # noqa: E402


def run_search(config: Path, run_dir: Path) -> float:
    """Runs ``evo run`` on ``config`` into a fresh ``run_dir``; returns its wall seconds."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "evo", "run", str(config), "--run-dir", str(run_dir)], check=True,
                   cwd=ROOT)
    return time.monotonic() - t0


def climb(rd: Run, marks: tuple[int, ...] = (1, 2, 5, 10, 25, 50, 100, 200, 300, 500)) -> list[dict[str, Any]]:
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


def run_wall_seconds(rd: Run) -> float:
    cands = list(rd.store.evaluated())
    return max(c.evaluated_at or 0 for c in cands) - min(c.created_at for c in cands) if cands else 0.0


def _timing(seconds: float) -> TimingSettings:
    return TimingSettings(warmup=3, min_repeats=10, max_repeats=400, target_rel_spread=0.005, max_seconds=seconds,
                          min_seconds=min(1.0, seconds))  # fmt: skip


def careful_settings(evaluation: EvalSettings, seconds: float) -> EvalSettings:
    """A run's evaluation settings, timed more carefully than a search affords (up to ``seconds``), checked once."""
    return evaluation.model_copy(update={"timing": _timing(seconds), "check_trials": 1})


def remeasure(genome: Genome, specs: Sequence[TaskSpec], settings: EvalSettings) -> list[EvalResult]:
    """``genome`` evaluated afresh (checked, then timed against the reference) at each of ``specs``, by a
    sandboxed worker (a new one for these evaluations, its compile cache a temporary directory)."""
    from runtime.executors import LocalPool

    out = []
    with tempfile.TemporaryDirectory() as tmp, LocalPool(workers=1, log_dir=os.path.join(tmp, "logs")) as pool:
        for i, spec in enumerate(specs):
            paths = tuple(p for p in sys.path if p)
            pool.submit(EvalRequest(key=f"{genome.id}#{i}", genome=genome, task=spec, settings=settings,
                                    cache_dir=os.path.join(tmp, "cache"), sys_path=paths))  # fmt: skip
            got = pool.next_result(settings.sandbox.timeout + 60)
            out.append(got[1] if got else EvalResult(status=Status.TIMEOUT, error="no result"))
    return out


def side_by_side(
    rd: Run, make_task: Callable[[int], Task], sizes: list[int], *, seconds: float = 3.0
) -> dict[str, Any]:
    """The run's best candidate evaluated again at each size, behind the boundary (:func:`remeasure`)."""
    config = frozen_config(rd)
    best = rd.store.best(1)
    if not best:
        raise SystemExit(f"no ok candidate in {rd.path}")
    cand = best[0]
    settings = careful_settings(config.evaluation, seconds)
    tasks = [make_task(size) for size in sizes]
    specs = [TaskSpec(name=config.task.name, args=t.args.model_dump(mode="json")) for t in tasks]
    results = []
    for size, task, r in zip(sizes, tasks, remeasure(cand.genome, specs, settings), strict=True):
        m = r.metrics
        ok = r.status == Status.OK and r.fitness is not None
        results.append({
            "size": size, "case": task.full_case(), "correct": r.status == Status.OK, "status": str(r.status),
            "error": r.error, "fitness": r.fitness if ok else None,
            "reference_fitness": m.get("ref_fitness"), "ratio": m.get("vs_reference"),
            "repeats": m.get("n_repeats"), "rel_uncertainty": m.get("rel_uncertainty"),
        })  # fmt: skip
    return {"candidate": cand.id, "params": dict(cand.params), "unit": cand.unit, "sizes": results}


def report(title: str, rd: Run, measured: dict[str, Any], search_seconds: float | None, as_json: bool) -> None:
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
    print("evaluated again behind the boundary (a sandboxed worker, the kernel in a host of its own), interleaved "
          "with the reference on one pinned core:")
    for r in measured["sizes"]:
        if r["fitness"] is None:
            print(f"  {r['case']}: {r['status']}: {r['error']}")
            continue
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
    """Each ``(k, n)`` of ``shapes`` at each m: the kernel's rate (``task.work`` per second) against numpy's
    ``x @ w + b`` (fp32, the task's ``w`` and ``bias`` inputs) at the same work. Two ratios, each measured side by
    side: the kernel against the task's reference, behind the boundary (:func:`remeasure`: checked, then timed
    interleaved by a sandboxed worker); and the reference against numpy's fp32 GEMM, both numpy, interleaved
    here. Their product is the kernel against numpy."""
    settings = EvalSettings(compiler=compiler, timing=_timing(seconds), check_trials=1)
    tasks = [make_task(m, k, n) for k, n in shapes for m in ms]
    specs = [TaskSpec(name=t.name, args=t.args.model_dump(mode="json")) for t in tasks]
    rows = []
    with pinned(None, 1), threadpool_limits(1):
        for task, r in zip(tasks, remeasure(genome, specs, settings), strict=True):
            case = task.full_case()
            inputs = task.inputs(case, np.random.default_rng(case["m"] * case["k"] + case["n"]))
            x, w, b = inputs["x"], inputs["w"], inputs["bias"]
            out, expected = np.empty((case["m"], case["n"]), np.float32), np.empty((case["m"], case["n"]), np.float32)

            def numpy_linear(x=x, w=w, b=b, out=out) -> None:
                np.add(np.matmul(x, w, out=out), b, out=out)

            def reference(task=task, case=case, inputs=inputs, expected=expected) -> None:
                task.reference(case, inputs, {"y": expected})

            run = time_interleaved(numpy_linear, reference, _timing(seconds))  # numpy first: the "candidate" slot
            work = task.work(case)
            ok = r.status == Status.OK and r.fitness is not None
            ref_vs_numpy = run.candidate.median / run.reference.median  # > 1: the reference is the faster
            rows.append({
                "m": case["m"], "k": case["k"], "n": case["n"], "correct": r.status == Status.OK,
                "status": str(r.status), "error": r.error,
                "kernel_gflops": r.fitness if ok else None, "vs_reference": r.metrics.get("vs_reference"),
                "reference_vs_numpy": ref_vs_numpy, "numpy_gflops": work / run.candidate.median,
                "ratio": r.metrics["vs_reference"] * ref_vs_numpy if ok else None,
                "repeats": r.metrics.get("n_repeats"),
            })  # fmt: skip
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
        rd = Run.open(args.run_dir)
        best = rd.store.best(1)
        if not best:
            raise SystemExit(f"no ok candidate in {rd.path}")
        genome, compiler, label = best[0].genome, frozen_config(rd).evaluation.compiler, f"best of {rd.path}"
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
        if r["ratio"] is None:
            print(f"{r['m']:>5} {r['k']:>5} {r['n']:>5}  {r['status']}: {r['error']}")
            continue
        print(
            f"{r['m']:>5} {r['k']:>5} {r['n']:>5}  {r['kernel_gflops']:>14.1f}  {r['numpy_gflops']:>{width}.1f}"
            f"  {r['ratio']:>5.2f}x  {r['correct']}"
        )

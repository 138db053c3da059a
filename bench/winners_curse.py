"""Winner's curse: the best's recorded fitness against the same genome re-measured after the run.

For each seed, runs the config (``--max-evals`` caps it), then evaluates the run's best genome again,
``--repeats`` times, each time in a fresh worker (so in a fresh candidate host), with the run's own
evaluation settings, and prints recorded / re-measured - 1 (positive: the run over-rated its winner).

    python bench/winners_curse.py --config configs/matmul_cpu.yaml --seeds 1 2 3 --max-evals 120

Target: median gap <= 3%, none above 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evo.rundir import RunDir  # noqa: E402
from runtime import EvalRequest  # noqa: E402
from runtime.pool import LocalPool  # noqa: E402


def remeasure(rd: RunDir, repeats: int) -> tuple[float, list[float]]:
    """The best's recorded fitness, and its fitness evaluated again ``repeats`` times, each in a new pool."""
    config = rd.frozen_config()
    sys_path = tuple(json.loads(rd.store.get_meta("sys_path") or "[]"))
    best = rd.store.best(1)
    if not best:
        raise SystemExit(f"no ok candidate in {rd.path}")
    cand = best[0]
    again = []
    with tempfile.TemporaryDirectory() as tmp:
        settings = config.evaluation.model_copy(
            update={"timing": config.evaluation.timing.model_copy(update={"lock_file": os.path.join(tmp, "lock")})}
        )
        for i in range(repeats):
            req = EvalRequest(key=f"{cand.id}-{i}", genome=cand.genome, task=config.task, settings=settings,
                              cache_dir=os.path.join(tmp, "cache"), sys_path=sys_path)  # fmt: skip
            with LocalPool(workers=1) as pool:
                pool.submit(req)
                got = pool.next_result(600)
            assert got is not None and got[1].status == "ok", got
            again.append(float(got[1].fitness))
    return float(cand.fitness), again


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--max-evals", type=int, default=None, help="cap each run's evaluations")
    ap.add_argument("--repeats", type=int, default=3, help="re-measurements of each best")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_winners_curse"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for seed in args.seeds:
        run_dir = args.out / f"seed{seed}"
        cmd = [sys.executable, "-m", "evo", "run", str(args.config), "--run-dir", str(run_dir), "--seed", str(seed)]
        if args.max_evals:
            cmd += ["--max-evals", str(args.max_evals)]
        t0 = time.monotonic()
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        recorded, again = remeasure(RunDir.open(run_dir, readonly=True), args.repeats)
        median = statistics.median(again)
        rows.append({"seed": seed, "recorded": recorded, "remeasured": again, "gap": recorded / median - 1,
                     "run_s": time.monotonic() - t0})  # fmt: skip
        print(f"seed {seed}: recorded {recorded:.2f}, re-measured {', '.join(f'{a:.2f}' for a in again)} "
              f"(median {median:.2f}): gap {rows[-1]['gap']:+.1%}", flush=True)  # fmt: skip
    gaps = [r["gap"] for r in rows]
    print(f"median gap {statistics.median(gaps):+.1%}, largest {max(gaps, key=abs):+.1%} "
          f"(target: median <= 3%, none above 5%)")  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

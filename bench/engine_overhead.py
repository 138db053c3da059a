"""What evaluating an engine candidate costs beyond its load test, and what its figures read.

Evaluates K engine candidates (the task's seeds, in turn) of a short load through LocalPool, one worker,
the reference re-measured before every candidate (``reference_every_s: 0``), and prints per candidate:
the stages (``overhead_s`` = total - the similarity check, the load tests and the verification - lock
wait), and the reference's throughput. Run it on two trees to compare them side by side.

    python bench/engine_overhead.py --k 12
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime import EvalRequest, EvalSettings, TaskSpec  # noqa: E402
from runtime.engine.task import EngineTask  # noqa: E402
from runtime.executors import LocalPool  # noqa: E402

ARGS = {"threads": 1, "concurrency": 4, "duration_s": 1.0, "warmup_s": 0.2, "texts": 64,
        "lengths": {16: 0.7, 48: 0.3}, "p99_budget_ms": 10000, "reference_every_s": 0}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=12, help="candidates")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="evoforge-bench-")
    settings = EvalSettings.model_validate({"timing": {"lock_file": os.path.join(tmp, "timing.lock")}})
    task = TaskSpec(name="engine", args=ARGS)
    seeds = EngineTask(ARGS).seeds()
    overhead, total, ref, thr = [], [], [], []
    with LocalPool(workers=1) as pool:
        for i in range(args.k + 1):
            genome = seeds[i % len(seeds)]
            req = EvalRequest(key=f"{genome.id}-{i}", genome=genome, task=task, settings=settings,
                              cache_dir=os.path.join(tmp, "cache"))  # fmt: skip
            t0 = time.perf_counter()
            pool.submit(req)
            got = pool.next_result(300)
            wall = time.perf_counter() - t0
            assert got is not None and got[1].status == "ok", got
            t, m = got[1].timings, got[1].metrics
            if i == 0:
                continue  # the worker's start and first loads
            overhead.append(t["overhead_s"])
            total.append(wall)
            ref.append(m["ref_throughput"])
            thr.append(m["throughput"])
            print(" ".join(f"{k}={v:.3f}s" for k, v in t.items()),
                  f"throughput={m['throughput']:.1f} ref={m['ref_throughput']:.1f}", flush=True)  # fmt: skip
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.k} engine candidates (load {ARGS['warmup_s']} + {ARGS['duration_s']} s, reference before each): "
          f"overhead median {statistics.median(overhead) * 1e3:.0f} ms, wall median {statistics.median(total):.2f} s, "
          f"reference {statistics.median(ref):.1f} sentences/s, candidates {statistics.median(thr):.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

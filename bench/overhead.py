"""Evaluation overhead per candidate beyond compile and kernel/reference time (target: <= 20 ms).

Evaluates K trivial vecadd candidates through LocalPool twice: the first pass fills the compile cache,
the second is measured. Two figures per candidate:
  in-worker   = the cascade's own ``overhead_s`` (total - compile - time inside kernel/reference calls
                - timing-lock wait);
  end-to-end  = controller wall time from submit to result, minus compile and call time (adds the
                pickling, the socket round trip and the pool's thread hand-offs).

    python bench/overhead.py --k 50
    python bench/overhead.py --k 50 --executor ray     # the same through a one-node Ray cluster started here

With ``--executor ray`` the end-to-end figure includes what Ray adds per candidate (the request and
result through the object store, the actor's hand-off to its local pool); compare it with the local one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TASK_DIR = os.path.join(os.path.dirname(HERE), "tests", "runtime")
sys.path.insert(0, os.path.dirname(HERE))

from genome import Genome  # noqa: E402
from runtime import EvalRequest, EvalSettings, TaskSpec  # noqa: E402
from runtime.executors import LocalPool  # noqa: E402

BODY = "void kernel(int n, float a, float b, const float *x, float *y) {{ /* {i} */\n" \
       "    for (int i = 0; i < n; i++) y[i] = a * x[i] + b;\n}}\n"  # fmt: skip


def _p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=50, help="candidates")
    ap.add_argument("--n", type=int, default=4096, help="vecadd size of the full case")
    ap.add_argument("--each", action="store_true", help="print every candidate's timings")
    ap.add_argument("--executor", choices=("local", "ray"), default="local")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="evoforge-bench-")
    settings = EvalSettings.model_validate({"timing": {"lock_file": os.path.join(tmp, "timing.lock")}})
    task = TaskSpec(name="vecadd_task:VecAdd", args={"n": args.n})
    genomes = [Genome(source=BODY.format(i=i)) for i in range(args.k)]
    reqs = [EvalRequest(key=g.id, genome=g, task=task, settings=settings, cache_dir=os.path.join(tmp, "cache"),
                        sys_path=(TASK_DIR,)) for g in genomes]  # fmt: skip
    inside, end_to_end, calls = [], [], []
    cluster = None
    if args.executor == "ray":
        from ray.cluster_utils import Cluster

        from runtime.executors import RayPool

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 * 2**20,
                                                                "include_dashboard": False})  # fmt: skip
        executor = RayPool(cluster.address, workers_per_node=1)
    else:
        executor = LocalPool(workers=1)
    with executor as pool:
        for measured in (False, True):
            for req in reqs:
                t0 = time.perf_counter()
                pool.submit(req)
                got = pool.next_result(120)
                wall = time.perf_counter() - t0
                assert got is not None and got[1].status == "ok", got
                t = got[1].timings
                if measured:
                    assert t.get("compile_s", 0.0) == 0.0 and got[1].metrics["compile_cached"]
                    inside.append(t["overhead_s"])
                    end_to_end.append(wall - t["calls_s"] - t.get("lock_wait_s", 0.0))
                    calls.append(t["calls_s"])
                    if args.each:
                        m = got[1].metrics
                        print(" ".join(f"{k}={v * 1e3:.2f}ms" for k, v in t.items()),
                              f"rounds={m.get('n_repeats')} calls/request={m.get('calls_per_request')} "
                              f"uncertainty={m.get('rel_uncertainty')}")  # fmt: skip
    if cluster is not None:
        cluster.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)
    ms = 1e3
    print(f"{args.k} cached vecadd candidates (n={args.n}), 1 worker ({args.executor}); time inside calls: "
          f"median {statistics.median(calls) * ms:.2f} ms")  # fmt: skip
    dispatch = [e - i for e, i in zip(end_to_end, inside, strict=True)]
    print(f"dispatch (end-to-end - in-worker): median {statistics.median(dispatch) * ms:.2f} ms "
          f"(the executor's own cost; target with Ray <= 5 ms more than the local pool's)")  # fmt: skip
    for name, xs in (("in-worker", inside), ("end-to-end", end_to_end)):
        print(f"overhead {name:>10}: median {statistics.median(xs) * ms:6.2f} ms   p90 {_p(xs, 0.9) * ms:6.2f} ms"
              f"   (target <= 20 ms)")  # fmt: skip


if __name__ == "__main__":
    main()
